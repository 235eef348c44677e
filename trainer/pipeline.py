"""One pipeline stage running its op order for one iteration, over torch.distributed p2p.

The stage runs exactly the op order the reference model scores
(:func:`hetpilot.planner.schedules.order` or a plan's custom order). Sends
are non-blocking (``isend``) and receives block, which is the dependency rule
of spec section 5.2: an op waits for its input, never for its consumer. Each
message is tagged with its microbatch and direction, so custom orders that
forward microbatches in different orders on neighbouring stages still match.

Activations are single tensors of the training dtype. A forward message is a
small int64 header (the shape) and then the data; a backward message is the
gradient, whose shape the receiver knows from its own forward.

A stage with ``recompute`` runs each layer under
``torch.utils.checkpoint.checkpoint`` (non-reentrant): it keeps each layer's
input and runs the forward again in the backward (spec sections 5.1, 5.4).

NCCL: the same calls work with tensors on the rank's CUDA device, but this
path has only been run over gloo on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["StageRunner", "StageStats"]

_HEADER = 8  # ndim + up to 7 dims


@dataclass
class StageStats:
    """Seconds spent by one stage in one iteration (sums over microbatches)."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    wait_s: float = 0.0
    """Blocked in receives: transfers plus waiting for the neighbour."""
    emulated_s: float = 0.0
    """Sleep added by emulated slowdown (included in fwd_s/bwd_s)."""
    sync_s: float = 0.0
    """Gradient all-reduce across groups."""
    microbatches: int = 0

    def add(self, other: StageStats) -> None:
        self.fwd_s += other.fwd_s
        self.bwd_s += other.bwd_s
        self.wait_s += other.wait_s
        self.emulated_s += other.emulated_s
        self.sync_s += other.sync_s
        self.microbatches += other.microbatches


def _tag(k: int, backward: bool, header: bool = False) -> int:
    return 4 * k + (2 if backward else 0) + (1 if header else 0)


class StageRunner:
    """Runs one stage's ops; built per plan, reused every iteration."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        prev_rank: int | None,
        next_rank: int | None,
        recompute: bool,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        loss_scale: float,
        dtype: torch.dtype,
        device: torch.device,
        slowdown: float = 1.0,
        fwd_target_s: float = 0.0,
        bwd_target_s: float = 0.0,
    ) -> None:
        self.layers = list(layers)
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.recompute = recompute
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.dtype = dtype
        self.device = device
        self.slowdown = slowdown
        self.fwd_target_s = fwd_target_s
        """EMULATION (target-time mode): a forward of one microbatch lasts at least this long."""
        self.bwd_target_s = bwd_target_s

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
        return x

    def _slow(self, started: float, stats: StageStats, target_s: float) -> float:
        """EMULATION: sleep-ratio mode stretches the op by ``slowdown``; target-time mode
        sleeps until ``target_s`` has passed since the op started (never shortens it)."""
        took = time.perf_counter() - started
        extra = 0.0
        if target_s > 0.0:
            extra = max(0.0, target_s - took)
        elif self.slowdown > 1.0:
            extra = (self.slowdown - 1.0) * took
        if extra > 0.0:
            time.sleep(extra)
            stats.emulated_s += extra
            took = time.perf_counter() - started
        return took

    def _recv(
        self, shape: Sequence[int], src: int, tag: int, stats: StageStats,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        started = time.perf_counter()
        buf = torch.empty(tuple(shape), dtype=dtype or self.dtype, device=self.device)
        dist.recv(buf, src=src, tag=tag)
        stats.wait_s += time.perf_counter() - started
        return buf

    def run(
        self,
        ops: Sequence[tuple[bool, int]],
        inputs: Callable[[int], torch.Tensor],
        targets: Callable[[int], torch.Tensor],
    ) -> tuple[StageStats, float]:
        """Run one iteration's ops; return the stats and the sum of scaled losses (last stage)."""
        stats = StageStats()
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        pending: list[tuple[dist.Work, torch.Tensor]] = []
        loss_sum = 0.0
        first, last = self.prev_rank is None, self.next_rank is None
        for is_bwd, k in ops:
            if not is_bwd:
                if first:
                    x = inputs(k).to(self.device, self.dtype)
                    x_in: torch.Tensor | None = None
                else:
                    assert self.prev_rank is not None
                    header = self._recv(
                        (_HEADER,), self.prev_rank, _tag(k, False, True), stats, torch.int64
                    )
                    shape = [int(v) for v in header[1 : 1 + int(header[0])].tolist()]
                    x = self._recv(shape, self.prev_rank, _tag(k, False), stats)
                    x.requires_grad_(True)
                    x_in = x
                started = time.perf_counter()
                y = self._forward(x)
                if last:
                    y = self.loss_fn(y, targets(k).to(self.device)) * self.loss_scale
                    loss_sum += float(y.detach())
                stats.fwd_s += self._slow(started, stats, self.fwd_target_s)
                saved[k] = (x_in, y)
                if not last:
                    assert self.next_rank is not None
                    out = y.detach().contiguous()
                    header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
                    header[0] = out.dim()
                    header[1 : 1 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
                    for tensor, tag in ((header, _tag(k, False, True)), (out, _tag(k, False))):
                        work = dist.isend(tensor, dst=self.next_rank, tag=tag)
                        assert work is not None
                        pending.append((work, tensor))
            else:
                x_in, y = saved.pop(k)
                if last:
                    grad = None
                else:
                    assert self.next_rank is not None
                    grad = self._recv(y.shape, self.next_rank, _tag(k, True), stats)
                started = time.perf_counter()
                torch.autograd.backward(y, grad)
                stats.bwd_s += self._slow(started, stats, self.bwd_target_s)
                if x_in is not None:
                    assert self.prev_rank is not None and x_in.grad is not None
                    g = x_in.grad.contiguous()
                    work = dist.isend(g, dst=self.prev_rank, tag=_tag(k, True))
                    assert work is not None
                    pending.append((work, g))
                stats.microbatches += 1
        started = time.perf_counter()
        for work, _ in pending:
            work.wait()
        stats.wait_s += time.perf_counter() - started
        return stats, loss_sum
