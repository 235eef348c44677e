"""Keep a fixed plan running while some of its devices are down (elastic data parallelism).

A *static* layout is what most jobs run today: one plan chosen at the start,
with torchelastic-style recovery when a node dies. The groups (pipelines)
that lost a device stop; the surviving groups take the whole batch, split in
proportion to the samples each had, and the lost groups rejoin when their
devices are back. Nothing is re-cut and no layer moves between devices. The
simulator's ``static`` policy and the planner's baselines run like this, so
that "a plan chosen once" is compared as it really behaves under failures.
"""

from __future__ import annotations

from .refmodel import evaluate
from .schedules import format_order, warmup_order
from .types import Cluster, Group, Model, Plan, Stage

__all__ = ["surviving_plan"]


def surviving_plan(plan: Plan, cluster: Cluster, model: Model, global_batch: int) -> Plan | None:
    """``plan`` restricted to its groups whose devices are all in ``cluster``.

    The survivors share the global batch in proportion to their samples in
    ``plan`` (largest remainder, whole microbatches, at least one each).
    Returns ``plan`` itself when no device is down, and None when no group
    survives or the resized groups no longer fit in memory (more microbatches
    in flight under gpipe). Custom per-stage orders are rebuilt for the new
    microbatch count with the same number of warm-up forwards.
    """
    alive = [g for g in plan.groups if all(s.device in cluster.by_id for s in g.stages)]
    if len(alive) == len(plan.groups):
        return plan
    micro = plan.microbatch_size
    total = global_batch // micro
    if not alive or len(alive) > total:
        return None
    weights = [g.samples for g in alive]
    shares = [total * w / sum(weights) for w in weights]
    counts = [max(1, int(s)) for s in shares]
    by_remainder = sorted(range(len(alive)), key=lambda i: counts[i] - shares[i])
    i = 0
    while sum(counts) < total:
        counts[by_remainder[i % len(alive)]] += 1
        i += 1
    while sum(counts) > total:  # only when a max(1, .) rounded a group up
        j = max((k for k in range(len(alive)) if counts[k] > 1), key=lambda k: counts[k] - shares[k])
        counts[j] -= 1
    groups = tuple(_resized(g, m, micro, plan.schedule) for g, m in zip(alive, counts, strict=True))
    survived = Plan(microbatch_size=micro, schedule=plan.schedule, groups=groups)
    # No predicted_iteration_s: the same survivors give an equal plan in every slot.
    return survived if evaluate(cluster, model, survived, global_batch).valid else None


def _resized(group: Group, microbatches: int, micro: int, schedule: str) -> Group:
    stages = group.stages
    if schedule == "custom":
        stages = tuple(
            Stage(device=s.device, layers=s.layers, recompute=s.recompute,
                  order=format_order(warmup_order(_warmup(s.order or ()), microbatches)))
            for s in stages
        )
    return Group(samples=microbatches * micro, stages=stages)


def _warmup(order: tuple[str, ...]) -> int:
    """The ``warmup`` of :func:`warmup_order` that starts like ``order``: the
    forwards before its first backward, less the one that backward belongs to
    in a steady 1F1B pair."""
    for i, op in enumerate(order):
        if op.startswith("B"):
            return max(i - 1, 0)
    return len(order)
