"""Where a plan puts the model: which ranks hold each layer and each tie, the gradient
buckets, and a stage's emulated compute times. Pure functions of the plan: no torch.

Every rank computes the same answers from the same plan, which is what lets the ranks
create process groups and hand layers over without asking each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from hetpilot.planner.tpmodel import stage_op_s
from hetpilot.planner.types import Cluster, Device, Model, Network, Plan, Stage

__all__ = ["emulated_targets", "layer_owners", "owner_runs", "tie_holders"]

Owners = list[list[int]]
"""``owners[l]``: the ranks holding layer ``l`` (in the plan's group order); ``[]``: none."""


def layer_owners(plan: Plan, rank_of: Mapping[str, int], num_layers: int) -> Owners:
    """The ranks ``plan`` puts each layer on, group by group (every rank of a
    tensor-parallel stage, in its ring order: each holds the layer, split or whole)."""
    owners: Owners = [[] for _ in range(num_layers)]
    for group in plan.groups:
        for stage in group.stages:
            for layer in range(*stage.layers):
                owners[layer].extend(rank_of[d] for d in stage.devices)
    return owners


def owner_runs(owners: Owners) -> list[tuple[int, int, tuple[int, ...]]]:
    """Spec 5.3's buckets: maximal runs ``[first, end)`` of layers with the same owners,
    in layer order, each with its owners as a sorted tuple (the process group's ranks)."""
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    layer = 0
    while layer < len(owners):
        end = layer
        while end < len(owners) and owners[end] == owners[layer]:
            end += 1
        runs.append((layer, end, tuple(sorted(owners[layer]))))
        layer = end
    return runs


def tie_holders(tie_layers: Iterable[int], owners: Owners) -> list[int]:
    """The ranks that hold a tie: every rank holding one of its layers, sorted."""
    return sorted({r for layer in tie_layers for r in owners[layer]})


def emulated_targets(layer_gflop: Sequence[tuple[float, float]], tflops: float | None,
                     microbatch: int, layers: tuple[int, int], recompute: bool,
                     devices: Sequence[str] = (), split: Model | None = None,
                     tp_link: tuple[float, float] | None = None) -> tuple[float, float]:
    """EMULATION (target-time): spec 5.1's F_j and B_j of a stage of ``layers`` on a device
    of ``tflops`` (None: no target, ``(0, 0)``); recomputation adds a forward to B_j.

    A tensor-parallel stage (``devices``: more than one) is timed as spec 5.6 reads it
    (:func:`hetpilot.planner.tpmodel.stage_op_s`, the reference model's own function):
    each layer ``split`` (the job's profile) lets split runs ``1 / (t * efficiency)`` of
    its work, plus its all-reduces over ``tp_link`` ((Gbit/s, latency s); None: no
    link time). Without ``split`` every layer is timed whole, as a replicated one."""
    if tflops is None:
        return 0.0, 0.0
    a, b = layers
    if len(devices) > 1 and split is not None:
        gbps, lat = tp_link if tp_link is not None else (math.inf, 0.0)
        cluster = Cluster(
            devices=tuple(Device(id=d, host="stage", tflops=tflops, memory_gb=1.0)
                          for d in devices),
            network=Network(intra_host_gbps=gbps, inter_host_gbps=gbps, latency_us=lat * 1e6))
        return stage_op_s(cluster, split, Stage(device=devices[0], layers=layers,
                                                recompute=recompute, devices=tuple(devices)),
                          microbatch)
    scale = microbatch / (1000.0 * tflops)
    fwd = scale * sum(g[0] for g in layer_gflop[a:b])
    bwd = scale * sum(g[1] for g in layer_gflop[a:b])
    return fwd, bwd + (fwd if recompute else 0.0)
