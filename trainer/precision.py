"""Numeric precision of a job: plain casts, or mixed precision with float32 master weights.

``--dtype`` (``TrainerConfig(dtype=...)``) means one of two things:

* ``float32`` / ``float64``: a **plain cast**. Floating parameters, buffers,
  inputs and targets are cast to the dtype and everything computes in it
  (``train-check`` runs float64 this way and matches one process to ~1e-16).
* ``bfloat16`` / ``float16``: **mixed precision**, as ``torch.autocast`` is
  meant to be used. Parameters, gradients and optimizer state stay float32
  (the master weights); each stage's forward (and, under recompute, its
  recomputation) runs under ``torch.autocast(device_type, dtype)``, so matmuls
  and convolutions compute in the low dtype; the floating leaves a stage sends
  to the next one are cast to the low dtype inside the autograd graph, so
  activations and their gradients cross stages at half the bytes; gradients
  are summed across groups in float32.

float16 needs loss scaling. ``torch.amp.GradScaler`` cannot be used here: it
decides per process whether gradients overflowed, while in a pipeline every
rank holds other layers and all of them must skip (or take) the same step.
:class:`LossScaler` is the same dynamic rule (GradScaler's defaults: start at
2**16, halve on overflow and skip the step, double after 2000 clean steps)
with the overflow flag all-reduced over every rank, so every rank takes the
same decision and keeps the same scale.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["LossScaler", "Precision", "cast_floating", "dtype_name", "precision_for"]

_COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def cast_floating(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` (in place) with its floating parameters and buffers in ``dtype``, its
    complex ones in the complex dtype of the same precision (complex128 under float64,
    complex64 under float32; as they are under a 16-bit dtype), integer and bool ones as
    they are. Not ``Module.to(dtype=...)``: it casts complex tensors to the real dtype,
    dropping their imaginary parts, so a user's model with a complex weight trained, in
    the ranks and in train-check's reference alike, as another, real model."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(dtype)
        if t.is_complex() and dtype in _COMPLEX_OF:
            return t.to(_COMPLEX_OF[dtype])
        return t

    return module._apply(convert)

#: Low dtypes that select mixed precision.
MIXED = (torch.bfloat16, torch.float16)


def dtype_name(dtype: torch.dtype | None) -> str:
    """"bfloat16" for ``torch.bfloat16``; "" for None (as the job gives it)."""
    return "" if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Precision:
    """How a job computes: see the module docstring."""

    param_dtype: torch.dtype | None = None
    """Floating parameters, buffers, inputs and targets are cast to this (None: left as given)."""
    compute_dtype: torch.dtype | None = None
    """Mixed precision: the autocast dtype; None for a plain cast."""

    @property
    def mixed(self) -> bool:
        return self.compute_dtype is not None

    @property
    def scaled(self) -> bool:
        """float16 needs dynamic loss scaling (bfloat16 has float32's range)."""
        return self.compute_dtype == torch.float16

    @property
    def name(self) -> str:
        """What ``--dtype`` said: the compute dtype ("" when nothing is cast)."""
        return dtype_name(self.compute_dtype or self.param_dtype)

    def autocast(self, device: torch.device) -> torch.autocast:
        """The context a stage's forward runs under (disabled for a plain cast)."""
        return torch.autocast(device.type, dtype=self.compute_dtype or torch.bfloat16,
                              enabled=self.mixed)

    def wire(self, t: torch.Tensor) -> torch.Tensor:
        """A floating leaf as it crosses a cut: the compute dtype under mixed precision."""
        if self.compute_dtype is None or not t.is_floating_point() or t.dtype == self.compute_dtype:
            return t
        return t.to(self.compute_dtype)


def precision_for(dtype: torch.dtype | None) -> Precision:
    """``--dtype`` to a :class:`Precision`: float16/bfloat16 mean mixed precision."""
    if dtype is None:
        return Precision()
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if dtype in MIXED:
        return Precision(param_dtype=torch.float32, compute_dtype=dtype)
    return Precision(param_dtype=dtype)


class LossScaler:
    """Dynamic loss scaling for float16, decided identically on every rank (module docstring).

    Every rank calls :meth:`update` once per iteration (idle ranks too, with no
    gradients): it all-reduces the overflow flag, unscales the gradients when
    the step is taken, and returns whether to step.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._clean = 0
        self.skipped = 0
        """Steps skipped because some rank's gradients overflowed."""

    def update(self, grads: Iterable[torch.Tensor], device: torch.device) -> bool:
        """All ranks: True to step (gradients unscaled in place), False to skip it."""
        grads = list(grads)
        bad = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:  # one flag; no host sync per tensor
            # a sparse gradient (nn.Embedding(sparse=True) under one group) by its values,
            # as torch.amp.GradScaler checks it; a split one (DTensor) by this rank's slice
            values = g.to_local() if isinstance(g, DTensor) else g._values() if g.is_sparse \
                else g
            bad += (~torch.isfinite(values)).any().to(bad.dtype)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if float(bad.item()) > 0:
            self.scale *= self.backoff_factor
            self._clean = 0
            self.skipped += 1
            return False
        inverse = 1.0 / self.scale
        for g in grads:
            g.mul_(inverse)
        self._clean += 1
        if self._clean >= self.growth_interval:
            self.scale *= self.growth_factor
            self._clean = 0
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean": float(self._clean), "skipped": float(self.skipped)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._clean = int(state.get("clean", 0))
        self.skipped = int(state.get("skipped", 0))
