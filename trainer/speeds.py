"""Seconds per layer on the job's own device, for the daemon to plan with.

Why: the agents' matmul probe says what a device does on one large square
matmul; a real layer runs 3-15x slower than that, by a factor that depends on
the layer, the dtype and the microbatch size, and differs between devices. So
each rank times the job's layers on its device and sends the times on Attach
(:class:`hetpilot.trainer.daemon_link.GrpcPlanSource`); the daemon fits
device speeds and layer work to them (:mod:`hetpilot.planner.measured`,
:mod:`hetpilot.daemon.measured_fit`).

:func:`measure_layer_times` walks the layers as the profiler does
(:mod:`hetpilot.trainer.profile`, whose helpers it uses): each layer runs on the
previous layer's output, any pytree, and an input leaf needs a gradient exactly
when it needed one in the previous output. Layers are timed one **class** at a
time: layers of the same type and printed structure, parameter names, shapes,
dtypes and ``requires_grad``, and input leaf shapes, dtypes and ``requires_grad``
(and the same non-tensor input leaves) are one class, timed once; the next
layer then takes the class's output as its input. GPT's 12 identical blocks
cost one block's timing, and at most one layer is on the device at a time
(modules are copied one by one, factories called one by one, so the job's
modules are untouched).

Per class: ``warmup`` untimed runs, more until ``warmup_s`` seconds have passed, then
``repeats`` timed ones; each run is a
forward under ``torch.autocast(device.type, dtype=autocast_dtype)`` when that is
given (mixed precision: float32 weights) and a backward from ones-like
gradients on every floating output leaf that requires one (0 s when none
does). CUDA times come from CUDA events (the device's own clock) around each
run, the runs queued back to back and read at the end, as the trainer queues
its ops; CPU times from ``time.perf_counter``. The result is the median.

On CUDA the defaults are 10 timed runs after at least 0.2 s of warm-up per class
(elsewhere 3 runs after ``warmup`` runs): a run costs milliseconds there, and a GPU's
first runs are not its steady state. On an H100 a GPT-2 block at microbatch 8 in
bfloat16 (bound by the host's kernel launches) timed 1.2-1.7x slower in the first
measurement of a process, after one warm-up run, than a minute later (bench/gpu/
e_*.json, f_*.json: predictions 0.118 -> 0.096 s and 0.227 -> 0.136 s): the GPU's
clocks idle at a fraction of their peak until work arrives, and the host's first
passes through autocast and the allocator are slower than later ones.

Also on CUDA, a layer whose output has its input's structure (a residual block) is
timed ``chain`` (4) times in a row on its own output with one backward through them
all, each run's times divided by 4. Where the host's launches bound the device, each
separate forward and backward call carries the host's fixed costs (the autograd
engine's start, the gradient seeds, the marks), which a stage of many layers pays once
per microbatch: timed one by one, the layers of GPT-2 small in bfloat16 at microbatch
8 summed to 1.19-1.27x the op time of the same microbatch in training on an H200
(bench/RESULTS-gpu.md, lease I). On a CPU (default 1) those costs are a small part of
each op.

Under target-time emulation a rank's device is declared, not measured:
:func:`emulated_layer_times` gives the times the emulation makes each op last
(spec 5.1's ``m * gflop / (1000 T)``), which the daemon fits like measured ones.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .profile import (
    LayerSpec,
    _backward,
    _instantiate,
    _layer_input,
    _microbatch_size,
    _needs_backward,
)

__all__ = ["as_measurement", "dtype_label", "emulated_layer_times", "measure_layer_times"]

CPU_REPEATS = 3
CUDA_REPEATS = 10
CUDA_WARMUP_S = 0.2
CUDA_CHAIN = 4
"""Defaults per layer class (see the module docstring)."""


def measure_layer_times(
    layers: Sequence[LayerSpec],
    sample: Any,
    microbatch: int,
    *,
    device: torch.device | str,
    autocast_dtype: torch.dtype | None = None,
    repeats: int | None = None,
    warmup: int = 1,
    warmup_s: float | None = None,
    chain: int | None = None,
    loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None = None,
) -> list[tuple[float, float]]:
    """(forward, backward) seconds of a microbatch of ``microbatch`` samples through each
    of ``layers`` on ``device`` (see the module docstring). ``sample``: any pytree whose
    tensor leaves have a leading batch dimension; it is cut or repeated to
    ``microbatch`` samples.

    ``loss``: (the job's loss, targets with a leading batch dimension): its forward and
    backward on the last layer's output are timed too and added to the last layer's
    times. The last stage runs it, and spec 5's model has no term of its own for it: a
    GPT-2 head's cross-entropy over 50304 classes reads and writes the float32 logits
    several times, which the layers' times alone left out (21% of an H100 iteration at
    microbatch 32 in bfloat16 went unpredicted)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    repeats = repeats if repeats is not None else CUDA_REPEATS if cuda else CPU_REPEATS
    warmup_s = warmup_s if warmup_s is not None else CUDA_WARMUP_S if cuda else 0.0
    chain = chain if chain is not None else CUDA_CHAIN if cuda else 1
    if microbatch < 1:
        raise ValueError(f"microbatch must be >= 1, got {microbatch}")
    if repeats < 1 or warmup < 0 or not warmup_s >= 0 or chain < 1:
        raise ValueError(f"repeats must be >= 1, warmup >= 0, warmup_s >= 0 and chain >= 1, "
                         f"got {repeats}, {warmup}, {warmup_s}, {chain}")
    x: Any = _resized(sample, microbatch, dev)
    done: dict[Hashable, tuple[tuple[float, float], Any]] = {}
    out: list[tuple[float, float]] = []
    for i, spec in enumerate(layers):
        built = None if isinstance(spec, nn.Module) else spec()
        module = spec if built is None else built
        assert isinstance(module, nn.Module)
        inp = _layer_input(x, first=i == 0)
        key = _class_key(module, inp)
        if key not in done:
            layer = built if built is not None else _instantiate([module])[0]
            times, y = _time_layer(layer.to(dev), inp, first=i == 0, device=dev,
                                   autocast_dtype=autocast_dtype, repeats=repeats,
                                   warmup=warmup, warmup_s=warmup_s, chain=chain)
            del layer
            done[key] = (times, _layer_input(y, first=False))  # detached, flags kept
        times, x = done[key]
        out.append(times)
    if loss is not None and out:
        from .layers import place_loss  # the runtime's rule: a loss module to the device

        own = copy.deepcopy(loss[0]) if isinstance(loss[0], nn.Module) else loss[0]  # untouched
        fn, targets = place_loss(own, dev, None), _resized(loss[1], microbatch, dev)
        (lf, lb), _ = _time_layer(lambda y: fn(y, targets), x, first=False, device=dev,
                                  autocast_dtype=autocast_dtype, repeats=repeats,
                                  warmup=warmup, warmup_s=warmup_s)
        out[-1] = (out[-1][0] + lf, out[-1][1] + lb)
    return out


def as_measurement(times: Sequence[tuple[float, float]], microbatch: int,
                   dtype: str) -> dict[str, Any]:
    """What :class:`~hetpilot.trainer.daemon_link.GrpcPlanSource` sends for one rank."""
    return {"microbatch": microbatch, "dtype": dtype,
            "layers": {i: (float(f), float(b)) for i, (f, b) in enumerate(times)}}


def dtype_label(autocast_dtype: torch.dtype | None,
                param_dtype: torch.dtype = torch.float32) -> str:
    """The measurement's dtype as the daemon keeps it: "bfloat16", "float32", ..."""
    return str(autocast_dtype or param_dtype).removeprefix("torch.")


def emulated_layer_times(fwd_gflop: Sequence[float], bwd_gflop: Sequence[float],
                         microbatch: int, tflops: float) -> list[tuple[float, float]]:
    """The times target-time emulation at ``tflops`` gives each layer (at least; an op
    never gets shorter than its real compute)."""
    if not (math.isfinite(tflops) and tflops > 0):
        raise ValueError(f"tflops must be > 0, got {tflops}")
    s = 1000.0 * tflops
    return [(microbatch * f / s, microbatch * b / s)
            for f, b in zip(fwd_gflop, bwd_gflop, strict=True)]


def _resized(sample: Any, microbatch: int, device: torch.device) -> Any:
    """``sample`` with ``microbatch`` samples, on ``device``: every tensor leaf whose first
    dimension is the sample's batch size is cut or repeated along it; others as they are."""
    n = _microbatch_size(sample)

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() > 0 and t.shape[0] == n and n != microbatch:
            reps = -(-microbatch // n)
            t = t.repeat(reps, *([1] * (t.dim() - 1)))[:microbatch]
        return t.detach().to(device)

    return pytree.tree_map(leaf, sample)


def _class_key(module: nn.Module, inp: Any) -> Hashable:
    """What makes two layers time the same (see the module docstring)."""
    params = tuple((name, tuple(p.shape), str(p.dtype), p.requires_grad)
                   for name, p in module.named_parameters())
    buffers = tuple((name, tuple(b.shape), str(b.dtype)) for name, b in module.named_buffers())
    leaves, spec = pytree.tree_flatten(inp)
    shapes = tuple((tuple(t.shape), str(t.dtype), t.requires_grad)
                   if isinstance(t, torch.Tensor) else ("value", repr(t)[:200])
                   for t in leaves)
    return (type(module), repr(module), params, buffers, str(spec), shapes)


class _Clock:
    """Marks on the device's own timeline: CUDA events there, perf_counter elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return float(end - start)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


def _time_layer(layer: Callable[[Any], Any], x: Any, *, first: bool, device: torch.device,
                autocast_dtype: torch.dtype | None, repeats: int, warmup: int,
                warmup_s: float = 0.0, chain: int = 1) -> tuple[tuple[float, float], Any]:
    """Median (forward, backward) seconds of ``layer`` on ``x``, and its output. With
    ``chain`` > 1 a layer whose output has its input's structure (a residual block) runs
    ``chain`` times in a row on its own output, one backward through them all, and each
    run's times are divided by ``chain`` (see :func:`measure_layer_times`)."""
    clock = _Clock(device)
    autocast: Callable[[], Any] = (
        (lambda: torch.autocast(device.type, dtype=autocast_dtype))
        if autocast_dtype is not None else contextlib.nullcontext)
    marks: list[tuple[Any, Any, Any, bool, int]] = []
    y: Any = None
    n = 1  # applications per run: ``chain`` once the first run showed the layer chains
    warm_until = time.perf_counter() + warmup_s
    run = 0
    with torch.enable_grad():
        while len(marks) < repeats:
            inp = _layer_input(x, first=first)
            start = clock.mark()
            with autocast():
                y = layer(inp)
                for _ in range(n - 1):
                    y = layer(y)
            mid = clock.mark()
            backward = _needs_backward(y)
            if backward:
                _backward(y)
            end = clock.mark()
            run += 1
            if run > warmup and time.perf_counter() >= warm_until:
                marks.append((start, mid, end, backward, n))
            if run == 1 and chain > 1 and not first and _chains(inp, y):
                n = chain
    # CUDA: the runs are queued back to back and read only now, as the trainer queues its
    # ops: each is the device's time, or the host's launching where that is slower (a
    # GPT-2 block at microbatch 8 in bfloat16 on an H100 is). Waiting for the device
    # before each run, as this did, added an idle device's launch latency to every run.
    fwd = [clock.seconds(start, mid) / k for start, mid, _, _, k in marks]
    bwd = [clock.seconds(mid, end) / k if backward else 0.0
           for _, mid, end, backward, k in marks]
    return (statistics.median(fwd), statistics.median(bwd)), y


def _chains(inp: Any, out: Any) -> bool:
    """Whether ``out`` can be the same layer's input again: the same pytree structure, and
    tensor leaves of the same shapes, dtypes and ``requires_grad``."""
    a, spec_a = pytree.tree_flatten(inp)
    b, spec_b = pytree.tree_flatten(out)
    if spec_a != spec_b or not a:
        return False
    for s, t in zip(a, b, strict=True):
        if isinstance(s, torch.Tensor) != isinstance(t, torch.Tensor):
            return False
        if isinstance(s, torch.Tensor) and (
                s.shape != t.shape or s.dtype != t.dtype or s.requires_grad != t.requires_grad):
            return False
    return True
