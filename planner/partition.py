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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .refmodel import GroupTimes, group_makespan
from .schedules import inflight, order
from .types import Device, Model

__all__ = ["GroupCut", "ModelArrays", "partition_group"]

_THRESHOLDS = (1.0, 1.03, 1.08, 1.15, 1.3, 1.6)
_INF = float("inf")


class ModelArrays:
    """Prefix sums over a model's layers, for O(1) segment sums."""

    def __init__(self, model: Model) -> None:
        layers = model.layers
        self.model = model
        self.num_layers = len(layers)
        self.opt = model.optimizer_factor

        def cum(values: Sequence[float]) -> np.ndarray:
            return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))

        self.fwd = cum([x.fwd_gflop for x in layers])
        self.bwd = cum([x.bwd_gflop for x in layers])
        self.act = cum([x.act_mb for x in layers])
        self.param = cum([x.param_mb for x in layers])
        # in_mb of layer l is out_mb of layer l-1 (0 for layer 0)
        self.inp = cum([0.0] + [x.out_mb for x in layers[:-1]])
        self.out = np.asarray([x.out_mb for x in layers], dtype=float)

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
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per segment [a, b): bottleneck cost, fill sum, compute, recompute flag."""
    fwd, bwd, act, param, inp = arr.segment
    rate = 1000.0 * dev.tflops
    cap = 1000.0 * dev.memory_gb
    base = param * (1.0 + arr.opt)
    plain_fits = base + in_flight * micro * act <= cap
    rc_fits = base + in_flight * micro * inp + micro * act <= cap
    comp = np.where(plain_fits, micro * (fwd + bwd) / rate,
                    np.where(rc_fits, micro * (2.0 * fwd + bwd) / rate, _INF))
    recompute = ~plain_fits & rc_fits
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
    return bottleneck, fill, comp, recompute


def _dp_bottleneck(costs: list[np.ndarray], n_layers: int) -> float:
    best = costs[0][0].copy()  # best[b]: stage 0 covers [0, b)
    for cost in costs[1:]:
        best = np.min(np.maximum(best[:, None], cost), axis=0)
    return float(best[n_layers])


def _dp_fill(
    bottle: list[np.ndarray], fill: list[np.ndarray], tau: float, n_layers: int
) -> tuple[int, ...] | None:
    allowed = [np.where(b <= tau * (1 + 1e-12), f, _INF) for b, f in zip(bottle, fill, strict=True)]
    best = allowed[0][0].copy()
    back = []
    for cost in allowed[1:]:
        total = best[:, None] + cost
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(total.shape[1])]
        back.append(arg)
    if not np.isfinite(best[n_layers]):
        return None
    cuts = [n_layers]
    b = n_layers
    for arg in reversed(back):
        b = int(arg[b])
        cuts.append(b)
    cuts.append(0)
    return tuple(reversed(cuts))


def _times_for(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    bounds: Sequence[int],
    micro: int,
    in_flights: Sequence[int],
) -> tuple[GroupTimes, tuple[bool, ...]] | None:
    fwd, bwd, comm, rec = [], [], [], []
    for j, dev in enumerate(devices):
        a, b = bounds[j], bounds[j + 1]
        f = arr.segment_sum(arr.fwd, a, b)
        bk = arr.segment_sum(arr.bwd, a, b)
        params = arr.segment_sum(arr.param, a, b) * (1.0 + arr.opt)
        act = arr.segment_sum(arr.act, a, b)
        cap = 1000.0 * dev.memory_gb
        rate = 1000.0 * dev.tflops
        if params + in_flights[j] * micro * act <= cap:
            rec.append(False)
            fwd.append(micro * f / rate)
            bwd.append(micro * bk / rate)
        elif params + in_flights[j] * micro * arr.segment_sum(arr.inp, a, b) + micro * act <= cap:
            rec.append(True)
            fwd.append(micro * f / rate)
            bwd.append(micro * bk / rate + micro * f / rate)
        else:
            return None
        if j + 1 < len(devices):
            gbps, lat = links[j]
            comm.append(lat + micro * float(arr.out[b - 1]) * 8.0 / (1000.0 * gbps))
    return GroupTimes(tuple(fwd), tuple(bwd), tuple(comm)), tuple(rec)


def _in_flights(schedule: str, n: int, microbatches: int) -> list[int]:
    return [inflight(order(schedule, n, j, microbatches)) for j in range(n)]


def evaluate_cut(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    bounds: Sequence[int],
    micro: int,
    microbatches: int,
    schedule: str,
) -> GroupCut | None:
    """Exact makespan of given cut points, or None if a stage does not fit."""
    flights = _in_flights(schedule, len(devices), microbatches)
    found = _times_for(arr, devices, links, bounds, micro, flights)
    if found is None:
        return None
    times, rec = found
    return GroupCut(tuple(bounds), rec, group_makespan(times, schedule, microbatches), times)


def partition_group(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    micro: int,
    microbatches: int,
    schedule: str,
    *,
    refine_steps: int = 64,
) -> GroupCut | None:
    """Best cut found for ``devices`` (stage order), or None if nothing fits."""
    n_stages = len(devices)
    n_layers = arr.num_layers
    if n_stages > n_layers:
        return None
    flights = _in_flights(schedule, n_stages, microbatches)
    bottle, fill = [], []
    for j, dev in enumerate(devices):
        link = links[j] if j + 1 < n_stages else None
        b, f, _, _ = _stage_cost_matrices(arr, dev, link, micro, flights[j])
        bottle.append(b)
        fill.append(f)
    tau = _dp_bottleneck(bottle, n_layers)
    if not np.isfinite(tau):
        return None
    best: GroupCut | None = None
    seen: set[tuple[int, ...]] = set()
    for factor in _THRESHOLDS:
        bounds = _dp_fill(bottle, fill, tau * factor, n_layers)
        if bounds is None or bounds in seen:
            continue
        seen.add(bounds)
        cut = evaluate_cut(arr, devices, links, bounds, micro, microbatches, schedule)
        if cut is not None and (best is None or cut.makespan < best.makespan):
            best = cut
    if best is None:
        return None
    return _refine(arr, devices, links, best, micro, microbatches, schedule, refine_steps)


def _refine(
    arr: ModelArrays,
    devices: Sequence[Device],
    links: Sequence[tuple[float, float]],
    cut: GroupCut,
    micro: int,
    microbatches: int,
    schedule: str,
    budget: int,
) -> GroupCut:
    """Hill-climb on single cut points with the exact makespan."""
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
                trial = evaluate_cut(arr, devices, links, bounds, micro, microbatches, schedule)
                if trial is not None and trial.makespan < cut.makespan * (1 - 1e-12):
                    cut = trial
                    improved = True
    return cut
