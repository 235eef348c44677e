"""Uneven data assignment across data-parallel groups.

Each group's makespan is close to affine in its number of microbatches,
``P_g(M) ~ a_g + b_g * M`` (fill/drain plus a per-microbatch cycle). The
continuous assignment is the linear programme

    minimise t  s.t.  a_g * u_g + b_g * M_g <= t,  sum_g M_g = N,
                      0 <= M_g <= cap_g * u_g ... (relaxed: u_g = 1)

written in cvxpy, built once per number of groups with ``cp.Parameter``s
(DPP). Each solve hands Clarabel the very matrices cvxpy builds for that
problem (a test holds the two to the same bytes), so it gets cvxpy's solution
without cvxpy's per-solve overhead, its compile for each new number of
classes, or its import (cvxpy and scipy.stats are big, and every full garbage
collection of the process walks them). Every solve starts cold (cvxpy would
warm-start Clarabel from the problem's previous solve, so its answer to the
same inputs depended on what was solved before), so solutions are memoised
on their inputs. cvxpy itself, also cold, answers where that path does not
apply or Clarabel does not solve it. Rounding then works on the *exact*
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
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from .errors import SolverError

__all__ = ["AssignmentLP", "assign_microbatches", "lp_data", "lp_problem", "solve_lp"]

_SOLVERS = ("CLARABEL", "HIGHS")


_SOLVED: dict[tuple[object, ...], np.ndarray] = {}
"""Solutions by their inputs (bit for bit), shared by the problems of every size."""


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


def solve_lp(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None = None,
) -> np.ndarray:
    """:meth:`AssignmentLP.solve` for ``len(fill)`` classes; builds (and compiles) the
    cvxpy problem only when the direct path cannot answer."""
    return _solve_memo(fill, cycle, cap, total, count,
                       lambda *args: lp_problem(len(fill))._solve(*args))


def _solve_memo(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None,
    fallback: Callable[..., np.ndarray],
) -> np.ndarray:
    """Memoised on the inputs bit for bit (every solve starts cold, so the same inputs
    give the same solution): a controller re-planning an unchanged structure each slot,
    or the same structure in several device subsets, asks again."""
    def bits(values: Sequence[float] | None) -> bytes | None:
        return None if values is None else np.asarray(values, dtype=float).tobytes()

    key = (len(fill), bits(fill), bits(cycle), bits(cap), float(total), bits(count))
    found = _SOLVED.get(key)
    if found is None:
        found = _clarabel(fill, cycle, cap, total, count)
        if found is None:
            found = fallback(fill, cycle, cap, total, count)
        if len(_SOLVED) >= 4096:
            _SOLVED.clear()
        _SOLVED[key] = found
    return found.copy()


class CSC:
    """A compressed-sparse-column matrix as Clarabel's binding reads one (these
    attributes of a canonical scipy CSC matrix), so the LP needs no scipy import."""

    has_canonical_format = True

    def __init__(self, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
                 shape: tuple[int, int]) -> None:
        self.data = data
        self.indices = indices
        self.indptr = indptr
        self.shape = shape
        self.nnz = len(data)


def lp_data(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None = None,
) -> tuple[CSC, np.ndarray, np.ndarray]:
    """(A, b, c) of the conic form cvxpy gives :class:`AssignmentLP` for Clarabel:
    variables (t, M_1..M_k); rows: sum count*M = total (zero cone), then, in the
    nonnegative cone, t - fill - cycle*M >= 0, M >= 0 and cap - M >= 0. A test
    holds it to cvxpy's ``get_problem_data`` byte for byte."""
    k = len(fill)
    a = np.asarray(fill, dtype=float)
    n = np.ones(k) if count is None else np.asarray(count, dtype=float)
    cols = np.arange(k, dtype=np.int64)
    data = np.concatenate((np.full(k, -1.0), np.stack(
        (n, np.asarray(cycle, dtype=float), np.full(k, -1.0), np.full(k, 1.0)), axis=1).ravel()))
    rows = np.concatenate((1 + cols, np.stack(
        (np.zeros(k, dtype=np.int64), 1 + cols, 1 + k + cols, 1 + 2 * k + cols), axis=1).ravel()))
    starts = np.concatenate(([0], k + 4 * np.arange(k + 1, dtype=np.int64)))
    A = CSC(data, rows, starts, (1 + 3 * k, 1 + k))
    b = np.concatenate(([float(total)], 0.0 - a, np.zeros(k), np.asarray(cap, dtype=float)))
    c = np.zeros(1 + k)
    c[0] = 1.0
    return A, b, c


def _clarabel(
    fill: Sequence[float],
    cycle: Sequence[float],
    cap: Sequence[float],
    total: int,
    count: Sequence[int] | None,
) -> np.ndarray | None:
    """The LP solved by Clarabel as cvxpy would call it (same data, default settings),
    or None where cvxpy must answer: a parameter it would reject or hold as an
    explicit zero, Clarabel not importable, or not solved."""
    k = len(fill)
    values = np.concatenate([np.asarray(v, dtype=float) for v in (fill, cycle, cap)]
                            + [np.asarray([float(total)])]
                            + ([] if count is None else [np.asarray(count, dtype=float)]))
    if k < 1 or not np.all(np.isfinite(values)) or np.any(values < 0):
        return None
    if np.any(np.asarray(cycle, dtype=float) == 0) or (count is not None and min(count) == 0):
        return None
    try:
        import clarabel

        A, b, c = lp_data(fill, cycle, cap, total, count)
        no_index = np.zeros(0, dtype=np.int32)
        P = CSC(np.zeros(0), no_index, np.zeros(k + 2, dtype=np.int32), (k + 1, k + 1))  # an LP
        settings = clarabel.DefaultSettings()
        settings.verbose = False
        cones = [clarabel.ZeroConeT(1), clarabel.NonnegativeConeT(3 * k)]
        solution = clarabel.DefaultSolver(P, c, A, b, cones, settings).solve()
    except Exception:  # pragma: no cover - a Clarabel that reads matrices otherwise: cvxpy answers
        return None
    if str(solution.status) not in ("Solved", "AlmostSolved") or solution.x is None:
        return None
    return np.clip(np.asarray(solution.x, dtype=float)[1:1 + k], 0.0, None)


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
        relaxed = solve_lp(
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

