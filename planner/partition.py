"""Communication-aware partition of one pipeline group (layer cuts + recompute).

Given the group's devices in stage order, the number of microbatches M and
the schedule, choose contiguous layer ranges that balance compute on unequal
devices against transfer time on each link and memory on each device, and
switch on recompute only for a stage that does not fit otherwise.

Method: a dynamic programme over (stage, layer prefix) with numpy, in two
passes. The first minimises the bottleneck ``tau*`` = max over stages of
``max(F_j + B_j, C_j)``; the second, for a few thresholds ``tau >= tau*``,
minimises the fill-and-drain sum ``sum_j (F_j + B_j + 2 C_j)`` subject to
every stage's bottleneck cost staying under ``tau``. Each candidate cut is
then scored with the exact reference simulation, and the best one is refined
by moving single cut points while that lowers the exact makespan.

For few stages (at most :data:`EXHAUSTIVE_STAGES`) every cut is tried
(:func:`exhaustive_cuts`, as long as there are at most
:data:`EXHAUSTIVE_CUTS` of them): all of them are scored at once with numpy
by the closed-form proxy (plus a per-cut extra term such as the gradient
sync a cut implies), and the best few are simulated exactly. The DP's
balance is a local view: with few microbatches the fill and drain dominate,
and the cut that balances the pipeline is not always the fastest.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from .makespans import fast_makespan, proxy_makespan, vector_makespans
from .refmodel import GroupTimes
from .schedules import inflight, order
from .types import Device, Model

__all__ = ["EXHAUSTIVE_CUTS", "EXHAUSTIVE_STAGES", "GroupCut", "ModelArrays", "cut_fits",
           "exhaustive_cuts", "partition_group", "stage_params_mb"]

EXHAUSTIVE_STAGES = 4
"""Groups of at most this many stages have every cut tried (see :func:`exhaustive_cuts`)."""
EXHAUSTIVE_CUTS = 60_000
"""... as long as there are at most this many cuts (C(L-1, S-1))."""
_EXACT_TOP = 24
"""Cuts of the exhaustive ranking that are simulated exactly."""
_VECTOR_OPS = 1024
"""Groups of at most this many ops (2 S M) have all their cuts simulated at once
(:func:`~.makespans.vector_makespans`); longer ones are ranked by the closed-form proxy."""

_THRESHOLDS = (1.0, 1.03, 1.08, 1.15, 1.3, 1.6)
_INF = float("inf")
_STAGE_COSTS_BYTES = 256 * 1024 * 1024


class ModelArrays:
    """Prefix sums over a model's layers, for O(1) segment sums; with ``kind``, the work
    sums are those of a device of that kind (each layer's ``kind_scale`` at degree 1)."""

    def __init__(self, model: Model, kind: str | None = None) -> None:
        layers = model.layers
        self.model = model
        self.num_layers = len(layers)
        self.opt = model.optimizer_factor
        self.scaled = model.kind_scaled
        """Whether device kinds change the work sums (:meth:`of`)."""
        self._kinds: dict[str | None, ModelArrays] = {None: self} if kind is None else {}

        def cum(values: Sequence[float]) -> np.ndarray:
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))

        scale = [x.scale(kind, 1) for x in layers] if kind is not None else [1.0] * len(layers)
        self.fwd = cum([x.fwd_gflop * s if kind is not None else x.fwd_gflop
                        for x, s in zip(layers, scale, strict=True)])
        self.bwd = cum([x.bwd_gflop * s if kind is not None else x.bwd_gflop
                        for x, s in zip(layers, scale, strict=True)])
        self.act = cum([x.act_mb for x in layers])
        self.param = cum([x.param_mb for x in layers])
        # in_mb of layer l is out_mb of layer l-1 (0 for layer 0)
        self.inp = cum([0.0] + [x.out_mb for x in layers[:-1]])
        self.out = np.asarray([x.out_mb for x in layers], dtype=float)
        # the same prefix sums as Python floats: scalar reads of numpy arrays are slow,
        # and a difference of two of them is the same double either way
        self.lists = tuple(c.tolist() for c in (self.fwd, self.bwd, self.act, self.param,
                                                self.inp, self.out))
        self.stage_costs: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.dp_cuts: dict[tuple[object, ...], list[tuple[int, ...] | None] | None] = {}
        self.group_times: dict[tuple[object, ...], dict[tuple[object, ...], _Times]] = {}
        """Per group (speeds and memory, links, microbatch size): :func:`_times_for` by
        (bounds, in-flight counts). A group cut again at another M (1f1b's in-flight
        counts stop changing at M = S) re-reads the stage times its first cut made."""

    def times_memo(self, devices: Sequence[Device], links: Sequence[tuple[float, float]],
                   micro: int) -> dict[tuple[object, ...], _Times]:
        """The :attr:`group_times` memo of one group (bounded: cleared when large)."""
        key: tuple[object, ...]
        if self.scaled:
            key = (tuple((d.tflops, d.memory_gb, d.kind) for d in devices), tuple(links), micro)
        else:
            key = (tuple((d.tflops, d.memory_gb) for d in devices), tuple(links), micro)
        found = self.group_times.get(key)
        if found is None or len(found) >= 4096:
            if len(self.group_times) >= 4096:
                self.group_times.clear()
            found = self.group_times[key] = {}
        return found

    def of(self, kind: str | None) -> ModelArrays:
        """The arrays a device of ``kind`` reads: these without ``kind_scale`` (spec 5.1)."""
        if not self.scaled:
            return self
        found = self._kinds.get(kind)
        if found is None:
            found = self._kinds[kind] = ModelArrays(self.model, kind)
        return found

    @cached_property
    def segment(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Matrices [a, b] of segment sums (fwd, bwd, act, param, inp); b is exclusive."""
        def mat(c: np.ndarray) -> np.ndarray:
            return c[None, :] - c[:, None]

        return mat(self.fwd), mat(self.bwd), mat(self.act), mat(self.param), mat(self.inp)

    def segment_sum(self, cum: np.ndarray, a: int, b: int) -> float:
        return float(cum[b] - cum[a])


@dataclass(frozen=True)
class GroupCut:
    """Layer ranges and recompute flags of one group, and its exact makespan."""

    bounds: tuple[int, ...]
    """Cut points 0 = c_0 < c_1 < ... < c_S = L."""
    recompute: tuple[bool, ...]
    makespan: float
    times: GroupTimes


def _stage_cost_matrices(
    arr: ModelArrays,
    dev: Device,
    link: tuple[float, float] | None,
    micro: int,
    in_flight: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per segment [a, b): bottleneck cost and fill-and-drain sum (inf where it cannot
    fit), as matrices transposed for the DP (row b, column a).

    Memoised per model (and device kind, :meth:`ModelArrays.of`) on everything they
    depend on (groups of one cluster share a few device kinds and links); the arrays
    returned are shared, never written."""
    arr = arr.of(dev.kind)
    key = (dev.tflops, dev.memory_gb, link, micro, in_flight)
    found = arr.stage_costs.get(key)
    if found is None:
        # (L+1)^2 floats each, twice: at most 512 entries and about 256 MB per model
        if len(arr.stage_costs) >= min(512, max(4, _STAGE_COSTS_BYTES // (16 * (arr.num_layers + 1) ** 2))):
            arr.stage_costs.clear()
        bottleneck, fill = _stage_costs(arr, dev, link, micro, in_flight)
        found = arr.stage_costs[key] = (np.ascontiguousarray(bottleneck.T),
                                        np.ascontiguousarray(fill.T))
    return found


def _stage_costs(
    arr: ModelArrays,
    dev: Device,
    link: tuple[float, float] | None,
    micro: int,
    in_flight: int,
) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):  # a stage past 1e308 s (a device of 1e-300 TFLOP/s
        return _stage_costs_of(arr, dev, link, micro, in_flight)  # reported) is inf: unusable


def _stage_costs_of(
    arr: ModelArrays,
    dev: Device,
    link: tuple[float, float] | None,
    micro: int,
    in_flight: int,
) -> tuple[np.ndarray, np.ndarray]:
    fwd, bwd, act, param, inp = arr.segment
    rate = 1000.0 * dev.tflops
    cap = 1000.0 * dev.memory_gb
    base = param * (1.0 + arr.opt)
    plain_fits = base + in_flight * micro * act <= cap
    rc_fits = base + in_flight * micro * inp + micro * act <= cap
    comp = np.where(plain_fits, micro * (fwd + bwd) / rate,
                    np.where(rc_fits, micro * (2.0 * fwd + bwd) / rate, _INF))
    if link is None:
        comm = np.zeros_like(comp)
    else:
        gbps, lat = link
        comm_row = lat + micro * arr.out * 8.0 / (1000.0 * gbps)  # by last layer b-1
        comm = np.broadcast_to(np.concatenate(([0.0], comm_row))[None, :], comp.shape)
    bottleneck = np.maximum(comp, comm)
    fill = comp + 2.0 * comm
    n = arr.num_layers + 1
    invalid = np.tril(np.ones((n, n), dtype=bool))  # need a < b
    bottleneck = np.where(invalid, _INF, bottleneck)
    fill = np.where(invalid, _INF, fill)
    return bottleneck, fill


def _dp_bottleneck(costs_t: Sequence[np.ndarray], n_layers: int) -> float:
    """Least over cuts of the largest stage bottleneck (``costs_t``: transposed)."""
    best = costs_t[0][:, 0].copy()  # best[b]: stage 0 covers [0, b)
    for cost_t in costs_t[1:]:
        best = np.min(np.maximum(best[None, :], cost_t), axis=1)
    return float(best[n_layers])


def _dp_fills(
    bottle_t: Sequence[np.ndarray], fill_t: Sequence[np.ndarray], taus: Sequence[float],
    n_layers: int
) -> list[tuple[int, ...] | None]:
    """Per threshold tau: the cut minimising the fill-and-drain sum with every stage's
    bottleneck cost <= tau (None if none), all thresholds in one pass.

    ``bottle_t`` and ``fill_t`` hold the stages' transposed matrices ((L+1) x (L+1),
    row b, column a: minima run along rows); they are read one stage at a time, so
    the memory is T x (L+1)^2 floats whatever the number of stages. Each threshold's sums and
    arg-minima are the ones it would get alone."""
    limits = np.asarray([tau * (1 + 1e-12) for tau in taus])[:, None, None]

    def allowed(j: int) -> np.ndarray:  # [t, b, a]; one stage at a time: T x (L+1)^2 floats
        return np.where(bottle_t[j][None] <= limits, fill_t[j][None], _INF)

    best = allowed(0)[:, :, 0].copy()  # best[t, b]: stage 0 covers [0, b)
    back = []
    for j in range(1, len(bottle_t)):
        total = best[:, None, :] + allowed(j)  # [t, b, a]: best[t, a] + cost[a, b]
        back.append(np.argmin(total, axis=2).tolist())
        best = np.min(total, axis=2)  # the values at the arg-minima
    out: list[tuple[int, ...] | None] = []
    for t, found in enumerate(np.isfinite(best[:, n_layers]).tolist()):
        if not found:
            out.append(None)
            continue
        cuts = [n_layers]
        b = n_layers
        for arg in reversed(back):
            b = arg[t][b]
            cuts.append(b)
        cuts.append(0)
        out.append(tuple(reversed(cuts)))
    return out


_Times = tuple[GroupTimes, tuple[bool, ...]] | None


def _times_for(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    bounds: Sequence[int],
    micro: int,
    in_flights: Sequence[int],
) -> tuple[GroupTimes, tuple[bool, ...]] | None:
    fwd, bwd, comm, rec = [], [], [], []
    c_fwd, c_bwd, c_act, c_param, c_inp, out = arr.lists
    opt = 1.0 + arr.opt
    last = len(devices) - 1
    for j, dev in enumerate(devices):
        if arr.scaled:
            c_fwd, c_bwd = arr.of(dev.kind).lists[:2]
        a, b = bounds[j], bounds[j + 1]
        f = c_fwd[b] - c_fwd[a]
        bk = c_bwd[b] - c_bwd[a]
        params = (c_param[b] - c_param[a]) * opt
        act = c_act[b] - c_act[a]
        cap = 1000.0 * dev.memory_gb
        rate = 1000.0 * dev.tflops
        if params + in_flights[j] * micro * act <= cap:
            rec.append(False)
            fwd.append(micro * f / rate)
            bwd.append(micro * bk / rate)
        elif params + in_flights[j] * micro * (c_inp[b] - c_inp[a]) + micro * act <= cap:
            rec.append(True)
            fwd.append(micro * f / rate)
            bwd.append(micro * bk / rate + micro * f / rate)
        else:
            return None
        if j < last:
            gbps, lat = links[j]
            comm.append(lat + micro * out[b - 1] * 8.0 / (1000.0 * gbps))
    return GroupTimes(tuple(fwd), tuple(bwd), tuple(comm)), tuple(rec)


def _in_flights(schedule: str, n: int, microbatches: int) -> list[int]:
    """Spec 5.4's in-flight counts: M for gpipe, min(S - j, M) for 1f1b."""
    if schedule == "gpipe":
        return [microbatches] * n
    if schedule == "1f1b":
        return [min(n - j, microbatches) for j in range(n)]
    return [inflight(order(schedule, n, j, microbatches)) for j in range(n)]


def evaluate_cut(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    bounds: Sequence[int],
    micro: int,
    microbatches: int,
    schedule: str,
    *,
    proxy: bool = False,
    memo: dict[tuple[object, ...], _Times] | None = None,
) -> GroupCut | None:
    """Makespan of given cut points (or its proxy), or None if a stage does not fit.
    ``memo``: this group's :meth:`ModelArrays.times_memo`, for its stage times."""
    flights = _in_flights(schedule, len(devices), microbatches)
    if memo is None:
        found = _times_for(arr, devices, links, bounds, micro, flights)
    else:
        key = (tuple(bounds), tuple(flights))
        if key in memo:
            found = memo[key]
        else:
            found = memo[key] = _times_for(arr, devices, links, bounds, micro, flights)
    if found is None:
        return None
    times, rec = found
    score = proxy_makespan if proxy else fast_makespan
    return GroupCut(tuple(bounds), rec, score(times, schedule, microbatches), times)


def cut_fits(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    bounds: Sequence[int],
    micro: int,
    microbatches: int,
    schedule: str,
) -> bool:
    """Whether every stage of the cut fits in memory (recompute allowed); no simulation."""
    flights = _in_flights(schedule, len(devices), microbatches)
    return _times_for(arr, devices, links, bounds, micro, flights) is not None


def _dp_cuts(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    micro: int,
    flights: Sequence[int],
) -> list[tuple[int, ...] | None] | None:
    """The DP's cut for each of :data:`_THRESHOLDS` (None: no cut under it), or None
    if no cut fits at all. Memoised per model on what the stages' cost matrices
    depend on: groups of the same device kinds and links recur with another M."""
    n_stages = len(devices)
    keys = tuple((dev.tflops, dev.memory_gb, links[j] if j + 1 < n_stages else None, micro,
                  flights[j], dev.kind if arr.scaled else None) for j, dev in enumerate(devices))
    if keys in arr.dp_cuts:
        return arr.dp_cuts[keys]
    bottle, fill = [], []  # transposed
    for j, dev in enumerate(devices):
        b, f = _stage_cost_matrices(arr, dev, keys[j][2], micro, flights[j])  # type: ignore[arg-type]
        bottle.append(b)
        fill.append(f)
    tau = _dp_bottleneck(bottle, arr.num_layers)
    found = None
    if np.isfinite(tau):
        found = _dp_fills(bottle, fill, [tau * f for f in _THRESHOLDS],
                          arr.num_layers)
    if len(arr.dp_cuts) >= 4096:
        arr.dp_cuts.clear()
    arr.dp_cuts[keys] = found
    return found


@lru_cache(maxsize=64)
def _all_cuts(n_layers: int, n_stages: int) -> np.ndarray:
    """Every cut of ``n_layers`` layers into ``n_stages`` non-empty ranges: rows of bounds
    ``0 = b_0 < b_1 < ... < b_S = L``, shape (C(L-1, S-1), S + 1)."""
    if n_stages == 1:
        return np.asarray([[0, n_layers]], dtype=np.int64)
    inner = np.fromiter(
        (x for combo in itertools.combinations(range(1, n_layers), n_stages - 1) for x in combo),
        dtype=np.int64, count=math.comb(n_layers - 1, n_stages - 1) * (n_stages - 1),
    ).reshape(-1, n_stages - 1)
    rows = inner.shape[0]
    return np.hstack([np.zeros((rows, 1), np.int64), inner,
                      np.full((rows, 1), n_layers, np.int64)])


def stage_params_mb(arr: ModelArrays, bounds: np.ndarray) -> np.ndarray:
    """Parameter MB of each stage of each cut (rows of bounds): shape (cuts, stages)."""
    return arr.param[bounds[:, 1:]] - arr.param[bounds[:, :-1]]


def exhaustive_cuts(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    micro: int,
    microbatches: int,
    schedule: str,
    extra: Callable[[np.ndarray], np.ndarray] | None = None,
    top: int = _EXACT_TOP,
) -> list[tuple[int, ...]] | None:
    """The ``top`` cuts by makespan (+ ``extra(bounds)``, a per-cut term such as the
    gradient sync) among **all** cuts of ``devices`` (None when there are more than
    :data:`EXHAUSTIVE_CUTS` or more than :data:`EXHAUSTIVE_STAGES` stages).

    Vectorised over cuts: stage times and memory (recompute where only it fits, as in
    :func:`_times_for`), then the makespan simulated for every cut at once
    (:func:`~.makespans.vector_makespans`) when the group has at most :data:`_VECTOR_OPS` ops, else
    :func:`~.makespans.proxy_makespan`'s closed form, each with the same formulas."""
    n = len(devices)
    if n > EXHAUSTIVE_STAGES or n > arr.num_layers or \
            math.comb(arr.num_layers - 1, n - 1) > EXHAUSTIVE_CUTS:
        return None
    bounds = _all_cuts(arr.num_layers, n)
    lo, hi = bounds[:, :-1], bounds[:, 1:]
    flights = _in_flights(schedule, n, microbatches)
    fwd = np.empty(lo.shape)
    bwd = np.empty(lo.shape)
    ok = np.ones(lo.shape[0], dtype=bool)
    for j, dev in enumerate(devices):
        a, b = lo[:, j], hi[:, j]
        work = arr.of(dev.kind)
        f = work.fwd[b] - work.fwd[a]
        bk = work.bwd[b] - work.bwd[a]
        params = (arr.param[b] - arr.param[a]) * (1.0 + arr.opt)
        act = arr.act[b] - arr.act[a]
        cap = 1000.0 * dev.memory_gb
        rate = 1000.0 * dev.tflops
        plain = params + flights[j] * micro * act <= cap
        rc = params + flights[j] * micro * (arr.inp[b] - arr.inp[a]) + micro * act <= cap
        ok &= plain | rc
        fwd[:, j] = micro * f / rate
        bwd[:, j] = micro * bk / rate + np.where(plain, 0.0, micro * f / rate)
    comm = np.zeros((lo.shape[0], max(n - 1, 0)))
    for j in range(n - 1):
        gbps, lat = links[j]
        comm[:, j] = lat + micro * arr.out[hi[:, j] - 1] * 8.0 / (1000.0 * gbps)
    if 2 * n * microbatches <= _VECTOR_OPS:  # simulate every cut (the reference's rules)
        score = vector_makespans(fwd, bwd, comm, schedule, microbatches)
    else:  # long pipelines: the closed-form proxy ranks them
        fill = fwd.sum(axis=1) + bwd.sum(axis=1) + 2.0 * comm.sum(axis=1)
        top_comm = comm.max(axis=1) if n > 1 else np.zeros(lo.shape[0])
        if schedule == "gpipe":
            cycle = np.maximum(fwd.max(axis=1), top_comm) + np.maximum(bwd.max(axis=1),
                                                                        top_comm)
        else:
            cycle = np.maximum((fwd + bwd).max(axis=1), top_comm)
            tail = np.zeros(lo.shape[0])
            for j in range(n - 1, -1, -1):
                tail = tail + fwd[:, j] + bwd[:, j] + (2.0 * comm[:, j] if j < n - 1 else 0.0)
                cycle = np.maximum(cycle, tail / min(n - j, microbatches))
        score = fill + (microbatches - 1) * cycle
    if extra is not None:
        score = score + extra(bounds)
    score = np.where(ok, score, _INF)
    if not np.isfinite(score).any():
        return None
    k = min(top, int(np.isfinite(score).sum()))
    picked = np.argpartition(score, k - 1)[:k] if k < score.shape[0] else np.arange(k)
    picked = picked[np.argsort(score[picked], kind="stable")]
    return [tuple(int(x) for x in bounds[i]) for i in picked if np.isfinite(score[i])]


def partition_group(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    micro: int,
    microbatches: int,
    schedule: str,
    *,
    refine_steps: int | None = None,
    always_proxy: bool = False,
    thorough: bool = False,
) -> GroupCut | None:
    """Best cut found for ``devices`` (stage order), or None if nothing fits.

    ``always_proxy`` ranks cuts by the closed-form proxy whatever M is (the
    planner sets it on big clusters, where thousands of groups are cut per
    search and an exact simulation per hill-climbing step is too slow); the
    DP's cut and the refined cut are still compared exactly. ``thorough`` tries every
    cut (:func:`exhaustive_cuts`) at any M, not only at few microbatches (the planner
    sets it on small clusters)."""
    n_stages = len(devices)
    n_layers = arr.num_layers
    if n_stages > n_layers:
        return None
    flights = _in_flights(schedule, n_stages, microbatches)
    fills = _dp_cuts(arr, devices, links, micro, flights)
    if fills is None:
        return None
    memo = arr.times_memo(devices, links, micro)
    # Few microbatches: rank cuts by the exact simulation (fill and drain dominate, and
    # small cases are where the planner is held to the brute-force optimum). Steady
    # state (M >= 2S + 4): rank by the closed-form proxy, then keep whichever of the
    # DP's cut and the refined cut simulates faster.
    proxy = always_proxy or microbatches >= 2 * n_stages + 4
    best: GroupCut | None = None
    seen: set[tuple[int, ...]] = set()
    # few stages and few microbatches (fill and drain dominate, where the DP's balance
    # misleads): the best of all cuts, the proxy's best few simulated exactly
    every = None if always_proxy or (proxy and not thorough) else exhaustive_cuts(
        arr, devices, links, micro, microbatches, schedule)
    if every:
        for tried in every:
            seen.add(tried)
            cut = evaluate_cut(arr, devices, links, tried, micro, microbatches, schedule,
                               memo=memo)
            if cut is not None and (best is None or cut.makespan < best.makespan):
                best = cut
        proxy = False  # compare the DP's cuts and refine exactly, like the cuts above
    for bounds in fills:
        if bounds is None or bounds in seen:
            continue
        seen.add(bounds)
        cut = evaluate_cut(arr, devices, links, bounds, micro, microbatches, schedule, proxy=proxy,
                           memo=memo)
        if cut is not None and (best is None or cut.makespan < best.makespan):
            best = cut
    if best is None:
        return None
    if refine_steps is None:
        refine_steps = 4 * n_stages if (proxy or n_stages <= 16) else 0
    refined = _refine(arr, devices, links, best, micro, microbatches, schedule, refine_steps, proxy,
                      memo)
    if not proxy:
        return refined
    exact = [evaluate_cut(arr, devices, links, c.bounds, micro, microbatches, schedule, memo=memo)
             for c in {best.bounds: best, refined.bounds: refined}.values()]
    return min((c for c in exact if c is not None), key=lambda c: c.makespan, default=None)


def _refine(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    cut: GroupCut,
    micro: int,
    microbatches: int,
    schedule: str,
    budget: int,
    proxy: bool,
    memo: dict[tuple[object, ...], _Times] | None = None,
) -> GroupCut:
    """Hill-climb on single cut points while the makespan (or its proxy) drops."""
    improved = True
    while improved and budget > 0:
        improved = False
        for i in range(1, len(cut.bounds) - 1):
            for delta in (-1, 1):
                bounds = list(cut.bounds)
                bounds[i] += delta
                if not bounds[i - 1] < bounds[i] < bounds[i + 1]:
                    continue
                budget -= 1
                trial = evaluate_cut(arr, devices, links, bounds, micro, microbatches, schedule,
                                     proxy=proxy, memo=memo)
                if trial is not None and trial.makespan < cut.makespan * (1 - 1e-12):
                    cut = trial
                    improved = True
    return cut
