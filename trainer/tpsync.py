"""Gradient sync of a plan with tensor-parallel stages: per shard where the groups agree.

Spec 5.3's buckets (maximal runs of layers with the same owners) and ties are all-reduced
over their holders as :class:`~hetpilot.trainer.gradsync.GradSync` does. A bucket takes
one of two paths, chosen per bucket when the plan's groups are built
(:func:`~hetpilot.trainer.rankpart.shard_ranks`):

* **per shard**, where every holding stage splits the bucket's layers the same number of
  ways t (the same ``tp_plan`` on the same layers: the same shard layout): shard index k
  of each stage (its k-th rank in mesh order) all-reduces only its own slice of each split
  gradient with shard index k of the other stages, one process group per k. A replicated
  parameter's gradient, the same on every rank of a stage, is all-reduced the same way by
  every shard index: each group holds one rank per stage, so each sums one contribution
  per stage, with no division and no broadcast after. 1/t of the full path's bytes;
* **full tensors**, where the holding stages split the layers differently (two ways in
  one group, whole in another): a split parameter's gradient is gathered to its full
  tensor within the stage (``DTensor.full_tensor``), only the stage's first rank adds its
  gradients (the others add zeros, an exact no-op in the sum), the full-size buffer is
  all-reduced over all holders and each rank keeps its own slice of the sum. Ties always
  take this path.

It is blocking, bucket by bucket in layer order, then the ties: no overlap with the
backward. A parameter no contributing rank's backward reached gets no gradient, as in
:mod:`~hetpilot.trainer.gradsync` (one flag per parameter rides with the sums).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .gradsync import Bucket, SyncStats
from .tensorparallel import full_tensors, shard_like

__all__ = ["TPGradSync"]


class TPGradSync:
    """The gradient sync of one rank under a plan with tensor-parallel stages.

    ``contributes``: whether this rank adds its gradients on the full-tensor path (the
    first rank of its stage). ``shard_groups``: per bucket, the process group of this rank's
    shard index (the per-shard path), or None (the full-tensor path); none given: every
    bucket takes the full-tensor path.
    Same interface as :class:`~hetpilot.trainer.gradsync.GradSync` where the runtime uses it.
    """

    def __init__(self, buckets: Sequence[Bucket], tied: Sequence[tuple[torch.Tensor, Any]],
                 *, contributes: bool, shard_groups: Sequence[Any] | None = None) -> None:
        self.buckets = list(buckets)
        self.tied = [(p, g) for p, g in tied if p.requires_grad]
        self.contributes = contributes
        self.shard_groups = (list(shard_groups) if shard_groups is not None
                             else [None] * len(self.buckets))
        if len(self.shard_groups) != len(self.buckets):
            raise ValueError("shard_groups: one per bucket")

    @property
    def paths(self) -> list[str]:
        """Per bucket: ``"shard"`` or ``"full"``, the path its gradients take."""
        return ["full" if g is None else "shard" for g in self.shard_groups]

    def arm(self, roots: Sequence[torch.Tensor] = ()) -> None:
        """Nothing to arm: the sync starts after the backward."""

    def close(self) -> None:
        """Nothing to release."""

    def zero_grad(self) -> None:
        """Nothing kept: the gradients are the parameters' own tensors."""

    def finish(self) -> SyncStats:
        """Collective: sum every bucket's and tie's gradients over their holders."""
        stats = SyncStats()
        started = time.perf_counter()
        for bucket, shard_group in zip(self.buckets, self.shard_groups, strict=True):
            if shard_group is None:
                n = self._all_reduce(list(bucket.params), bucket.group)
            else:
                n = _all_reduce_shards(list(bucket.params), shard_group)
            stats.bucket_bytes += n
            stats.bucket_s.append(0.0)
            stats.chunks += 1
        stats.bytes = stats.bucket_bytes
        for p, group in self.tied:
            stats.bytes += self._all_reduce([p], group)
        stats.exposed_s = time.perf_counter() - started
        return stats

    def _all_reduce(self, params: list[torch.Tensor], group: Any) -> int:
        """The full-tensor path: gather, first ranks contribute, keep this rank's slice."""
        grads: list[torch.Tensor | None] = []
        for p in params:  # every rank of a stage gathers, in the same order
            g = full_tensors(p.grad) if p.grad is not None else None
            grads.append(g if self.contributes else None)
        sums, n = _sum_flat(grads, [tuple(p.shape) for p in params], params, group)
        for p, total in zip(params, sums, strict=True):
            p.grad = shard_like(total, p) if total is not None else None
        return n


def _all_reduce_shards(params: list[torch.Tensor], group: Any) -> int:
    """The per-shard path: sum each parameter's local gradient (its slice, or the whole
    replicated one) over ``group`` (one rank per holding stage, all at one shard index)."""
    grads = [_local(p.grad) if p.grad is not None else None for p in params]
    sums, n = _sum_flat(grads, [tuple(_local(p).shape) for p in params], params, group)
    for p, total in zip(params, sums, strict=True):
        p.grad = _like(total, p) if total is not None else None
    return n


def _sum_flat(grads: list[torch.Tensor | None], shapes: list[tuple[int, ...]],
              params: list[torch.Tensor], group: Any
              ) -> tuple[list[torch.Tensor | None], int]:
    """One all-reduce of ``grads`` (None: zeros of its shape, no contribution) with a flag per
    entry; returns each sum (None where no rank contributed) and the bytes all-reduced."""
    if not params:
        return [], 0
    flat_grads: list[torch.Tensor] = []
    for g, shape, p in zip(grads, shapes, params, strict=True):
        if g is None:
            g = torch.zeros(shape, dtype=p.dtype, device=_local(p).device)
        flat_grads.append(g.reshape(-1))
    dtype = flat_grads[0].dtype
    for g in flat_grads[1:]:
        dtype = torch.promote_types(dtype, g.dtype)
    flags = [0.0 if g is None else 1.0 for g in grads]
    flat = torch.cat([*(g.to(dtype) for g in flat_grads),
                      torch.tensor(flags, dtype=dtype, device=flat_grads[0].device)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    used = flat[len(flat) - len(params):].tolist()
    sums: list[torch.Tensor | None] = []
    pos = 0
    for i, (g, shape) in enumerate(zip(flat_grads, shapes, strict=True)):
        total = flat[pos:pos + g.numel()].view(shape).to(g.dtype).clone()
        pos += g.numel()
        sums.append(total if used[i] > 0 else None)
    return sums, int(flat.numel() * flat.element_size())


def _like(local: torch.Tensor, param: Any) -> Any:
    """``local`` (this rank's slice of ``param``'s gradient) as ``param`` is: a DTensor on its
    mesh with its placements, or the plain tensor."""
    if not _is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t
