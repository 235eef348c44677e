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
from operator import attrgetter
from types import MappingProxyType
from typing import TypeVar

import numpy as np

from .types import COST_KINDS, Cluster, Plan

__all__ = ["Candidate", "Frontier", "budget_multiplier", "frontier", "lower_hull", "plan_costs",
           "tie_share"]

_T = TypeVar("_T")


def plan_costs(cluster: Cluster, plan: Plan) -> Mapping[str, float]:
    """Cost rates of a plan (spec 5.5): sums over the devices it uses."""
    used = [cluster.by_id[d] for d in plan.devices]
    # each device's Device.cost(k), summed in order: the same float, with fewer steps
    return MappingProxyType({k: sum(map(float, map(attrgetter(k), used))) for k in COST_KINDS})


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


def _stack(frontiers: Sequence[Frontier],
           paid: Sequence[np.ndarray] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Frontiers as (cost, time, paid) matrices, one row per slot, each row
    padded with copies of its last (dearest, fastest) point; None if empty."""
    pays = list(paid) if paid is not None else [f[0] for f in frontiers]
    both = [(f, p) for f, p in zip(frontiers, pays, strict=True) if len(f[0])]
    if not both:
        return None
    width = max(len(f[0]) for f, _ in both)
    cost = np.empty((len(both), width))
    time = np.empty((len(both), width))
    pay = np.empty((len(both), width))
    for i, ((c, t), p) in enumerate(both):
        cost[i, :len(c)], cost[i, len(c):] = c, c[-1]
        time[i, :len(t)], time[i, len(t):] = t, t[-1]
        pay[i, :len(p)], pay[i, len(p):] = p, p[-1]
    return cost, time, pay


def _spend(stack: tuple[np.ndarray, np.ndarray, np.ndarray], lam: float, dear: bool = False) -> float:
    """Average paid cost of each slot's minimiser of T + lam c; ties go to the
    cheapest (or the dearest) minimiser."""
    cost, time, pay = stack
    score = time + lam * cost
    width = cost.shape[1]
    idx = width - 1 - np.argmin(score[:, ::-1], axis=1) if dear else np.argmin(score, axis=1)
    return float(pay[np.arange(len(pay)), idx].mean())


def _soft_spend(stack: tuple[np.ndarray, np.ndarray, np.ndarray], lam: float,
                smooth: float) -> float:
    """Average paid cost when each slot takes each point of its frontier with
    probability proportional to ``exp(-(T + lam c - min) / (smooth * T_min))``:
    the softmin of the entropy-regularised programme, a temperature of
    ``smooth`` times the slot's fastest iteration time. Continuous and strictly
    decreasing in ``lam`` wherever a frontier has two points; the padding
    (copies of a row's last point) weighs nothing."""
    cost, time, pay = stack
    score = time + lam * cost
    real = np.ones(cost.shape, dtype=bool)
    real[:, 1:] = (cost[:, 1:] != cost[:, :-1]) | (time[:, 1:] != time[:, :-1])
    temp = smooth * np.maximum(time.min(axis=1, keepdims=True), 1e-12)
    w = np.where(real, np.exp(-(score - score.min(axis=1, keepdims=True)) / temp), 0.0)
    return float(((w * pay).sum(axis=1) / w.sum(axis=1)).mean())


def budget_multiplier(frontiers: Sequence[Frontier], budget: float,
                      paid: Sequence[np.ndarray] | None = None,
                      smooth: float = 0.0) -> float | None:
    """The Lagrange multiplier (seconds of iteration time per unit of cost rate) of

        min avg_s T_s  subject to  avg_s c_s <= budget

    where slot s picks a point of ``frontiers[s]`` or a mix of two (the
    offline oracle's linear programme over these slots): the smallest
    ``l >= 0`` at which each slot's minimiser of ``T + l * c`` costs at most
    ``budget`` on average. 0 when the fastest points fit; None when even the
    cheapest do not (or there are no slots).

    ``paid``, one array per frontier (its points' cost rates as they turned
    out: a slot's decision sees the previous slot's prices), makes the choice
    by the frontiers' costs and the average of what the choices paid: the
    rate that would have held the budget with the one-slot lag.

    ``smooth`` > 0 solves the entropy-regularised programme instead
    (:func:`_soft_spend`, temperature ``smooth`` times each slot's fastest
    iteration time). Why: the linear programme's spend is a step function of
    the rate, with a jump at every kink of a frontier that recurs in the
    slots (a price level held for a while). A budget inside such a jump pins
    the rate to that kink whatever the budget, so a controller learning its
    rate at ``budget - debt / horizon`` stops responding to its debt until the
    debt carries the target past the jump. The smoothed spend is continuous
    and strictly decreasing, so the rate follows the target; as ``smooth``
    goes to 0 it returns the linear programme's rate."""
    stack = _stack(frontiers, paid)
    if stack is None:
        return None
    cost, time, pay = stack
    limit = budget * (1 + 1e-9)

    def spend(lam: float, dear: bool = False) -> float:
        return _soft_spend(stack, lam, smooth) if smooth > 0 else _spend(stack, lam, dear)

    if spend(0.0) <= limit:
        return 0.0
    if float(pay[:, 0].mean()) > limit:
        return None
    dc, dt = np.diff(cost, axis=1), np.diff(time, axis=1)
    real = dc > 0  # the padding adds no segments
    top = 2.0 * (float(np.max(-dt[real] / dc[real])) if real.any() else 1.0)
    lo, hi = 0.0, top
    for _ in range(200):  # the soft choice still leans on dearer points at ``top``
        if not (smooth > 0 and spend(hi) > limit):
            break
        lo, hi = hi, 2 * hi
    for _ in range(60):  # the smallest rate whose minimisers fit
        mid = 0.5 * (lo + hi)
        if spend(mid) > limit:
            lo = mid
        else:
            hi = mid
    # where the minimisers cost exactly the budget over a range of rates (the
    # budget sits on a plan), take the middle of the range, not its edge (a tie);
    # the smoothed spend has that range too, to rounding (it leaks nothing there)
    a, b = hi, max(top, hi)  # hi may be past top (the doubling above)
    if spend(a, dear=True) < budget * (1 - 1e-9):
        return hi
    for _ in range(60):  # the largest rate whose dearest minimisers still spend it
        mid = 0.5 * (a + b)
        if spend(mid, dear=True) >= budget * (1 - 1e-9):
            a = mid
        else:
            b = mid
    return 0.5 * (hi + a)


def tie_share(frontiers: Sequence[Frontier], lam: float, budget: float,
              paid: Sequence[np.ndarray] | None = None, rel: float = 1e-6) -> float:
    """Where the rate ``lam`` sits on a kink (ties between neighbouring points
    of some frontiers): the share ``x`` of the tied slots that must take the
    dearer point for the slots to spend ``budget`` on average, the linear
    programme's mix, ``(budget - S_cheap) / (S_dear - S_cheap)`` with
    ``S_cheap`` (``S_dear``) the average spend with every tie going to the
    cheaper (dearer) point; clipped to [0, 1]. 0 without ties."""
    stack = _stack(frontiers, paid)
    if stack is None or lam <= 0:
        return 0.0
    cheap, dear = _spend(stack, lam * (1 + rel)), _spend(stack, lam * (1 - rel))
    if dear <= cheap:
        return 0.0
    return min(max((budget - cheap) / (dear - cheap), 0.0), 1.0)
