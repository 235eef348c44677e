"""What the planner hands the controller: scored candidate plans.

The planner's tentative search (:func:`hetpilot.planner.search.candidate_plans`)
returns the best plan it found for each device subset and group structure it
tried; the Lyapunov controller scores each by ``V * T + sum_k Q_k * c_k`` and
picks one. Keeping the candidates (not only the fastest) is what lets the
controller trade speed for cost under budgets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .types import COST_KINDS, Cluster, Plan

__all__ = ["Candidate", "plan_costs"]


def plan_costs(cluster: Cluster, plan: Plan) -> Mapping[str, float]:
    """Cost rates of a plan (spec 5.5): sums over the devices it uses."""
    used = [cluster.by_id[d] for d in plan.devices]
    return MappingProxyType({k: sum(d.cost(k) for d in used) for k in COST_KINDS})


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    iteration_s: float
    """Reference-model iteration time on the cluster it was planned for."""
    costs: Mapping[str, float] = field(default_factory=dict)
    """Cost rate per kind (price_per_hour, power_watts)."""
    label: str = ""
    """Which structure of the tentative search produced it (for logs)."""

    def score(self, V: float, queues: Mapping[str, float]) -> float:
        """Drift-plus-penalty objective ``V * T + sum_k Q_k * c_k``."""
        return V * self.iteration_s + sum(q * self.costs.get(k, 0.0) for k, q in queues.items())
