"""One pipeline stage running its op order for one iteration, over torch.distributed p2p.

The stage runs exactly the op order the reference model scores
(:func:`hetpilot.planner.schedules.order` or a plan's custom order). Sends
are non-blocking (``isend``) and receives block, which is the dependency rule
of spec section 5.2: an op waits for its input, never for its consumer.

Each direction of each cut is a FIFO channel, as spec 5.2 models it, and the two
directions are independent. Activations go over the default process group and,
under NCCL, gradients over a second group of all ranks (``grad_group``; the
Trainer's ``gradient_group``). Under NCCL, which
runs one process group's messages between two ranks on one CUDA stream, sharing a
group deadlocks a 1F1B pipeline once a message outgrows NCCL's buffers: a stage
sends activation k+1 and then receives gradient k while its neighbour sends
gradient k and then receives activation k+1, and on each stream the send waits for
a receive queued behind the other send. NCCL also has no tags: messages between
two ranks match in the order they were posted. So a stage receives in the order
its neighbour sends (``recv_order``: the previous stage's forwards; ``grad_order``:
the next stage's backwards, both from the plan) and keeps a message that arrives
before its op needs it (a custom order may forward microbatches in another order
than its neighbour). The tags stay: gloo matches by them, and a mismatch is an
error there rather than another microbatch's data.

Each layer is called with one argument, the previous layer's output, which
may be any pytree of tensors and other values; what crosses a cut is sent
leaf by leaf in each leaf's own dtype (:mod:`hetpilot.trainer.activations`).
The first stage casts floating input leaves (and the last stage floating
target leaves) to the precision's parameter dtype only when it is given;
integer token ids are never cast. A stage whose output needs no gradient (parameter-free layers on
an input that needs none) runs no backward and sends nothing back.

A stage with ``recompute`` runs each layer under
``torch.utils.checkpoint.checkpoint`` (non-reentrant): it keeps each layer's
input and runs the forward again in the backward (spec sections 5.1, 5.4).
The recomputation runs on the layer's buffers as the forward found them and
restores them afterwards, so BatchNorm's running statistics are updated once
per microbatch, as without recompute, and a layer whose output depends on a
buffer its forward updates (spectral norm) recomputes the same output.
The recomputation runs each layer's forward to its end: torch's early stop (end the
recomputation once the last tensor the backward needs is saved again) hands the
backward a tensor an op saved before filling it in place, as ``nn.RReLU`` does with
its random slopes (its gradient was then uninitialized memory).
A layer holding a ``torch.jit.script``-ed module is not checkpointed (it keeps its
activations, as without recompute): the TorchScript profiling executor runs another
graph on its first calls than on later ones, so a recomputation does not save the
tensors the forward saved and torch's checkpoint raises inside the interpreter.
A layer that writes into its input (``nn.ReLU(inplace=True)`` as a layer of
its own) runs on a copy of it under recompute, and as a stage's first layer
(whose input is an autograd leaf); each layer's first call tells whether it
writes, and only those that do keep paying for the copy.

Mixed precision (:mod:`hetpilot.trainer.precision`): the forward runs under
``torch.autocast`` and the floating leaves sent to the next stage are cast to
the compute dtype inside the graph, so their gradients come back in it too.
A float16 job's last stage multiplies each loss by the loss scale.

CUDA: op times come from CUDA events resolved once at the end of the
iteration (host clocks would time kernel launches, not kernels); inputs are
copied from pinned memory without blocking. Emulation (sleeps) is for CPU
ranks only. On CUDA this path has run with one NCCL rank, and with ranks sharing one
GPU over gloo (``train-check --device cuda``), on an H100 (bench/RESULTS-gpu.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .activations import (
    grad_leaves,
    map_tensors,
    recv_activation,
    recv_grads,
    send_activation,
    send_grads,
)
from .precision import Precision

__all__ = ["StageRunner", "StageStats", "loss_problem", "microbatch_seed", "seeded"]

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
    """Gradient all-reduce across groups: the part the iteration waited for."""
    sync_bytes: float = 0.0
    """Bytes of bucket gradients all-reduced."""
    sync_early_bytes: float = 0.0
    """Of those, launched while the backward still ran (overlapped)."""
    microbatches: int = 0

    def add(self, other: StageStats) -> None:
        self.fwd_s += other.fwd_s
        self.bwd_s += other.bwd_s
        self.wait_s += other.wait_s
        self.emulated_s += other.emulated_s
        self.sync_s += other.sync_s
        self.sync_bytes += other.sync_bytes
        self.sync_early_bytes += other.sync_early_bytes
        self.microbatches += other.microbatches


def microbatch_seed(seed: int, epoch: int, iteration: int, group: int, first_layer: int,
                    k: int) -> int:
    """Seed of the random draws (dropout) of one stage's forward of microbatch ``k``.

    A pipeline stage's layers draw from their rank's generator, so without this the draws
    would depend on which rank ran which microbatch before. Keyed by the data position,
    the plan's group, the stage's first layer and the microbatch, the same draws happen on
    every run of the same plan, in the trainer and in train-check's one-process reference
    (:mod:`hetpilot.trainer.reference`), and recompute replays them (checkpoint keeps the
    generator's state)."""
    key = f"{seed}/{epoch}/{iteration}/{group}/{first_layer}/{k}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Run the block with the generators seeded (and restored after); None: leave them."""
    if seed is None:
        yield
        return
    # the generators themselves: torch.manual_seed and fork_rng cost ~140 us a call here,
    # once per forward op; this costs a few us
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()])
    states = [g.get_state() for g in gens]
    for g in gens:
        g.manual_seed(seed)
    try:
        yield
    finally:
        for g, state in zip(gens, states, strict=True):
            g.set_state(state)


def loss_problem(loss: Any) -> str | None:
    """What is wrong with a value the job's loss returned (None: a scalar floating tensor).
    The runtime scales it by ``m / B`` and backpropagates it, so it must be the mean over
    the microbatch: one number."""
    if not isinstance(loss, torch.Tensor):
        return (f"returned a {type(loss).__name__}, not a tensor: it must return the mean over "
                "the microbatch as a scalar tensor")
    if loss.numel() != 1:
        return (f"returned a tensor of shape {tuple(loss.shape)}: it must return one number, "
                "the mean over the microbatch (reduction='mean')")
    if not loss.is_floating_point():
        return f"returned a {loss.dtype} tensor: it must be floating to be differentiated"
    return None


def _storages(value: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())}


def _shares_storage(out: Any, inp: Any) -> bool:
    """Whether a floating leaf of ``out`` lies in the memory of one of ``inp`` (a view)."""
    return not _storages(out).isdisjoint(_storages(inp))


def _restore_buffers(layer: nn.Module) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for checkpoint: the recomputation sees the layer's buffers as the forward
    saw them and leaves them as it found them.

    BatchNorm would otherwise update its running statistics a second time; a layer whose
    output depends on a buffer it updates in the forward (spectral norm's power-iteration
    vectors) would recompute another output, hence other gradients, from the values later
    forwards left there. Each forward keeps a copy of the buffers until its recomputation,
    unless the layer's first forward left them unchanged (a constant mask or rotary table
    is not copied per microbatch; the recomputation still puts back what it changes)."""
    writes: list[bool] = []  # once known: whether a forward of this layer changes its buffers

    def contexts() -> tuple[Any, Any]:
        at_forward: list[torch.Tensor] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            if writes and not writes[0]:
                yield
                return
            at_forward.extend(b.detach().clone() for b in layer.buffers())
            yield
            if not writes:  # values compared: kernels may update buffers without a version
                after = list(layer.buffers())
                writes.append(len(after) != len(at_forward) or any(
                    not torch.equal(a, b) for a, b in zip(after, at_forward, strict=True)))
                if not writes[0]:
                    at_forward.clear()

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            buffers = list(layer.buffers())
            now = [b.detach().clone() for b in buffers]
            if at_forward:  # none kept: the forwards leave them unchanged
                with torch.no_grad():
                    for buf, value in zip(buffers, at_forward, strict=True):
                        buf.copy_(value)
            try:
                yield
            finally:
                with torch.no_grad():
                    for buf, value in zip(buffers, now, strict=True):
                        buf.copy_(value)

        return forward(), recompute()

    return contexts


class _Clock:
    """Op durations: host clock on CPU; on CUDA, event pairs read once per iteration."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[Any, Any, str]] = []

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, began: Any, stats: StageStats, field: str) -> float:
        """Add the op's seconds to ``stats.<field>`` (CUDA: at :meth:`resolve`); host seconds."""
        if not self.cuda:
            took = time.perf_counter() - began
            setattr(stats, field, getattr(stats, field) + took)
            return took
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((began, end, field))
        return 0.0

    def resolve(self, stats: StageStats) -> None:
        if not self._pending:
            return
        self._pending[-1][1].synchronize()
        for began, end, field in self._pending:
            setattr(stats, field, getattr(stats, field) + began.elapsed_time(end) / 1000.0)
        self._pending.clear()


class StageRunner:
    """Runs one stage's ops; built per plan, reused every iteration."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        prev_rank: int | None,
        next_rank: int | None,
        recompute: bool,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loss_scale: float,
        device: torch.device,
        precision: Precision | None = None,
        slowdown: float = 1.0,
        fwd_target_s: float = 0.0,
        bwd_target_s: float = 0.0,
        recv_order: Sequence[int] | None = None,
        grad_order: Sequence[int] | None = None,
        grad_group: Any = None,
        act_dsts: Sequence[int] | None = None,
        grad_dsts: Sequence[int] | None = None,
        reports: bool = True,
    ) -> None:
        self.layers = list(layers)
        self.act_dsts = list(act_dsts) if act_dsts is not None else (
            [next_rank] if next_rank is not None else [])
        """The ranks this stage sends its activations to: the next stage's (all of a
        tensor-parallel stage's; none from a tensor-parallel stage's other ranks, whose
        outputs are the same)."""
        self.grad_dsts = list(grad_dsts) if grad_dsts is not None else (
            [prev_rank] if prev_rank is not None else [])
        """The ranks this stage sends its input gradients to: the previous stage's."""
        self.reports = reports
        """Whether this rank's losses and metrics count (not a tensor-parallel stage's other
        ranks, which compute the same ones)."""
        self.recv_order = list(recv_order) if recv_order is not None else None
        """The microbatches in the order the previous stage sends their activations (None:
        the order this stage runs its forwards)."""
        self.grad_order = list(grad_order) if grad_order is not None else None
        """The microbatches in the order the next stage sends their gradients (None: the
        order this stage runs its backwards)."""
        self.grad_group = grad_group
        """The process group gradients cross in (None: the default group, the activations')."""
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.recompute = recompute
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.precision = precision or Precision()
        self.device = device
        self.slowdown = slowdown
        self.fwd_target_s = fwd_target_s
        """EMULATION (target-time mode): a forward of one microbatch lasts at least this long."""
        self.bwd_target_s = bwd_target_s
        self.grad_scale = 1.0
        """float16 loss scale (:class:`~hetpilot.trainer.precision.LossScaler`), set per iteration."""
        self.rng_seed: Callable[[int], int] | None = None
        """Microbatch ``k`` -> the seed of its forward's random draws (set per iteration by
        the runtime: :func:`microbatch_seed`); None leaves the generators alone."""
        self.before_last_backward: Callable[[Sequence[torch.Tensor]], None] | None = None
        """Called right before the iteration's last backward op with the tensors it starts
        from (:meth:`hetpilot.trainer.gradsync.GradSync.arm`)."""
        self._contexts = [_restore_buffers(layer) if any(True for _ in layer.buffers())
                          else None for layer in self.layers]
        self._pin = device.type == "cuda"
        self._recomputable = [not any(isinstance(m, torch.jit.ScriptModule)
                                      for m in layer.modules()) for layer in self.layers]
        """Per layer: whether recompute checkpoints it (not a TorchScript module: see the
        module docstring)."""
        self._mutates: list[bool | None] = [None] * len(self.layers)
        """Per layer: whether it writes into its input (None: not seen yet); see _guarded."""

    def _forward(self, x: Any, received: bool = False) -> Any:
        """The stage's layers on ``x`` (``received``: it came from the previous stage, its
        floating leaves are autograd leaves)."""
        aliased = received  # x is (a view of) the received autograd leaves
        with self.precision.autocast(self.device):
            for i, (layer, context) in enumerate(zip(self.layers, self._contexts, strict=True)):
                fn: Callable[[Any], Any] = layer
                if (self.recompute or aliased) and self._mutates[i] is not False:
                    fn = functools.partial(self._guarded, i)
                if not self.recompute or not self._recomputable[i]:
                    y = fn(x)
                else:  # the whole layer is recomputed: see the module docstring
                    with set_checkpoint_early_stop(False):
                        if context is None:
                            y = checkpoint(fn, x, use_reentrant=False)
                        else:
                            y = checkpoint(fn, x, use_reentrant=False, context_fn=context)
                aliased = aliased and _shares_storage(y, x)  # Flatten, a view: still the leaf
                x = y
        return x

    def _guarded(self, i: int, x: Any) -> Any:
        """Layer ``i`` on a copy of ``x``'s floating leaves, noting whether it wrote into them.

        A layer that modifies its input in place (``nn.ReLU(inplace=True)`` as a layer of
        its own, as in a flattened VGG) breaks two things a single process never meets:
        recompute (the checkpoint's saved input would be overwritten) and a stage's first
        layer (its input is an autograd leaf received from the previous stage; also the
        layers after it while each returns a view of its input, as ``nn.Flatten`` does).
        Each layer runs on a copy until its first call shows whether it writes into its
        input; the layers that do keep the copy, the others run on the input itself from
        then on.

        Writing into the input's containers counts too (a UNet block storing its skip in
        the dict it was given, as diffusers' blocks do): the checkpoint would recompute the
        layer on the dict the forward had already filled (wrong gradients, or torch's
        CheckpointError where shapes changed). The copy has containers of its own, so the
        layer gets a fresh dict each time."""
        copy = map_tensors(lambda t: t.clone() if t.is_floating_point() or t.is_complex() else t, x)
        leaves, spec = pytree.tree_flatten(copy)
        before = [t._version if isinstance(t, torch.Tensor) else None for t in leaves]
        out = self.layers[i](copy)
        if self._mutates[i] is None:
            after, spec_after = pytree.tree_flatten(copy)
            self._mutates[i] = spec_after != spec or any(
                a is not b or (isinstance(a, torch.Tensor) and a._version != v)
                for a, b, v in zip(after, leaves, before, strict=True))
        return out

    def _to_device(self, value: Any) -> Any:
        """Move tensor leaves here (from pinned memory, non-blocking, on CUDA); cast floating
        ones to the precision's parameter dtype when it is set."""
        dtype = self.precision.param_dtype

        def move(t: torch.Tensor) -> torch.Tensor:
            if self._pin and t.device.type == "cpu":
                t = t.pin_memory()
            if dtype is not None and t.is_floating_point():
                return t.to(self.device, dtype, non_blocking=self._pin)
            return t.to(self.device, non_blocking=self._pin)

        return map_tensors(move, value)

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

    def _op_done(self, clock: _Clock, began: Any, stats: StageStats, field: str,
                 target_s: float) -> None:
        if clock.cuda:
            clock.stop(began, stats, field)
        else:
            setattr(stats, field, getattr(stats, field) + self._slow(began, stats, target_s))

    def _receive(self, k: int, stats: StageStats, early: dict[int, Any],
                 order: Iterator[int]) -> tuple[Any, list[torch.Tensor]]:
        """Microbatch ``k``'s activation, receiving those the previous stage sent before
        it first (kept in ``early``)."""
        assert self.prev_rank is not None
        started = time.perf_counter()
        while k not in early:
            m = next(order, k) if self.recv_order is not None else k
            early[m] = recv_activation(self.prev_rank, m, self.device)
        got = early.pop(k)
        stats.wait_s += time.perf_counter() - started
        return got.value, got.grad_inputs

    def _receive_grads(self, k: int, stats: StageStats, early: dict[int, list[torch.Tensor]],
                       order: Iterator[int],
                       saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]
                       ) -> list[torch.Tensor]:
        """The gradients of microbatch ``k``'s outputs, receiving those the next stage sent
        before them first (kept in ``early``). A microbatch sent before ``k`` has had its
        forward here (the next stage's backward of it needed it) and not yet its backward
        (which needs these gradients), so its outputs are in ``saved``."""
        assert self.next_rank is not None
        started = time.perf_counter()
        while k not in early:
            m = next(order, k) if self.grad_order is not None else k
            outs = saved[m][1]
            if outs:  # else the next stage sent nothing for it (and k has outputs)
                early[m] = recv_grads(outs, self.next_rank, m, self.grad_group)
        stats.wait_s += time.perf_counter() - started
        return early.pop(k)

    def run(
        self,
        ops: Sequence[tuple[bool, int]],
        inputs: Callable[[int], Any],
        targets: Callable[[int], Any],
    ) -> tuple[StageStats, float]:
        """Run one iteration's ops; return the stats and the sum of scaled losses (last stage)."""
        stats = StageStats()
        clock = _Clock(self.device)
        # k -> (received leaves needing a gradient, output leaves needing one, or the loss)
        saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        pending: list[tuple[Any, torch.Tensor]] = []
        losses: list[torch.Tensor] = []
        first, last = self.prev_rank is None, self.next_rank is None
        last_bwd = max((i for i, (is_bwd, _) in enumerate(ops) if is_bwd), default=-1)
        early_acts: dict[int, Any] = {}
        early_grads: dict[int, list[torch.Tensor]] = {}
        acts_order, grads_order = iter(self.recv_order or ()), iter(self.grad_order or ())
        for i, (is_bwd, k) in enumerate(ops):
            if not is_bwd:
                x_in: list[torch.Tensor] = []
                if first:
                    x = self._to_device(inputs(k))
                else:
                    x, x_in = self._receive(k, stats, early_acts, acts_order)
                began = clock.start()
                with seeded(self.rng_seed(k) if self.rng_seed else None, self.device):
                    y = self._forward(x, received=not first)
                if last:
                    target = self._to_device(targets(k))
                    with self.precision.autocast(self.device):  # fp32 losses stay fp32
                        loss = self.loss_fn(y, target)
                    if (problem := loss_problem(loss)) is not None:
                        raise ValueError(f"loss: {problem}")
                    loss = loss * self.loss_scale
                    losses.append(loss.detach())
                    y = loss * self.grad_scale if self.grad_scale != 1.0 else loss
                else:
                    y = map_tensors(self.precision.wire, y)
                self._op_done(clock, began, stats, "fwd_s", self.fwd_target_s)
                saved[k] = (x_in, grad_leaves(y))
                for dst in self.act_dsts:
                    pending.extend(send_activation(y, dst, k))
            else:
                grads: list[torch.Tensor] | None = None
                if not last and saved[k][1]:
                    grads = self._receive_grads(k, stats, early_grads, grads_order, saved)
                x_in, outs = saved.pop(k)
                if i == last_bwd and self.before_last_backward is not None:
                    self.before_last_backward(outs)
                began = clock.start()
                if outs:
                    torch.autograd.backward(outs, grads)
                self._op_done(clock, began, stats, "bwd_s", self.bwd_target_s)
                if x_in:
                    for dst in self.grad_dsts:
                        pending.extend(send_grads(x_in, dst, k, self.grad_group))
                stats.microbatches += 1
        started = time.perf_counter()
        for work, _ in pending:
            work.wait()
        stats.wait_s += time.perf_counter() - started
        clock.resolve(stats)
        loss_sum = float(torch.stack(losses).double().sum()) if losses and self.reports else 0.0
        return stats, loss_sum

    def evaluate(
        self,
        sizes: Sequence[int],
        inputs: Callable[[int], Any],
        targets: Callable[[int], Any],
        metric: Callable[[Any, Any], Any],
    ) -> float:
        """Forward microbatches of ``sizes`` samples without gradients (layers in eval mode);
        return ``sum_k sizes[k] * metric_k`` on the last stage (0 elsewhere)."""
        first, last = self.prev_rank is None, self.next_rank is None
        total = 0.0
        pending: list[tuple[Any, torch.Tensor]] = []
        # every module's own mode, not the layers': train(mode) on a layer would also put a
        # submodule the job keeps in eval mode (a frozen BatchNorm) back in training
        modes = [(module, module.training) for layer in self.layers
                 for module in layer.modules()]
        for layer in self.layers:
            layer.eval()
        try:
            with torch.no_grad():
                for k, size in enumerate(sizes):
                    if first:
                        x = self._to_device(inputs(k))
                    else:
                        assert self.prev_rank is not None
                        x = recv_activation(self.prev_rank, k, self.device).value
                    with self.precision.autocast(self.device):
                        for layer in self.layers:
                            x = layer(x)
                    if last:
                        target = self._to_device(targets(k))
                        with self.precision.autocast(self.device):
                            total += size * float(metric(x, target))
                    for dst in self.act_dsts:
                        pending.extend(send_activation(map_tensors(self.precision.wire, x),
                                                       dst, k))
            for work, _ in pending:
                work.wait()
            if not self.reports:
                total = 0.0
        finally:
            for module, mode in modes:
                module.training = mode
        return total
