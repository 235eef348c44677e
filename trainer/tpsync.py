"""Gradient sync of a plan with tensor-parallel stages: full tensors, one contribution per stage.

Spec 5.3's buckets (maximal runs of layers with the same owners) and ties are all-reduced
over their holders as :class:`~hetpilot.trainer.gradsync.GradSync` does, with two
differences that tensor parallelism needs:

* **one contribution per stage**: every rank of a tensor-parallel stage holds the same
  gradient of a replicated parameter (and, gathered, of a split one), so only the stage's
  first rank adds its gradients; the others add zeros (an exact no-op in the sum);
* **full tensors**: a split parameter's gradient is gathered to its full tensor within
  the stage (``DTensor.full_tensor``) before the all-reduce, and each rank keeps its own
  slice of the sum. Groups that split a layer differently (two ways in one, whole in
  another) thus all-reduce the same full-size buffer. This moves t times the bytes of a
  per-shard all-reduce; it is the simple correct first version (a re-sharded all-reduce
  of slices is the faster one).

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

    ``contributes``: whether this rank adds its gradients (the first rank of its stage).
    Same interface as :class:`~hetpilot.trainer.gradsync.GradSync` where the runtime uses it.
    """

    def __init__(self, buckets: Sequence[Bucket], tied: Sequence[tuple[torch.Tensor, Any]],
                 *, contributes: bool) -> None:
        self.buckets = list(buckets)
        self.tied = [(p, g) for p, g in tied if p.requires_grad]
        self.contributes = contributes

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
        for bucket in self.buckets:
            n = self._all_reduce(list(bucket.params), bucket.group)
            stats.bucket_bytes += n
            stats.bucket_s.append(0.0)
            stats.chunks += 1
        stats.bytes = stats.bucket_bytes
        for p, group in self.tied:
            stats.bytes += self._all_reduce([p], group)
        stats.exposed_s = time.perf_counter() - started
        return stats

    def _all_reduce(self, params: list[torch.Tensor], group: Any) -> int:
        if not params:
            return 0
        fulls: list[torch.Tensor] = []
        flags: list[float] = []
        for p in params:  # every rank of a stage gathers, in the same order
            g = full_tensors(p.grad) if p.grad is not None else None
            if g is None or not self.contributes:
                g = torch.zeros(tuple(p.shape), dtype=p.dtype, device=_local(p).device)
                flags.append(0.0)
            else:
                flags.append(1.0)
            fulls.append(g.reshape(-1))
        dtype = fulls[0].dtype
        for f in fulls[1:]:
            dtype = torch.promote_types(dtype, f.dtype)
        flat = torch.cat([*(f.to(dtype) for f in fulls),
                          torch.tensor(flags, dtype=dtype, device=fulls[0].device)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        used = flat[len(flat) - len(params):].tolist()
        pos = 0
        for i, (p, f) in enumerate(zip(params, fulls, strict=True)):
            total = flat[pos:pos + f.numel()].view(tuple(p.shape)).to(f.dtype)
            pos += f.numel()
            p.grad = shard_like(total.clone(), p) if used[i] > 0 else None
        return int(flat.numel() * flat.element_size())


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t
