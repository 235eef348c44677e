"""Model profile (spec v1 section 2) measured on a sample microbatch, no hand-written numbers.

Per layer, run on a sample microbatch of ``m`` samples and divided by ``m``:

* ``fwd_gflop`` / ``bwd_gflop``: ``torch.utils.flop_counter.FlopCounterMode``
  around the layer's forward and around its backward (the backward includes
  the input gradient except for layer 0, whose input needs none). The counter
  knows matmuls and convolutions; element-wise ops count as 0;
* ``out_mb``: the output's bytes;
* ``act_mb``: the bytes of the tensors autograd saves for the backward
  (``torch.autograd.graph.saved_tensors_hooks``, each tensor counted once,
  parameters excluded);
* ``param_mb``: the layer's parameter and buffer bytes (not per sample).

:func:`layer_times` also measures seconds per layer (median of repeats),
which the benchmark turns into a reference-model prediction.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["layer_times", "profile_model"]


def _build(spec: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    return spec if isinstance(spec, nn.Module) else spec()


def profile_model(
    layers: Sequence[nn.Module | Callable[[], nn.Module]],
    sample: torch.Tensor,
    *,
    name: str = "model",
    optimizer_factor: float = 3.0,
) -> dict[str, Any]:
    """The spec section 2 model dict of ``layers`` run on ``sample`` (a microbatch)."""
    m = sample.shape[0]
    x = sample
    out_layers = []
    for i, spec in enumerate(layers):
        layer = _build(spec)
        inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
        param_ids = {p.data_ptr() for p in layer.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved,
                 param_ids: set[int] = param_ids) -> torch.Tensor:
            ptr = t.data_ptr()
            if ptr not in param_ids:
                saved[ptr] = max(saved.get(ptr, 0), t.numel() * t.element_size())
            return t

        with FlopCounterMode(display=False) as fwd_count, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(inp)
        bwd_flops = 0
        if y.requires_grad:
            with FlopCounterMode(display=False) as bwd_count:
                y.backward(torch.ones_like(y))
            bwd_flops = bwd_count.get_total_flops()
        layer.zero_grad(set_to_none=True)  # a module the trainer will use must start clean
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        param_bytes += sum(b.numel() * b.element_size() for b in layer.buffers())
        out_layers.append({
            "name": f"{i}:{type(layer).__name__}",
            "fwd_gflop": fwd_count.get_total_flops() / m / 1e9,
            "bwd_gflop": bwd_flops / m / 1e9,
            "out_mb": y.numel() * y.element_size() / m / 1e6,
            "act_mb": sum(saved.values()) / m / 1e6,
            "param_mb": param_bytes / 1e6,
        })
        x = y.detach()
    return {"name": name, "optimizer_factor": optimizer_factor, "layers": out_layers}


def layer_times(
    layers: Sequence[nn.Module], sample: torch.Tensor, *, repeats: int = 5
) -> list[tuple[float, float]]:
    """Median (forward, backward) seconds of each layer on ``sample``."""
    out = []
    x = sample
    for i, layer in enumerate(layers):
        fwd, bwd = [], []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(i > 0)
            started = time.perf_counter()
            y = layer(inp)
            mid = time.perf_counter()
            y.backward(torch.ones_like(y))
            end = time.perf_counter()
            fwd.append(mid - started)
            bwd.append(end - mid)
        layer.zero_grad(set_to_none=True)
        out.append((statistics.median(fwd), statistics.median(bwd)))
        x = y.detach()
    return out
