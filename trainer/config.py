"""The settings of one rank's :class:`~hetpilot.trainer.runtime.Trainer`, as one frozen value.

Everything a trainer is told that is not an object it calls (layers, loss, optimizer
factory, data, plan source, reporter, metric) lives here, checked once when it is made,
so the runtime's constructor only composes its parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hetpilot.planner.types import Model

from .jobspec import check_tp_plan

__all__ = ["TrainerConfig"]


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """One rank's trainer settings; a wrong value raises ``ValueError`` naming it."""

    global_batch: int
    """Samples per optimizer step, over all data-parallel groups."""
    device_id: str
    """This rank's device id as plans name it (``host:index``); unique among the ranks."""
    seed: int = 0
    """Seeds the layer factories, the per-epoch sample order and the microbatches' RNG."""
    dtype: torch.dtype | None = None
    """None keeps every parameter, buffer and input in its own dtype; float32/float64 cast
    the layers' floating parameters and buffers and the floating input and target leaves
    (integer token ids are never cast); bfloat16/float16 are mixed precision with float32
    master weights (:mod:`hetpilot.trainer.precision`; float16 with dynamic loss scaling
    agreed by every rank)."""
    device: torch.device | str = "cpu"
    """Where this rank's layers and tensors live (kept as a ``torch.device``)."""
    slowdown: float = 1.0
    """EMULATION, sleep-ratio: each op takes ``slowdown`` times its compute (>= 1)."""
    emulate_tflops: float | None = None
    """EMULATION, target-time: each op lasts at least ``m * GFLOP / (1000 * emulate_tflops)``
    s (spec 5.1), with ``layer_gflop``."""
    layer_gflop: Sequence[tuple[float, float]] | None = None
    """Per-sample ``(fwd_gflop, bwd_gflop)`` of each layer, e.g. from
    :func:`hetpilot.trainer.profile.profile_model`; needed by target-time emulation (kept
    as a tuple)."""
    split_model: Model | None = None
    """EMULATION, target-time: the job's profile as the planner reads it (spec 2, with each
    split layer's ``tp_comm_mb``); with it a tensor-parallel stage's ops last as spec 5.6
    reads them (split work / (t * efficiency) plus the all-reduces) instead of whole."""
    tp_link: tuple[float, float] | None = None
    """EMULATION, target-time: (Gbit/s, latency s) of a tensor-parallel stage's all-reduces
    in those times (None: none; the real all-reduces still take their time)."""
    emulate_file: str | Path | None = None
    """EMULATED conditions (:mod:`hetpilot.emulation`), re-read before every iteration: this
    rank's device speed there replaces ``emulate_tflops`` (needs ``layer_gflop``), and each
    gradient all-reduce lasts at least spec 5.3's time over the file's host links."""
    report_from_rank0: bool = False
    """Gather every rank's record to rank 0, which calls the reporter once per rank (a
    reporter that talks to the daemon lives on rank 0 only)."""
    keep_plan_on_refusal: bool = False
    """A polled plan that :func:`~hetpilot.trainer.plans.check_plan` refuses is logged and
    skipped, identically on every rank, and the running plan goes on (daemon sources)."""
    overlap_sync: bool = True
    """All-reduce each chunk of gradients as soon as the iteration's last backward has
    produced it (:mod:`hetpilot.trainer.gradsync`); False syncs after the backward."""
    bucket_cap_mb: float = 25.0
    """Largest chunk of gradients one all-reduce carries, in MB."""
    merge_optimizers: bool = True
    """Step the layers' optimizers as one where that is exact
    (:mod:`hetpilot.trainer.optimstep`); False steps each alone."""
    tp_plan: Mapping[str, str] | None = None
    """The job's ``tp_plan`` (:mod:`hetpilot.trainer.tensorparallel`): what each layer of a
    tensor-parallel stage splits; None refuses plans with tensor-parallel stages."""
    gradient_group: bool | None = field(default=None)
    """Pipeline gradients cross in a process group of their own, apart from the activations
    (:mod:`hetpilot.trainer.pipeline`); None: under NCCL only, which needs it. See
    [Note: the gradients' own group] in :mod:`hetpilot.trainer.runtime`."""

    def __post_init__(self) -> None:
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) \
                or self.global_batch < 1:
            raise ValueError(f"global_batch must be an integer >= 1, got {self.global_batch!r}")
        if not isinstance(self.device_id, str) or not self.device_id:
            raise ValueError(f"device_id must be a non-empty string, got {self.device_id!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype or None, got {self.dtype!r}")
        object.__setattr__(self, "device", torch.device(self.device))
        if self.slowdown < 1.0:
            raise ValueError(f"slowdown must be >= 1 (an emulated slower device), "
                             f"got {self.slowdown}")
        if self.emulate_tflops is not None and not self.emulate_tflops > 0:
            raise ValueError(f"emulate_tflops must be > 0, got {self.emulate_tflops}")
        if self.slowdown != 1.0 and (self.emulate_tflops is not None
                                     or self.emulate_file is not None):
            raise ValueError("choose one emulation mode: slowdown or emulate_tflops")
        if self.layer_gflop is not None:
            object.__setattr__(self, "layer_gflop", tuple(
                (float(f), float(b)) for f, b in self.layer_gflop))
        if self.tp_plan is not None:
            object.__setattr__(self, "tp_plan", check_tp_plan(self.tp_plan, "tp_plan"))
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
