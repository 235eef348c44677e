"""This rank's part of the running plan: its stage, its process groups, its gradient sync.

:func:`build_part` makes it from a checked plan, the way torchtitan's
``pipeline_parallel.py`` builds a stage and its schedule from config: the gradient buckets
of spec 5.3 (maximal runs of layers with the same owners, one process group each), a group
per tie with more than one holder, and the :class:`~hetpilot.trainer.pipeline.StageRunner`
of the stage this rank runs (none where the plan leaves it idle). Under a plan with
tensor-parallel stages, a bucket whose holding stages all split it the same number of ways
also gets a group per shard index (:func:`shard_ranks`, :mod:`~hetpilot.trainer.tpsync`).
Every rank calls ``new_group`` for the same groups in the same order, as torch requires.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.planner.types import Plan
from torch.distributed.device_mesh import DeviceMesh

from .gradsync import Bucket, GradSync
from .handoff import Holdings
from .pipeline import StageRunner
from .placement import Owners, owner_runs, tie_holders
from .precision import Precision
from .replicas import reconcile_buffers, snapshot_buffers, tie_param
from .tpsync import TPGradSync

__all__ = ["RankPart", "StageSettings", "build_part", "shard_ranks"]

Orders = list[list[tuple[tuple[bool, int], ...]]]
"""Each stage's op order, by group and stage (:func:`~hetpilot.trainer.plans.check_plan`)."""


@dataclass(frozen=True)
class StageSettings:
    """What every stage runner of this rank is built with, whatever the plan."""

    loss_fn: Callable[[Any, Any], torch.Tensor]
    precision: Precision
    device: torch.device
    slowdown: float
    global_batch: int
    grad_group: Any
    """The process group pipeline gradients cross in (None: the default group)."""
    bucket_cap_mb: float
    overlap_sync: bool
    tp_plan: Mapping[str, str] | None = None
    """The job's ``tp_plan`` (:mod:`hetpilot.trainer.tensorparallel`): what a
    tensor-parallel stage splits in each of its layers."""


@dataclass
class RankPart:
    """What this rank runs under one plan (empty: nothing yet, or idle)."""

    role: tuple[int, int] | None = None
    """(group, stage) this rank runs; None: the plan leaves it idle."""
    runner: StageRunner | None = None
    ops: tuple[tuple[bool, int], ...] = ()
    buckets: list[tuple[int, int, Any]] = field(default_factory=list)
    """(first, end, process group) of each gradient bucket this rank takes part in."""
    shard_groups: list[Any] = field(default_factory=list)
    """Per bucket of :attr:`buckets`: the process group of this rank's shard index (the
    per-shard sync of a plan with tensor-parallel stages), or None (the full-tensor one)."""
    tie_groups: list[tuple[int, Any]] = field(default_factory=list)
    """(tie, process group of its holders) of each tie this rank holds with others."""
    gradsync: GradSync | TPGradSync | None = None
    groups: list[Any] = field(default_factory=list)
    """The process groups made for this plan (destroyed by :meth:`close`)."""

    def close(self) -> None:
        """Collective: stop the gradient sync and destroy this plan's process groups."""
        if self.gradsync is not None:
            self.gradsync.close()
            self.gradsync = None
        for pg in self.groups:
            dist.destroy_process_group(pg)
        self.groups = []

    def snapshot_buffers(self, held: Mapping[int, torch.nn.Module]) -> list[list[torch.Tensor]]:
        """The replicated layers' buffers before a step (:mod:`hetpilot.trainer.replicas`)."""
        return [snapshot_buffers([held[la] for la in range(first, end)])
                for first, end, _ in self.buckets]

    def reconcile_buffers(self, held: Mapping[int, torch.nn.Module],
                          before: list[list[torch.Tensor]], share: float) -> None:
        """Replicas' buffers after the step, by the rule of :mod:`hetpilot.trainer.replicas`."""
        for (first, end, pg), saved in zip(self.buckets, before, strict=True):
            if saved:
                reconcile_buffers([held[la] for la in range(first, end)], saved, share, pg)


def build_part(plan: Plan, orders: Orders, *, owners: Owners, holdings: Holdings, rank: int,
               rank_of: Mapping[str, int], settings: StageSettings,
               targets: Callable[[int, tuple[int, int], bool, Sequence[str]], tuple[float, float]],
               min_seconds: Callable[[int, int], float | None] | None) -> RankPart:
    """Collective: this rank's part of ``plan``. ``targets(m, layers, recompute, devices)``: a
    stage's emulated forward and backward seconds; ``min_seconds``: an emulated all-reduce's
    (:class:`~hetpilot.trainer.gradsync.GradSync`).
    A tensor-parallel stage's mesh is made once for its ranks (``holdings.meshes``)."""
    tp_meshes = holdings.meshes
    part = RankPart()
    made: dict[tuple[int, ...], Any] = {}

    def group_of(ranks: tuple[int, ...]) -> Any:
        if ranks not in made:  # every rank calls new_group, in the same order
            made[ranks] = dist.new_group(ranks=list(ranks))
            part.groups.append(made[ranks])
        return made[ranks]

    has_tp = any(s.tp > 1 for g in plan.groups for s in g.stages)
    if len(plan.groups) > 1:
        for first, end, ranks in owner_runs(owners):
            pg = group_of(ranks)
            shards = shard_ranks(plan, rank_of, first) if has_tp else None
            shard_pg = None
            for shard in shards or ():  # every rank makes every shard group, in order
                made_pg = group_of(shard)
                if rank in shard:
                    shard_pg = made_pg
            if rank in ranks:
                part.buckets.append((first, end, pg))
                part.shard_groups.append(shard_pg)
    for t, tie in enumerate(holdings.ties):
        ranks = tuple(tie_holders(tie.layers, owners))
        if len(ranks) >= 2:
            pg = group_of(ranks)
            if rank in ranks:
                part.tie_groups.append((t, pg))
    meshes: dict[tuple[int, int], Any] = {}
    for gi, group in enumerate(plan.groups):  # every rank makes every stage's group, in order
        for si, stage in enumerate(group.stages):
            if stage.tp > 1:
                ranks = tuple(rank_of[d] for d in stage.devices)
                if ranks not in tp_meshes:
                    pg = dist.new_group(ranks=list(ranks))
                    tp_meshes[ranks] = (DeviceMesh.from_group(pg, settings.device.type)
                                        if rank in ranks else None)
                if rank in ranks:
                    meshes[gi, si] = tp_meshes[ranks]
                    if meshes[gi, si].mesh.tolist() != sorted(ranks):  # shard_ranks' order
                        raise RuntimeError(f"plan.groups[{gi}].stages[{si}]: mesh order "
                                           f"{meshes[gi, si].mesh.tolist()} is not sorted")
    for gi, group in enumerate(plan.groups):
        for si, stage in enumerate(group.stages):
            if rank in (rank_of[d] for d in stage.devices):
                part.role, part.ops = (gi, si), orders[gi][si]
                if (gi, si) in meshes:
                    if settings.tp_plan is None:
                        raise ValueError(f"plan.groups[{gi}].stages[{si}].devices: a "
                                         "tensor-parallel stage needs the job's tp_plan")
                    for layer in range(*stage.layers):
                        holdings.shard(layer, meshes[gi, si], settings.tp_plan)
                part.runner = _stage_runner(plan, gi, si, orders, holdings, rank, rank_of,
                                            settings, targets)
    if part.runner is not None and part.role is not None:
        buckets = [Bucket(holdings.untied_params(first, end), pg, f"layers {first}-{end - 1}")
                   for first, end, pg in part.buckets]
        tied = [(tie_param(holdings.ties[t], holdings.held), pg) for t, pg in part.tie_groups]
        if has_tp:
            stage = plan.groups[part.role[0]].stages[part.role[1]]
            part.gradsync = TPGradSync(buckets, tied,
                                       contributes=rank_of[stage.devices[0]] == rank,
                                       shard_groups=part.shard_groups)
        else:
            part.gradsync = GradSync(
                buckets, tied, bucket_cap_mb=settings.bucket_cap_mb,
                overlap=settings.overlap_sync, min_seconds=min_seconds)
        part.runner.before_last_backward = part.gradsync.arm
    return part


def shard_ranks(plan: Plan, rank_of: Mapping[str, int], layer: int
                ) -> list[tuple[int, ...]] | None:
    """The per-shard sync groups of the bucket holding ``layer``: where every stage holding
    it (one per group) splits it the same number of ways t, the t groups of the ranks at
    each shard index (a stage's ranks sorted: its mesh's order), each sorted; None where
    the stages split it differently (the bucket takes the full-tensor sync). The same
    ``tp_plan`` at the same degree splits a layer the same way, so equal degrees mean
    equal shard layouts."""
    stages = [stage for group in plan.groups for stage in group.stages
              if stage.layers[0] <= layer < stage.layers[1]]
    if not stages or len({stage.tp for stage in stages}) != 1:
        return None
    orders = [sorted(rank_of[d] for d in stage.devices) for stage in stages]
    return [tuple(sorted(order[k] for order in orders)) for k in range(stages[0].tp)]


def _stage_runner(plan: Plan, gi: int, si: int, orders: Orders, holdings: Holdings,
                  rank: int, rank_of: Mapping[str, int], settings: StageSettings,
                  targets: Callable[[int, tuple[int, int], bool, Sequence[str]], tuple[float, float]]
                  ) -> StageRunner:
    """The runner of stage ``si`` of group ``gi`` on ``rank`` (one of the stage's ranks).

    Into and out of a tensor-parallel stage: every rank of a stage holds the same
    activation (replicated after a row-parallel layer), so the first rank of a stage sends
    it to every rank of the next stage, and the first rank of the next stage sends the
    gradient back to every rank of this one; the other ranks send nothing."""
    stages: Sequence[Any] = plan.groups[gi].stages
    stage, n = stages[si], len(stages)
    first = rank_of[stage.devices[0]] == rank
    fwd_t, bwd_t = targets(plan.microbatch_size, stage.layers, stage.recompute, stage.devices)
    return StageRunner(
        [holdings.held[layer] for layer in range(*stage.layers)],
        prev_rank=rank_of[stages[si - 1].device] if si > 0 else None,
        next_rank=rank_of[stages[si + 1].device] if si + 1 < n else None,
        recompute=stage.recompute,
        loss_fn=settings.loss_fn,
        loss_scale=plan.microbatch_size / settings.global_batch,
        precision=settings.precision,
        device=settings.device,
        slowdown=settings.slowdown,
        fwd_target_s=fwd_t,
        bwd_target_s=bwd_t,
        recv_order=[k for bwd, k in orders[gi][si - 1] if not bwd] if si > 0 else None,
        grad_order=[k for bwd, k in orders[gi][si + 1] if bwd] if si + 1 < n else None,
        grad_group=settings.grad_group,
        act_dsts=[rank_of[d] for d in stages[si + 1].devices] if first and si + 1 < n else [],
        grad_dsts=[rank_of[d] for d in stages[si - 1].devices] if first and si > 0 else [],
        reports=first,
    )
