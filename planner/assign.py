"""Uneven data assignment across data-parallel groups.

Each group's makespan is close to affine in its number of microbatches,
``P_g(M) ~ a_g + b_g * M`` (fill/drain plus a per-microbatch cycle). The
continuous assignment is the linear programme

    minimise t  s.t.  a_g * u_g + b_g * M_g <= t,  sum_g M_g = N,
                      0 <= M_g <= cap_g * u_g ... (relaxed: u_g = 1)

solved with cvxpy, built once per number of groups with ``cp.Parameter``s
(DPP), so re-solves only update values. Every solve starts cold (a warm start
from the problem's previous solve made its answer to the same inputs depend,
by about 1e-7, on what was solved before), so solutions are memoised on their
inputs: a controller re-planning an unchanged structure each slot, or the
same structure in several device subsets, asks again. cvxpy is imported when
the first problem is built, not with this module. When no bound is active at the
optimum (every class gets some microbatches and none reaches its cap: the common
case, and every LP of a 1f1b plan whose classes all take part), the optimum is
unique and has a closed form, all classes finishing together (:func:`closed_form`,
proof there); with a bound active, water-filling (:func:`water_fill`) finds an
exact optimum, the unique one except where a class's fill alone outlasts the
others' need (then the face's min-max corner). :func:`solve_lp` answers both
without cvxpy, which a plan imports only for an LP outside that domain. Rounding then works on the *exact*
makespans: floor the LP solution (keeping every group at >= 1 microbatch),
hand out the remaining microbatches one at a time to the group whose makespan
grows least, and finally move single microbatches off the slowest group while
that lowers the maximum. For nondecreasing ``P_g`` the greedy hand-out is
optimal for the integer min-max problem given the floor, so the result is
within one microbatch's cycle of the LP bound.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from . import memos
from .errors import SolverError

__all__ = ["CLOSED_FORM", "AssignmentLP", "assign_microbatches", "closed_form", "lp_problem", "solve_lp",
           "warm_up", "water_fill"]

_SOLVERS = ("CLARABEL", "HIGHS")


_SOLVED: dict[tuple[object, ...], np.ndarray] = {}
"""Solutions by their inputs (bit for bit), shared by the problems of every size."""
memos.register(_SOLVED.clear)


class AssignmentLP:
    """The DPP-compiled LP for K groups."""

    def __init__(self, k: int) -> None:
        import cvxpy as cp  # here, not at module import: cvxpy and scipy.stats are big

        self.k = k
        self.a = cp.Parameter(k, nonneg=True, name="fill_s")
        self.b = cp.Parameter(k, nonneg=True, name="cycle_s")
        self.cap = cp.Parameter(k, nonneg=True, name="max_microbatches")
        self.count = cp.Parameter(k, nonneg=True, name="groups_in_class")
        self.total = cp.Parameter(nonneg=True, name="microbatches")
        self.m = cp.Variable(k, name="M")
        self.t = cp.Variable(name="t")
        constraints = [
            self.a + cp.multiply(self.b, self.m) <= self.t,
            cp.sum(cp.multiply(self.count, self.m)) == self.total,
            self.m >= 0,
            self.m <= self.cap,
        ]
        self.problem = cp.Problem(cp.Minimize(self.t), constraints)
        # The parameters are this problem's inputs: setting them and solving must be
        # one step, or a second thread (the daemon plans several jobs at once) swaps
        # its values in between and each gets the other's answer.
        self._lock = threading.Lock()

    def solve(
        self,
        fill: Sequence[float],
        cycle: Sequence[float],
        cap: Sequence[float],
        total: int,
        count: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Microbatches per group of each class (``count[c]`` identical groups in class c).

        Memoised on the inputs: every solve starts cold, so the same inputs give the
        same solution, and a controller re-planning an unchanged structure each slot
        (or the same structure in several device subsets) asks for it again."""
        return _solve_memo(fill, cycle, cap, total, count, self._solve)

    def _solve(
        self,
        fill: Sequence[float],
        cycle: Sequence[float],
        cap: Sequence[float],
        total: int,
        count: Sequence[int] | None = None,
    ) -> np.ndarray:
        with self._lock:
            return self._solve_locked(fill, cycle, cap, total, count)

    def _solve_locked(
        self,
        fill: Sequence[float],
        cycle: Sequence[float],
        cap: Sequence[float],
        total: int,
        count: Sequence[int] | None,
    ) -> np.ndarray:
        import cvxpy as cp

        self.count.value = np.ones(self.k) if count is None else np.asarray(count, dtype=float)
        self.a.value = np.asarray(fill, dtype=float)
        self.b.value = np.asarray(cycle, dtype=float)
        self.cap.value = np.asarray(cap, dtype=float)
        self.total.value = float(total)
        errors = []
        for solver in _SOLVERS:
            try:
                self.problem.solve(solver=solver, warm_start=False)
            except (cp.error.SolverError, ValueError) as exc:  # pragma: no cover - solver specific
                errors.append(f"{solver}: {exc}")
                continue
            if self.problem.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) and self.m.value is not None:
                return np.clip(np.asarray(self.m.value, dtype=float), 0.0, None)
            errors.append(f"{solver}: {self.problem.status}")
        raise SolverError(f"data assignment LP failed: {'; '.join(errors)}")


@lru_cache(maxsize=64)
def lp_problem(k: int) -> AssignmentLP:
    return AssignmentLP(k)


def warm_up() -> None:
    """Import cvxpy and compile a small problem now: what the first LP would pay
    (about 0.7 s of CPU) before the first slot that needs it. A daemon calls this
    at start."""
    lp_problem(2).solve([0.0, 0.0], [1.0, 1.0], [2.0, 2.0], 2)


CLOSED_FORM = True
"""Whether :func:`solve_lp` answers LPs exactly (:func:`closed_form`, :func:`water_fill`)
instead of handing them to cvxpy. Tests turn it off to compare with cvxpy."""


def _lp_arrays(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The LP's inputs as arrays ``(a, b, cap, n)``, or None outside the domain the exact
    solutions assume (finite, ``a >= 0``, ``b > 0``, ``n >= 1``, ``N >= 0``)."""
    a = np.asarray(fill, dtype=float)
    b = np.asarray(cycle, dtype=float)
    caps = np.asarray(cap, dtype=float)
    n = np.ones(len(a)) if count is None else np.asarray(count, dtype=float)
    if (len(a) == 0 or not (len(b) == len(caps) == len(n) == len(a))
            or not np.all(np.isfinite(a) & np.isfinite(b) & np.isfinite(caps))
            or np.any(a < 0) or np.any(b <= 0) or np.any(n < 1) or total < 0):
        return None
    return a, b, caps, n


def closed_form(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None = None,
) -> np.ndarray | None:
    """The LP's optimum when no bound ``0 <= M_c <= cap_c`` is active there, else None.

    With every class finishing at the same time ``t``, ``M_c = (t - a_c) / b_c``
    and ``sum_c n_c M_c = N`` give

        t* = (N + sum_c n_c a_c / b_c) / sum_c n_c / b_c.

    If those ``M_c`` lie in ``[0, cap_c]``, ``(M, t*)`` is feasible, and it is the
    LP's *unique* optimum: any feasible ``(M', t)`` has ``M'_c <= (t - a_c) / b_c``
    (every ``b_c > 0``), so ``N = sum_c n_c M'_c <= sum_c n_c (t - a_c) / b_c``,
    which is ``< N`` for ``t < t*``; hence ``t >= t*``, and at ``t = t*`` each
    ``M'_c <= M_c`` with equal weighted sums forces ``M' = M``. So this is the
    answer any exact LP solver gives (cvxpy's interior point gets it to about
    1e-8). When a bound would be active (a class whose fill alone outlasts the
    others, a gpipe memory cap) or an input is outside the LP's domain, this
    returns None and the LP goes to :func:`water_fill`.
    """
    arrays = _lp_arrays(fill, cycle, cap, total, count)
    if arrays is None:
        return None
    a, b, caps, n = arrays
    weight = n / b
    t = (float(total) + float(np.sum(weight * a))) / float(np.sum(weight))
    m = (t - a) / b
    # Strictly inside, with a margin over the float error of the formula: a bound
    # within reach of rounding is left to the solver.
    margin = 1e-9 * max(1.0, float(total))
    if not (np.all(m > margin) and np.all(m < caps - margin)):
        return None
    return m


def water_fill(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None = None,
) -> np.ndarray | None:
    """An optimum of the LP with bounds active (water-filling), exact; None outside its domain.

    Every class's constraint ``a_c + b_c M_c <= t`` holds whatever its share, so
    ``t >= T0 = max_c a_c``, and for a given ``t >= T0`` the most class c can take is
    ``u_c(t) = min(cap_c, (t - a_c) / b_c)``. ``f(t) = sum_c n_c u_c(t)`` is
    continuous, nondecreasing and piecewise linear (a kink where a class reaches its
    cap), so the least feasible t is ``t* = T0`` if ``f(T0) >= N``, else the point
    where ``f(t*) = N``, found by walking the kinks in order: between two kinks the
    capped set S is fixed and

        t* = (N - sum_{c in S} n_c cap_c + sum_{c not in S} n_c a_c / b_c)
             / sum_{c not in S} n_c / b_c.

    When ``f(t*) = N`` the optimum is unique: any optimal M has ``M_c <= u_c(t*)``
    and ``sum_c n_c M_c = N = f(t*)``, so ``M_c = u_c(t*)``, which is what any exact
    LP solver returns (cvxpy to about 1e-8). When ``t* = T0`` and ``f(T0) > N`` (a
    class whose fill alone outlasts what the others need) the optimal face is more
    than a point, and a solver's answer depends on its method (cvxpy's interior point
    lands inside the face). This takes the lexicographic min-max point of the face,
    which depends on the inputs only: the classes with ``a_c = T0`` get 0 (every
    optimum gives them 0), and the others' shares are this LP's optimum over them,
    with the same N (feasible for the whole LP: it ends before T0). Without an
    active bound this is :func:`closed_form`'s answer.
    """
    arrays = _lp_arrays(fill, cycle, cap, total, count)
    if arrays is None:
        return None
    a, b, caps, n = arrays
    if np.any(caps < 0) or float(n @ caps) < total:
        return None
    out = np.zeros(len(a))
    live = np.ones(len(a), dtype=bool)
    margin = 1e-9 * max(1.0, float(total))
    while True:
        start = float(np.max(a[live]))
        at_start = np.where(live, np.minimum(caps, np.maximum(start - a, 0.0) / b), 0.0)
        reach = float(n @ at_start)
        if reach > total + margin:  # the optimal face is more than a point: drop the last
            live &= a < start
            continue
        if reach >= total - margin:
            out[live] = at_start[live]
            return out
        break
    full = a + b * caps  # the t at which each class reaches its cap
    capped = live & (full <= start)
    for edge in sorted(float(x) for x in full[live & ~capped]):
        free = live & ~capped
        weight = n[free] / b[free]
        t = ((float(total) - float(n[capped] @ caps[capped]) + float(weight @ a[free]))
             / float(np.sum(weight)))
        if t <= edge:
            out[capped] = caps[capped]
            out[free] = np.minimum(np.maximum((t - a[free]) / b[free], 0.0), caps[free])
            return out
        capped = live & (full <= edge)
    return None  # pragma: no cover - f(max full) = n @ caps >= N ends the walk above


def solve_lp(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None = None,
) -> np.ndarray:
    """:meth:`AssignmentLP.solve` for ``len(fill)`` classes: in closed form when no
    bound is active at the optimum (:func:`closed_form`, the same optimum), else by
    :func:`water_fill` (cvxpy's optimum where it is unique); cvxpy is then not even
    imported. Inputs outside their domain go to cvxpy, building (and compiling) the
    problem for that size only when the memo cannot answer."""
    if CLOSED_FORM:
        found = closed_form(fill, cycle, cap, total, count)
        if found is None:
            found = water_fill(fill, cycle, cap, total, count)
        if found is not None:
            return found
    return _solve_memo(fill, cycle, cap, total, count,
                       lambda *args: lp_problem(len(fill))._solve(*args))


def _solve_memo(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None,
    solve: Callable[..., np.ndarray],
) -> np.ndarray:
    """Memoised on the inputs bit for bit (every solve starts cold, so the same inputs
    give the same solution)."""
    def bits(values: Sequence[float] | None) -> bytes | None:
        return None if values is None else np.asarray(values, dtype=float).tobytes()

    key = (len(fill), bits(fill), bits(cycle), bits(cap), float(total), bits(count))
    found = _SOLVED.get(key)
    if found is None:
        found = solve(fill, cycle, cap, total, count)
        if len(_SOLVED) >= 4096:
            _SOLVED.clear()
        _SOLVED[key] = found
    return found.copy()


def _relaxed(fill: Sequence[float], cycle: Sequence[float], cap: Sequence[float],
             total: int, count: Sequence[int]) -> np.ndarray:
    """:func:`solve_lp`, or shares in proportion to each class's speed where the
    solvers fail. They do on times spanning hundreds of orders of magnitude (an agent
    reported a device of 1e-300 TFLOP/s); the exact filling that follows corrects
    the shares either way."""
    try:
        return solve_lp(fill, cycle, cap, total, count)
    except SolverError:
        speed = np.array([1.0 / c if 0 < c < math.inf else 0.0 for c in cycle])
        share = speed * np.asarray(count, dtype=float)
        if not share.sum() > 0:
            return np.full(len(fill), total / max(1, sum(count)))
        return np.minimum(total * speed / share.sum(), np.asarray(cap, dtype=float))


def assign_microbatches(
    makespan: Callable[[int, int], float],
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[int],
    total: int,
    classes: Sequence[int] | None = None,
) -> list[int] | None:
    """Integer microbatches per group (each >= 1), or None if ``total`` cannot fit.

    ``makespan(g, M)`` is the exact makespan of group g with M microbatches
    (``inf`` when it does not fit in memory). ``classes[g]`` names groups that
    are identical (same devices, links and cut): the LP then has one variable
    per class, so a 1024-group plan of 4 device kinds solves a 4-variable LP.
    """
    k = len(fill)
    caps = [max(0, int(c)) for c in cap]
    if k == 0 or total < k or sum(min(c, total) for c in caps) < total or min(caps) < 1:
        return None
    if k == 1:
        counts = [total]
    else:
        cls = list(range(k)) if classes is None else list(classes)
        first: dict[int, int] = {}
        for g, c in enumerate(cls):
            first.setdefault(c, g)
        reps = list(first.values())
        index = {c: i for i, c in enumerate(first)}
        size = [0] * len(reps)
        for c in cls:
            size[index[c]] += 1
        relaxed = _relaxed(
            [fill[g] for g in reps], [cycle[g] for g in reps], [caps[g] for g in reps],
            total, size,
        ) if len(reps) > 1 else np.full(1, total / k)
        counts = [min(caps[g], max(1, math.floor(relaxed[index[cls[g]]] + 1e-9)))
                  for g in range(k)]
        while sum(counts) > total:  # the >= 1 floor can overshoot for tiny groups
            g = max(range(k), key=lambda i: (counts[i] > 1, makespan(i, counts[i])))
            counts[g] -= 1
    current = [makespan(g, counts[g]) for g in range(k)]
    heap = [(makespan(g, counts[g] + 1), g) for g in range(k) if counts[g] < caps[g]]
    heapq.heapify(heap)
    missing = total - sum(counts)
    while missing > 0 and heap:
        _, g = heapq.heappop(heap)
        counts[g] += 1
        missing -= 1
        current[g] = makespan(g, counts[g])
        if counts[g] < caps[g]:
            heapq.heappush(heap, (makespan(g, counts[g] + 1), g))
    if missing > 0:
        return None
    # local improvement: move one microbatch off the slowest group
    for _ in range(16):
        worst = max(range(k), key=current.__getitem__)
        if counts[worst] <= 1:
            break
        target = min(
            (i for i in range(k) if i != worst and counts[i] < caps[i]),
            key=lambda i: makespan(i, counts[i] + 1),
            default=None,
        )
        if target is None:
            break
        new_target = makespan(target, counts[target] + 1)
        new_worst = makespan(worst, counts[worst] - 1)
        if max(new_target, new_worst) >= current[worst] * (1 - 1e-12):
            break
        counts[worst] -= 1
        counts[target] += 1
        current[worst], current[target] = new_worst, new_target
    if any(not math.isfinite(p) for p in current):
        return None
    return counts

