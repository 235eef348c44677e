"""What the planner hands the controller: scored candidate plans.

The planner's tentative search (:func:`hetpilot.planner.search.candidate_plans`)
returns the best plan it found for each device subset and group structure it
tried; the Lyapunov controller scores each by ``V * T + sum_k Q_k * c_k`` and
picks one. Keeping the candidates (not only the fastest) is what lets the
controller trade speed for cost under budgets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

import numpy as np

from .types import COST_KINDS, Cluster, Plan

__all__ = ["Candidate", "Frontier", "budget_multiplier", "frontier", "lower_hull", "plan_costs"]

_T = TypeVar("_T")


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


#: A cost/time frontier: costs ascending, iteration times strictly descending,
#: convex (the lower convex hull of a slot's candidates for one cost kind).
Frontier = tuple[np.ndarray, np.ndarray]


def lower_hull(items: Sequence[_T], point: Callable[[_T], tuple[float, float]]) -> list[_T]:
    """The items whose (cost, time) ``point`` lies on the lower convex hull of all
    of them, cost ascending and time strictly descending: the plans (and, between
    two neighbours, the time-shared mixes) that no other mix beats on both. Of
    equal points the first listed wins."""
    pareto: list[_T] = []  # cost ascending, time strictly descending
    for item in sorted(items, key=point):  # stable: the first of equal points
        c, t = point(item)
        if pareto and t >= point(pareto[-1])[1]:
            continue
        while pareto and c <= point(pareto[-1])[0]:
            pareto.pop()
        pareto.append(item)
    hull: list[_T] = []
    for item in pareto:  # monotone chain: keep the turns that bend the right way
        c, t = point(item)
        while len(hull) >= 2:
            (c1, t1), (c2, t2) = point(hull[-2]), point(hull[-1])
            if (t2 - t1) * (c - c1) >= (t - t1) * (c2 - c1):
                hull.pop()
            else:
                break
        hull.append(item)
    return hull


def frontier(points: Sequence[tuple[float, float]]) -> Frontier:
    """The lower convex hull (:func:`lower_hull`) of (cost rate, iteration time) ``points``."""
    hull = lower_hull(points, lambda p: p)
    return (np.array([c for c, _ in hull], dtype=float), np.array([t for _, t in hull], dtype=float))


def budget_multiplier(frontiers: Sequence[Frontier], budget: float) -> float | None:
    """The Lagrange multiplier (seconds of iteration time per unit of cost rate) of

        min avg_s T_s  subject to  avg_s c_s <= budget

    where slot s picks a point of ``frontiers[s]`` or a mix of two (the
    offline oracle's linear programme over these slots): the smallest
    ``l >= 0`` at which each slot's minimiser of ``T + l * c`` costs at most
    ``budget`` on average. 0 when the fastest points fit; None when even the
    cheapest do not (or there are no slots)."""
    fr = [f for f in frontiers if len(f[0])]
    if not fr:
        return None
    width = max(len(f[0]) for f in fr)
    # pad each frontier with copies of its last (dearest, fastest) point
    cost = np.array([np.pad(c, (0, width - len(c)), mode="edge") for c, _ in fr])
    time = np.array([np.pad(t, (0, width - len(t)), mode="edge") for _, t in fr])
    rows = np.arange(len(fr))
    limit = budget * (1 + 1e-9)

    def spend(lam: float, dear: bool = False) -> float:
        """Average cost of each slot's minimiser of T + lam c; ties go to the
        cheapest (or the dearest) minimiser."""
        score = time + lam * cost
        idx = width - 1 - np.argmin(score[:, ::-1], axis=1) if dear else np.argmin(score, axis=1)
        return float(cost[rows, idx].mean())

    if spend(0.0) <= limit:
        return 0.0
    if float(cost[:, 0].mean()) > limit:
        return None
    steep = [float(np.max(-np.diff(t) / np.diff(c))) for c, t in fr if len(c) > 1]
    top = 2.0 * max(steep, default=1.0)
    lo, hi = 0.0, top
    for _ in range(60):  # the smallest rate whose minimisers fit
        mid = 0.5 * (lo + hi)
        if spend(mid) > limit:
            lo = mid
        else:
            hi = mid
    # where the minimisers cost exactly the budget over a range of rates (the
    # budget sits on a plan), take the middle of the range, not its edge (a tie)
    a, b = hi, top
    if spend(a, dear=True) < budget * (1 - 1e-9):
        return hi
    for _ in range(60):  # the largest rate whose dearest minimisers still spend it
        mid = 0.5 * (a + b)
        if spend(mid, dear=True) >= budget * (1 - 1e-9):
            a = mid
        else:
            b = mid
    return 0.5 * (hi + a)
