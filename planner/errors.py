"""Typed errors of the planning core.

Every error a user can cause names the offending field, so that the CLI can
print one line and exit 2 and a gRPC servicer can map it to INVALID_ARGUMENT.
"""

from __future__ import annotations

__all__ = [
    "DeadlockError",
    "InfeasibleError",
    "InvalidPlanError",
    "PlanningError",
    "SolverError",
    "ValidationError",
]


class PlanningError(Exception):
    """Base class of every error raised by hetpilot.planner."""


class ValidationError(PlanningError, ValueError):
    """Input that does not follow spec v1: ``field: problem``."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # pickled across processes (the daemon plans in its own); the default
        # would call __init__ with the one formatted message
        return type(self), (self.field, self.problem)


class InvalidPlanError(ValidationError):
    """A well-formed plan that breaks a validity rule of spec section 4."""


class DeadlockError(InvalidPlanError):
    """A custom microbatch order that cannot finish (spec section 5.2)."""


class InfeasibleError(PlanningError):
    """No plan fits the devices' memory (CLI exit code 3)."""


class SolverError(PlanningError):
    """Every solver failed on a subproblem (infeasible, unbounded or inaccurate)."""
