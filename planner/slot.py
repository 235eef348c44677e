"""One slot as a controller's policy weighs it: the candidates, the queues, the weights.

A policy chooses among the slot's candidates (:class:`Slot`) by the
drift-plus-penalty objective ``a * T + sum_k w_k * Q_k * c_k`` (:class:`Scale`),
where a candidate other than the running plan also pays for the switch. The
virtual queues' arithmetic and the checks of budgets, queues and V live here
too, shared by the controller and the units it composes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .candidates import Candidate
from .controller_config import ControllerConfig, Gate
from .errors import ValidationError
from .switching import SwitchCost, switch_cost
from .types import COST_KINDS, Cluster, Model, Plan, budget_problem

__all__ = ["MAX_QUEUE", "MIN_UNIT", "Scale", "Slot", "capped", "check_budgets", "check_v",
           "updated_queues"]

MIN_UNIT = 1e-9
"""A budget below this (in its own unit) is weighed as this in the default V's scale."""

MAX_QUEUE = 1e150
"""The largest virtual queue (and shadow price) kept. A queue carried across a change
of V is its shadow price rescaled (``q * w / V``): a V near the smallest float (a
request may set 5e-324) would make it infinite, and the state then could not be
stored or read back. 1e150 still outweighs any cost times any iteration time, and
its squares and products with the weights stay finite."""


def check_budgets(budgets: Mapping[str, Any], path: str, *, rates: bool = False
                   ) -> dict[str, float]:
    """Per cost kind, finite numbers >= 0 (queues, debts' bounds); with ``rates``,
    budgets (:func:`~hetpilot.planner.types.budget_problem`: 0 or in [1e-9, 1e12])."""
    out: dict[str, float] = {}
    for kind, value in budgets.items():
        if kind not in COST_KINDS:
            raise ValidationError(f"{path}.{kind}", f"unknown cost kind; known: {', '.join(COST_KINDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValidationError(f"{path}.{kind}", f"must be a finite number, got {value!r}")
        if value < 0:
            raise ValidationError(f"{path}.{kind}", f"must be >= 0, got {value}")
        if rates and (problem := budget_problem(float(value))) is not None:
            raise ValidationError(f"{path}.{kind}", problem)
        out[kind] = float(value)
    return out


def check_v(value: Any, path: str) -> float:
    """A finite V >= 0; 0 (:data:`DEFAULT_V`) means the job gives none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValidationError(path, f"must be a finite number, got {value!r}")
    if value < 0:
        raise ValidationError(path, f"must be > 0, or 0 for the default, got {value}")
    return float(value)


@dataclass(frozen=True)
class Scale:
    """How the default V weighs a slot: ``a * T + sum_k w_k * Q_k * c_k``."""

    a: float
    """Weight of the iteration time (the job's V, or default_v / T_ref)."""
    w: Mapping[str, float]
    """Weight of each queue (1 with the job's V, 1 / b_k**2 with the default)."""
    t_ref: float = 0.0
    """The default's reference iteration time (0 with the job's own V)."""

    def objective(self, cand: Candidate, queues: Mapping[str, float]) -> float:
        return cand.score(self.a, {k: self.w.get(k, 1.0) * q for k, q in queues.items()})

    def shadow(self, kind: str, queue: float) -> float:
        """Seconds of iteration time a unit of cost rate of ``kind`` is worth."""
        return min(self.w.get(kind, 1.0) * queue / self.a, MAX_QUEUE)

    def queue(self, kind: str, shadow: float) -> float:
        return min(shadow * self.a / self.w.get(kind, 1.0), MAX_QUEUE)

    def contract_V(self, kinds: Sequence[str]) -> float:
        """The contract's V equivalent to this scale for the first kind."""
        if not kinds:
            return self.a
        return self.a / self.w.get(kinds[0], 1.0)


def updated_queues(queues: Mapping[str, float], budgets: Mapping[str, float],
                   costs: Mapping[str, float]) -> dict[str, float]:
    """``Q_k(t+1) = max(Q_k + c_k - budget_k, 0)`` (bounded by :data:`MAX_QUEUE`)."""
    return {k: min(max(queues.get(k, 0.0) + costs.get(k, 0.0) - b, 0.0), MAX_QUEUE)
            for k, b in budgets.items()}


def capped(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """Queues (or shadow prices) of a stored state, an infinite one as :data:`MAX_QUEUE`:
    a daemon before that bound stored ``Infinity`` and could not read it back."""
    return {k: MAX_QUEUE if v == math.inf else v for k, v in values.items()}


@dataclass
class Slot:
    """What a policy sees of one slot (built by :meth:`~.controller.Controller.step`)."""

    observed: Cluster
    """The (predicted) cluster the slot plans on."""
    model: Model
    plan: Plan | None
    """The plan that ran in the last slot (None before the first)."""
    running: Candidate | None
    """That plan re-scored on ``observed``, when it can still run."""
    pool: list[Candidate]
    """The candidates other than the running plan (a policy may reorder it)."""
    queues: Mapping[str, float]
    scale: Scale
    budgets: Mapping[str, float]
    config: ControllerConfig
    gate: Gate | None
    learning: bool
    """Whether the slot weighs cost by a learned exchange rate (:mod:`.exchange_rate`)."""

    def switch(self, to: Plan) -> SwitchCost:
        """The cost of switching from the last slot's plan to ``to``."""
        return switch_cost(self.observed, self.model, self.plan, to)

    def fits(self, cand: Candidate) -> bool:
        """Whether ``cand``'s cost rates are within every budget."""
        return all(cand.costs.get(k, 0.0) <= b * (1 + 1e-9) for k, b in self.budgets.items())
