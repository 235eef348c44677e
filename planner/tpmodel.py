"""Spec 5.6: what a tensor-parallel stage costs in time and memory.

A stage of t devices (one host) splits each layer that allows it t ways
(:meth:`Layer.splits`); each device runs ``1 / (t * efficiency)`` of the layer's
work and the layer's output is all-reduced over the stage's devices,
``tp_allreduces`` times in the forward and as many in the backward. A layer
that is not split runs whole on every device. These functions are shared by
the reference model (:mod:`hetpilot.planner.refmodel`) and the planner, so
both read the spec the same way. A stage of one device gives the v1 numbers
(spec 5.1, 5.4) exactly, float for float.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import memos
from .types import Cluster, Model, Stage

__all__ = [
    "boundary_s",
    "ring",
    "ring_allreduce_s",
    "stage_memory_mb",
    "stage_op_s",
]


def ring(cluster: Cluster, devices: Sequence[str]) -> tuple[float, float]:
    """(slowest Gbit/s, largest latency in s) over a ring's links d0 -> d1 -> ... -> d0."""
    n = len(devices)
    min_gbps, max_lat = float("inf"), 0.0
    for i in range(n):
        gbps, lat = cluster.link(devices[i], devices[(i + 1) % n])
        min_gbps = min(min_gbps, gbps)
        max_lat = max(max_lat, lat)
    return min_gbps, max_lat


def ring_allreduce_s(mb: float, n: int, gbps: float, lat: float) -> float:
    """Spec 5.3's ring all-reduce of ``mb`` MB over ``n`` members."""
    return 2.0 * (n - 1) / n * mb * 8.0 / (1000.0 * gbps) + 2.0 * (n - 1) * lat


_SUMS: memos.PerModel[tuple[int, int], tuple[float, float]] = memos.PerModel()
"""Per model: the forward and backward GFLOP of each layer range asked for."""
_SPLIT_SUMS: memos.PerModel[tuple[object, ...], tuple[float, float, float]] = memos.PerModel()
"""Per model: a tensor-parallel stage's GFLOP and all-reduce seconds."""
_SCALED: memos.PerModel[tuple[object, ...], tuple[float, float]] = memos.PerModel()
"""Per model with ``kind_scale``: a stage's (F_j, B_j) without recompute."""


def _gflop(model: Model, a: int, b: int) -> tuple[float, float]:
    """(forward, backward) GFLOP of layers [a, b), each summed in layer order from 0, as
    :func:`stage_op_s` sums them."""
    sums = _SUMS.table(model)
    found = sums.get((a, b))
    if found is None:
        layers = model.layers[a:b]
        found = sums[(a, b)] = (sum(layer.fwd_gflop for layer in layers),
                                sum(layer.bwd_gflop for layer in layers))
    return found


def _split_sums(model: Model, a: int, b: int, t: int, micro: int, gbps: float,
                lat: float) -> tuple[float, float, float]:
    """(forward GFLOP, backward GFLOP, all-reduce seconds) per device of layers [a, b)
    split t ways on a ring of (gbps, lat), summed in layer order from 0."""
    sums = _SPLIT_SUMS.table(model)
    key = (a, b, t, micro, gbps, lat)
    found = sums.get(key)
    if found is not None:
        return found
    fwd = bwd = comm = 0.0
    for layer in model.layers[a:b]:
        if layer.splits(t):
            share = 1.0 / (t * layer.efficiency(t))
            fwd += layer.fwd_gflop * share
            bwd += layer.bwd_gflop * share
            assert layer.tp_comm_mb is not None
            comm += layer.tp_allreduces * ring_allreduce_s(micro * layer.tp_comm_mb, t, gbps, lat)
        else:
            fwd += layer.fwd_gflop
            bwd += layer.bwd_gflop
    found = sums[key] = (fwd, bwd, comm)
    return found


def stage_op_s(cluster: Cluster, model: Model, stage: Stage, micro: int) -> tuple[float, float]:
    """(F_j, B_j) of one microbatch on the stage (spec 5.1, 5.6), recompute included."""
    if model.kind_scaled:
        f, bk = _scaled_op_s(cluster, model, stage, micro)
        return f, (bk + f if stage.recompute else bk)
    a, b = stage.layers
    t = stage.tp
    if t == 1:
        rate = 1000.0 * cluster.by_id[stage.device].tflops
        fwd_gflop, bwd_gflop = _gflop(model, a, b)
        f = micro * fwd_gflop / rate
        bk = micro * bwd_gflop / rate
        return f, (bk + f if stage.recompute else bk)
    rate = 1000.0 * min(cluster.by_id[d].tflops for d in stage.devices)
    gbps, lat = ring(cluster, stage.devices)
    fwd, bwd, comm = _split_sums(model, a, b, t, micro, gbps, lat)
    f = micro * fwd / rate + comm
    bk = micro * bwd / rate + comm
    return f, (bk + f if stage.recompute else bk)


def _scaled_op_s(cluster: Cluster, model: Model, stage: Stage, micro: int) -> tuple[float, float]:
    """:func:`stage_op_s` without recompute, with layers' ``kind_scale`` (spec 5.1, 5.6):
    each device's compute is its layers' work times the factor of its kind at the degree
    each layer runs at (t when split, else 1); the stage's forward (backward) takes its
    slowest device's."""
    a, b = stage.layers
    t = stage.tp
    devices = frozenset((d.kind, d.tflops) for d in (cluster.by_id[x] for x in stage.devices))
    gbps, lat = ring(cluster, stage.devices) if t > 1 else (0.0, 0.0)
    table = _SCALED.table(model)
    key = (a, b, t, micro, devices, gbps, lat)
    found = table.get(key)
    if found is not None:
        return found
    layers = model.layers[a:b]
    comm = 0.0
    if t > 1:
        comm = sum(layer.tp_allreduces * ring_allreduce_s(micro * layer.tp_comm_mb, t, gbps, lat)
                   for layer in layers if layer.splits(t) and layer.tp_comm_mb is not None)
    f = bk = 0.0
    for kind, tflops in devices:
        fwd = bwd = 0.0
        for layer in layers:
            if layer.splits(t):
                share = layer.scale(kind, t) / (t * layer.efficiency(t))
            else:
                share = layer.scale(kind, 1)
            fwd += layer.fwd_gflop * share
            bwd += layer.bwd_gflop * share
        f = max(f, micro * fwd / (1000.0 * tflops))
        bk = max(bk, micro * bwd / (1000.0 * tflops))
    found = table[key] = (f + comm, bk + comm)
    return found


def boundary_s(cluster: Cluster, model: Model, sender: Stage, receiver: Stage,
               micro: int) -> float:
    """C_j between two consecutive stages, either direction (spec 5.1, 5.6).

    With degrees t and u, k = min(t, u) pairs (sender.devices[i],
    receiver.devices[i]) each carry 1/k of the activation at once (Megatron's
    scatter-gather); then the stage of the larger degree all-gathers it over
    its own ring (t = u = 1: spec 5.1's single transfer).
    """
    mb = micro * model.layers[sender.layers[1] - 1].out_mb
    if sender.tp == 1 and receiver.tp == 1:
        gbps, lat = cluster.link(sender.device, receiver.device)
        return lat + mb * 8.0 / (1000.0 * gbps)
    k = min(sender.tp, receiver.tp)
    share = mb / k
    scatter = max(
        lat + share * 8.0 / (1000.0 * gbps)
        for gbps, lat in (cluster.link(d, e) for d, e in zip(sender.devices[:k],
                                                            receiver.devices[:k], strict=True))
    )
    wide = sender if sender.tp >= receiver.tp else receiver
    n = wide.tp
    gbps, lat = ring(cluster, wide.devices)
    gather = (n - 1) / n * mb * 8.0 / (1000.0 * gbps) + (n - 1) * lat
    return scatter + gather


def stage_memory_mb(model: Model, stage: Stage, micro: int, in_flight: int) -> float:
    """Spec 5.4 per device of the stage: split layers' parameters, optimizer state and
    kept activations are divided by the degree; inputs (with recompute) are whole."""
    a, b = stage.layers
    layers = model.layers[a:b]
    t = stage.tp
    if t == 1:
        params = sum(layer.param_mb for layer in layers) * (1.0 + model.optimizer_factor)
        act = sum(layer.act_mb for layer in layers)
    else:
        params = sum(layer.param_mb / t if layer.splits(t) else layer.param_mb
                     for layer in layers) * (1.0 + model.optimizer_factor)
        act = sum(layer.act_mb / t if layer.splits(t) else layer.act_mb for layer in layers)
    if stage.recompute:
        inputs = sum(model.layers[i - 1].out_mb for i in range(max(a, 1), b))
        return params + in_flight * micro * inputs + micro * act
    return params + in_flight * micro * act
