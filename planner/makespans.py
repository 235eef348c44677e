"""Exact makespans of one pipeline group under a built-in schedule, fast.

The planner asks for a group's makespan at many microbatch counts M, and for
many cuts at once; the reference simulation (:func:`~.refmodel.group_makespan`)
answers one (cut, M) at a time. Here, with the reference's arithmetic:

* :func:`exact_makespan`: one 1f1b simulation answers every M up to the one it
  ran at (only the drains differ);
* :func:`fast_makespan`: past a transient, the makespan is periodic in M and is
  extrapolated (planner-only; :func:`~.search.make_plan` re-scores exactly);
* :func:`proxy_makespan`: a closed-form estimate that ranks cuts at large M;
* :func:`vector_makespans`: the simulation run on columns, every cut at once.
"""

from __future__ import annotations

import contextlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from . import memos
from .refmodel import GroupTimes, group_makespan
from .refmodel import _cached_makespan as _reference_makespans  # the reference's memo
from .schedules import order

__all__ = ["exact_makespan", "fast_makespan", "op_sequence", "proxy_makespan",
           "vector_makespans"]


class _Trace:
    """A 1f1b simulation at ``m`` microbatches: every backward's end and arrival."""

    __slots__ = ("b_arrive", "b_end", "m")

    def __init__(self, m: int, b_end: list[array[float]], b_arrive: list[array[float]]) -> None:
        self.m = m
        self.b_end = b_end
        self.b_arrive = b_arrive


def _trace_1f1b(fwd: Sequence[float], bwd: Sequence[float], comm: Sequence[float],
                m: int) -> _Trace:
    """:func:`~hetpilot.planner.refmodel.pipeline_makespan` on the 1f1b orders at
    ``m >= S`` microbatches, keeping each backward's end and each backward
    transfer's arrival (so that :func:`_drain` can answer any S <= M <= m).

    Every op gets the reference's value (the same operands, the same float
    operations); only the order in which ops are visited is fixed in advance
    instead of found by a work list. Stage j's order is S - 1 - j warm-up
    forwards, then (forward, backward) pairs, then the remaining backwards. The
    order visited: first each stage's forwards up to its first pair's, stage 0
    first (each needs only the stage before it); then round r = 0 .. m - 1
    visits stages last to first, each running its backward of microbatch r (it
    needs the next stage's, just visited) and then its next forward, which
    needs the previous stage's forward of round r - 1. Each stage's own ops,
    and so each channel's transfers, keep their order.
    """
    n = len(fwd)
    last = n - 1
    f_end = [[0.0] * m for _ in range(n)]
    f_arrive = [[0.0] * m for _ in range(n)]
    b_end = [[0.0] * m for _ in range(n)]
    b_arrive = [[0.0] * m for _ in range(n)]
    clock = [0.0] * n
    fwd_chan = [0.0] * n
    bwd_chan = [0.0] * n
    for j in range(n):
        f_dur, t, chan = fwd[j], 0.0, 0.0
        my_f_end, my_f_arrive = f_end[j], f_arrive[j]
        for k in range(last - j + 1):
            ready = my_f_arrive[k] if j else 0.0
            t = (ready if ready > t else t) + f_dur
            my_f_end[k] = t
            if j != last:
                arrive = (t if t > chan else chan) + comm[j]
                chan = arrive
                f_arrive[j + 1][k] = arrive
        clock[j] = t
        fwd_chan[j] = chan
    last_f_end = f_end[last]
    for r in range(m):
        for j in range(last, -1, -1):
            t = clock[j]
            ready = last_f_end[r] if j == last else b_arrive[j][r]
            t = (ready if ready > t else t) + bwd[j]
            b_end[j][r] = t
            if j:
                chan = bwd_chan[j - 1]
                arrive = (t if t > chan else chan) + comm[j - 1]
                bwd_chan[j - 1] = arrive
                b_arrive[j - 1][r] = arrive
            k = last - j + r + 1
            if k < m:
                ready = f_arrive[j][k] if j else 0.0
                t = (ready if ready > t else t) + fwd[j]
                f_end[j][k] = t
                if j != last:
                    chan = fwd_chan[j]
                    arrive = (t if t > chan else chan) + comm[j]
                    fwd_chan[j] = arrive
                    f_arrive[j + 1][k] = arrive
            clock[j] = t
    return _Trace(m, [array("d", row) for row in b_end], [array("d", row) for row in b_arrive])


def _drain(trace: _Trace, bwd: Sequence[float], comm: Sequence[float], m: int) -> float:
    """The 1f1b makespan at ``m`` (S <= m <= trace.m microbatches), exactly.

    With M >= S microbatches, stage j's 1f1b order at M is S - j - 1 warm-up
    forwards, M - (S - j - 1) (forward, backward) pairs, then the drain: the
    backwards of microbatches M - (S - j - 1) .. M - 1. Everything before the
    drain is a prefix of the order at any larger M and depends only on ops of
    such prefixes, so the simulation at ``trace.m`` computed it with the same
    values; only the drains are simulated here, last stage first (each needs
    the drain of the stage after it), with the same arithmetic as
    :func:`~hetpilot.planner.refmodel.pipeline_makespan`.
    """
    n = len(bwd)
    b_end, b_arrive = trace.b_end, trace.b_arrive
    clock = [0.0] * n
    clock[n - 1] = b_end[n - 1][m - 1]
    after: list[float] = []  # drain of stage j + 1: ends of backwards lo + 1 .. m - 1
    for j in range(n - 2, -1, -1):
        lo = m - (n - 1 - j)  # first backward of stage j's drain
        t = b_end[j][lo - 1]
        chan = b_arrive[j][lo - 1]
        c, b_dur = comm[j], bwd[j]
        sent = b_end[j + 1][lo]
        ends = []
        for i in range(m - lo):
            if i:
                sent = after[i - 1]
            arrive = (sent if sent > chan else chan) + c
            chan = arrive
            t = (arrive if arrive > t else t) + b_dur
            ends.append(t)
        clock[j] = t
        after = ends
    return max(clock)


_TRACES: OrderedDict[GroupTimes, _Trace] = OrderedDict()
_TRACES_SIZE = 2048


def exact_makespan(times: GroupTimes, schedule: str, microbatches: int) -> float:
    """:func:`~hetpilot.planner.refmodel.group_makespan` of a built-in schedule, the
    same float; for 1f1b with M >= S, one simulation answers every M up to the
    one it ran at through :func:`_drain`. It runs at 2 more microbatches than
    asked (the data assignment then asks for M + 1 and M + 2), and again, longer,
    when a larger M is asked."""
    n = len(times.fwd)
    if schedule != "1f1b" or microbatches < n:
        return group_makespan(times, schedule, microbatches)
    trace = _TRACES.get(times)
    if trace is None or trace.m < microbatches:
        trace = _trace_1f1b(times.fwd, times.bwd, times.comm, microbatches + 2)
        _TRACES[times] = trace
        if len(_TRACES) > _TRACES_SIZE:
            with contextlib.suppress(KeyError):  # another thread evicted it first
                _TRACES.popitem(last=False)
    else:
        with contextlib.suppress(KeyError):  # evicted by another thread meanwhile
            _TRACES.move_to_end(times)
    return _drain(trace, times.bwd, times.comm, microbatches)


@lru_cache(maxsize=65536)
def _exact(times: GroupTimes, schedule: str, microbatches: int) -> float:
    return exact_makespan(times, schedule, microbatches)


_WINDOW = 8


def _base(n_stages: int) -> int:
    return 3 * n_stages + 8


@lru_cache(maxsize=65536)
def _regime(times: GroupTimes, schedule: str) -> tuple[tuple[float, ...], int] | None:
    """Makespans at M = base .. base+7 and their period c, if periodic there."""
    base = _base(len(times.fwd))
    exact_makespan(times, schedule, base + _WINDOW - 1)  # the largest first: one simulation
    p = tuple(exact_makespan(times, schedule, base + i) for i in range(_WINDOW))
    tol = 1e-9 * max(abs(p[-1]), 1e-30)
    for c in (1, 2, 3):
        steps = [p[i + c] - p[i] for i in range(_WINDOW - c)]
        if max(steps) - min(steps) <= tol:
            return p, c
    return None


for _memo in (_TRACES.clear, _exact.cache_clear, _regime.cache_clear,
              _reference_makespans.cache_clear):
    memos.register(_memo)


def fast_makespan(times: GroupTimes, schedule: str, microbatches: int) -> float:
    """Exact makespan for small M; for large M, extrapolated from the periodic regime.

    A pipeline under a fixed schedule is a max-plus linear system: after a
    transient its makespan becomes periodic, ``P(M + c) = P(M) + c * lambda``
    for a small cyclicity c. When that holds over a window of samples past
    ``3 S + 8`` microbatches we extrapolate instead of simulating thousands
    of microbatches. Transients can outlast the window (two parts of the
    pipeline drifting at different rates), so this is planner-only and off by
    about 1% at worst on random pipelines; the plan the planner returns is
    re-scored with the exact reference model.
    """
    base = _base(len(times.fwd))
    if microbatches < base + _WINDOW:
        return _exact(times, schedule, microbatches)
    regime = _regime(times, schedule)
    if regime is None:
        return _exact(times, schedule, microbatches)
    p, c = regime
    offset = (microbatches - base) % c
    anchor = offset + c * ((_WINDOW - 1 - offset) // c)  # last sample = M (mod c)
    periods = (microbatches - base - anchor) // c
    return p[anchor] + periods * (p[anchor] - p[anchor - c])


def proxy_makespan(times: GroupTimes, schedule: str, microbatches: int) -> float:
    """Closed-form estimate: fill and drain plus (M - 1) steady cycles.

    The cycle is the slowest of: a stage's F + B, a boundary transfer, and
    for 1f1b the round trip from stage j to the end and back shared by the
    S - j microbatches stage j keeps in flight. Used to rank cuts when M is
    large; every cut kept is then scored with :func:`fast_makespan`.
    """
    fwd, bwd, comm = times.fwd, times.bwd, times.comm
    n = len(fwd)
    fill = sum(fwd) + sum(bwd) + 2.0 * sum(comm)
    top_comm = max(comm, default=0.0)
    if schedule == "gpipe":
        cycle = max(max(fwd), top_comm) + max(max(bwd), top_comm)
    else:
        cycle = max(max(f + b for f, b in zip(fwd, bwd, strict=True)), top_comm)
        tail = 0.0
        for j in range(n - 1, -1, -1):
            tail += fwd[j] + bwd[j] + (2.0 * comm[j] if j < n - 1 else 0.0)
            cycle = max(cycle, tail / min(n - j, microbatches))
    return fill + (microbatches - 1) * cycle



@lru_cache(maxsize=1024)
def op_sequence(schedule: str, stages: int, microbatches: int) -> tuple[tuple[int, bool, int], ...]:
    """One topological order of every (stage, is_backward, microbatch) op of a group under a
    built-in schedule: each stage's ops in its order, each op after its dependencies."""
    orders = [order(schedule, stages, j, microbatches) for j in range(stages)]
    done: set[tuple[int, bool, int]] = set()
    pos = [0] * stages
    seq: list[tuple[int, bool, int]] = []
    total = 2 * stages * microbatches
    while len(seq) < total:
        progressed = False
        for j in range(stages):
            while pos[j] < len(orders[j]):
                is_bwd, k = orders[j][pos[j]]
                if not is_bwd:
                    ready = j == 0 or (j - 1, False, k) in done
                else:
                    ready = (j, False, k) in done if j == stages - 1 else (j + 1, True, k) in done
                if not ready:
                    break
                done.add((j, is_bwd, k))
                seq.append((j, is_bwd, k))
                pos[j] += 1
                progressed = True
        if not progressed:  # pragma: no cover - built-in schedules never deadlock
            raise RuntimeError(f"{schedule} deadlocks: {stages} stages, {microbatches} microbatches")
    return tuple(seq)


def vector_makespans(fwd: np.ndarray, bwd: np.ndarray, comm: np.ndarray, schedule: str,
                     microbatches: int) -> np.ndarray:
    """Spec 5.2's makespan of one group for many cuts at once: ``fwd``/``bwd`` of shape
    (cuts, S), ``comm`` (cuts, S - 1). The reference simulation, run on columns: every op
    starts at the later of its inputs and its stage's previous op; each direction of each
    boundary is a FIFO channel."""
    n, stages = fwd.shape
    zero = np.zeros(n)
    clock = [zero] * stages
    f_end: dict[int, np.ndarray] = {}
    f_arrive: dict[tuple[int, int], np.ndarray] = {}
    b_arrive: dict[tuple[int, int], np.ndarray] = {}
    fwd_chan = [zero] * stages
    bwd_chan = [zero] * stages
    last = stages - 1
    f_cols = [fwd[:, j] for j in range(stages)]
    b_cols = [bwd[:, j] for j in range(stages)]
    c_cols = [comm[:, j] for j in range(stages - 1)]
    for j, is_bwd, k in op_sequence(schedule, stages, microbatches):
        if not is_bwd:
            t = (clock[j] if j == 0 else np.maximum(f_arrive.pop((j, k)), clock[j])) + f_cols[j]
            clock[j] = t
            if j == last:
                f_end[k] = t
            else:
                arrive = np.maximum(t, fwd_chan[j]) + c_cols[j]
                fwd_chan[j] = arrive
                f_arrive[(j + 1, k)] = arrive
        else:
            ready = f_end.pop(k) if j == last else b_arrive.pop((j, k))
            t = np.maximum(ready, clock[j]) + b_cols[j]
            clock[j] = t
            if j:
                arrive = np.maximum(t, bwd_chan[j - 1]) + c_cols[j - 1]
                bwd_chan[j - 1] = arrive
                b_arrive[(j - 1, k)] = arrive
    out: np.ndarray = np.max(np.vstack(clock), axis=0)
    return out
