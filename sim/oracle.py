"""The best any policy could do on a scenario's prices: the offline bound.

The same bound as ``bench/sim_oracle.py``: the oracle knows every slot's
truth in advance, pays nothing to switch and may split a slot between plans
(time-sharing). Over the plans the controller weighs each slot (its
``candidates``) it solves the linear program

    min  (1/N) sum_t sum_i x_ti T_ti
    s.t. (1/N) sum_t sum_i x_ti c_ti <= budget,  sum_i x_ti = 1,  x >= 0

for one cost kind. With a single coupling constraint the LP's optimum equals
its Lagrangian dual ``max_{l >= 0} (1/N) sum_t min_i (T_ti + l c_ti) - l budget``
(strong duality), a concave piecewise-linear function of one variable that
is maximised here by bisection on its slope, in numpy: thousands of slots
with hundreds of candidates each take a fraction of a second, where cvxpy
needs seconds. ``bench/sim_oracle.py`` solves the primal with cvxpy; the
test ``tests/planner/test_oracle_traces.py`` checks the two agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from hetpilot.planner.candidates import Candidate
from hetpilot.planner.types import Cluster

from .engine import Observer
from .scenario import Timeline

__all__ = ["OracleBound", "lagged_bound", "lagged_from_points", "oracle_bound", "oracle_from_points"]


@dataclass(frozen=True)
class OracleBound:
    iteration_s: float
    """Average iteration time of the best time-shared schedule (inf: infeasible)."""
    cost: float
    """Its average cost rate (the budget when the budget binds)."""
    multiplier: float
    """The budget's Lagrange multiplier, seconds per unit of cost rate (0: not binding)."""
    binding: bool
    """False when the fastest plan of every slot fits the budget on average."""


def oracle_from_points(times: Sequence[np.ndarray], costs: Sequence[np.ndarray],
                       weights: Sequence[float], budget: float) -> OracleBound:
    """The LP above over per-state candidate arrays (``weights`` sum to 1)."""
    w = np.asarray(weights, dtype=float)

    def argmins(lam: float, cheap_ties: bool) -> tuple[float, float, float]:
        """(avg T, avg c, sum w min(T + lam c)) of the per-state minimisers."""
        avg_t = avg_c = val = 0.0
        for wi, t, c in zip(w, times, costs, strict=True):
            s = t + lam * c
            m = s.min()
            tie = np.flatnonzero(s <= m + 1e-12 * max(1.0, abs(m)))
            j = tie[np.argmin(c[tie])] if cheap_ties else tie[np.argmax(c[tie])]
            avg_t += float(wi * t[j])
            avg_c += float(wi * c[j])
            val += float(wi * m)
        return avg_t, avg_c, val

    t0, c0, _ = argmins(0.0, cheap_ties=True)
    if c0 <= budget * (1 + 1e-12):
        return OracleBound(t0, c0, 0.0, False)
    floor = float(sum(wi * c.min() for wi, c in zip(w, costs, strict=True)))
    if floor > budget * (1 + 1e-12):
        return OracleBound(float("inf"), floor, float("inf"), True)
    lo, hi = 0.0, 1.0
    while argmins(hi, cheap_ties=True)[1] > budget:
        hi *= 2.0
    for _ in range(100):  # slope of the dual: avg c of the minimisers - budget
        mid = 0.5 * (lo + hi)
        if argmins(mid, cheap_ties=True)[1] > budget:
            lo = mid
        else:
            hi = mid
    # at the kink, mix the dear and the cheap minimisers so that the budget is met
    t_hi, c_hi, _ = argmins(lo, cheap_ties=False)
    t_lo, c_lo, _ = argmins(hi, cheap_ties=True)
    x = 1.0 if c_hi <= c_lo else min(max((budget - c_lo) / (c_hi - c_lo), 0.0), 1.0)
    return OracleBound(x * t_hi + (1 - x) * t_lo, x * c_hi + (1 - x) * c_lo, 0.5 * (lo + hi), True)


def oracle_bound(timeline: Timeline, candidates: Callable[[Cluster], Sequence[Candidate]],
                 slots: int, kind: str = "price_per_hour") -> OracleBound:
    """The bound over the first ``slots`` slots of ``timeline`` at its average
    budget of ``kind``; ``candidates(truth)`` lists what a slot weighs
    (``Controller.candidates``). Slots sharing one truth object are grouped."""
    groups: dict[int, tuple[Cluster, int]] = {}
    for t in range(slots):
        truth = timeline.truth(t)
        _, n = groups.get(id(truth), (truth, 0))
        groups[id(truth)] = (truth, n + 1)
    times, costs, weights = [], [], []
    for truth, n in groups.values():
        cands = candidates(truth)
        times.append(np.array([c.iteration_s for c in cands]))
        costs.append(np.array([c.costs.get(kind, 0.0) for c in cands]))
        weights.append(n / slots)
    budget = sum(timeline.budgets(t).get(kind, float("inf")) for t in range(slots)) / slots
    return oracle_from_points(times, costs, weights, budget)


def lagged_from_points(times: Sequence[np.ndarray], seen: Sequence[np.ndarray],
                       paid: Sequence[np.ndarray], budget: float) -> OracleBound:
    """The oracle's rule with the controller's information: one rate ``l``,
    chosen in hindsight, and each slot the minimiser of ``T + l * seen``
    (the cost rates the slot's decision could see: the previous slot's
    prices), paying ``paid`` (the slot's true cost rates). ``l`` is the
    smallest rate whose slots pay at most ``budget`` on average, mixing the
    two sides of the last tie so that they pay it exactly. Not a bound (a
    policy may vary its rate), a reference: how far a policy that knew the
    best single exchange rate in advance but saw prices a slot late gets.
    Slots weigh equally."""
    n = len(times)

    def pick(lam: float, cheap_ties: bool) -> tuple[float, float]:
        avg_t = avg_c = 0.0
        for t, c, p in zip(times, seen, paid, strict=True):
            s = t + lam * c
            m = s.min()
            tie = np.flatnonzero(s <= m + 1e-12 * max(1.0, abs(m)))
            j = tie[np.argmin(c[tie])] if cheap_ties else tie[np.argmax(c[tie])]
            avg_t += float(t[j]) / n
            avg_c += float(p[j]) / n
        return avg_t, avg_c

    t0, c0 = pick(0.0, cheap_ties=True)
    if c0 <= budget * (1 + 1e-12):
        return OracleBound(t0, c0, 0.0, False)
    hi = 1.0
    while pick(hi, cheap_ties=True)[1] > budget:
        if hi > 1e12:  # not even the cheapest choices fit
            return OracleBound(float("inf"), pick(hi, cheap_ties=True)[1], float("inf"), True)
        hi *= 2.0
    lo = 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if pick(mid, cheap_ties=True)[1] > budget:
            lo = mid
        else:
            hi = mid
    t_hi, c_hi = pick(lo, cheap_ties=False)
    t_lo, c_lo = pick(hi, cheap_ties=True)
    x = 1.0 if c_hi <= c_lo else min(max((budget - c_lo) / (c_hi - c_lo), 0.0), 1.0)
    return OracleBound(x * t_hi + (1 - x) * t_lo, x * c_hi + (1 - x) * c_lo, 0.5 * (lo + hi), True)


def lagged_bound(timeline: Timeline, candidates: Callable[[Cluster], Sequence[Candidate]],
                 slots: int, kind: str = "price_per_hour") -> OracleBound:
    """:func:`lagged_from_points` over the first ``slots`` slots: slot t weighs
    ``candidates`` of what a policy observes (the previous slot's
    measurements, the devices up in slot t; :class:`~hetpilot.sim.engine.Observer`)
    and pays their cost rates on slot t's truth. Iteration times are the
    candidates' own (on the observation): exact while only prices move."""
    observer = Observer(timeline)
    seen_by: dict[int, tuple[Cluster, np.ndarray, np.ndarray, list[list[int]]]] = {}
    times, seen, paid = [], [], []
    for t in range(slots):
        observed = observer.observe(t)
        hit = seen_by.get(id(observed))
        if hit is None:
            cands = candidates(observed)
            ids = [d.id for d in observed.devices]
            pos = {d: i for i, d in enumerate(ids)}
            hit = seen_by[id(observed)] = (
                observed, np.array([c.iteration_s for c in cands]),
                np.array([c.costs.get(kind, 0.0) for c in cands]),
                [[pos[d] for d in c.plan.devices] for c in cands])
        obs, t_arr, c_arr, used = hit
        truth = timeline.truth(t)
        price = np.array([truth.by_id[d.id].cost(kind) if d.id in truth.by_id else np.inf
                          for d in obs.devices])
        times.append(t_arr)
        seen.append(c_arr)
        paid.append(np.array([float(price[u].sum()) for u in used]))
    budget = sum(timeline.budgets(t).get(kind, float("inf")) for t in range(slots)) / slots
    return lagged_from_points(times, seen, paid, budget)
