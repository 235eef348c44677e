"""Domain errors of the daemon; the servicers map each to one gRPC status."""

from __future__ import annotations

from hetpilot.planner.errors import ValidationError

__all__ = ["FailedPrecondition", "NotFound", "TooLarge", "ValidationError"]


class NotFound(LookupError):
    """No such job or agent for this caller (another owner's job included)."""


class TooLarge(ValueError):
    """A request over a size limit (RESOURCE_EXHAUSTED)."""


class FailedPrecondition(RuntimeError):
    """The request is well formed but the object's state forbids it (a cancelled job)."""
