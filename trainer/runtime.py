"""The hybrid data + pipeline parallel runtime: carries out plans and switches them live.

A user hands :class:`Trainer` the model as an ordered list of layers
(modules, e.g. the children of an ``nn.Sequential``, or zero-argument
factories), a loss, an optimizer factory and a map-style dataset of
``(input, target)`` pairs; every rank of a ``torchrun`` job builds one
``Trainer`` after ``torch.distributed.init_process_group``.

How a plan (spec v1 section 4) runs:

* the rank whose device id is a stage's device holds that stage's layers and
  runs the stage's op order (:mod:`hetpilot.trainer.pipeline`); ranks whose
  device the plan leaves out idle for the epoch;
* iteration i of epoch e takes samples ``perm_e[i*B:(i+1)*B]`` of a
  seeded per-epoch permutation, whatever the plan; group g takes the g-th
  slice of its ``samples`` and cuts it into microbatches;
* the last stage scales each microbatch's (mean-reduced) loss by ``m / B``,
  so summing gradients over microbatches and over groups gives exactly the
  full-batch mean gradient; the gradient sum over groups is one all-reduce
  per bucket of spec section 5.3 (maximal runs of layers with the same owners),
  in layer order on every rank, over a process group of the owners;
* each layer has its own optimizer (from the user's factory). Element-wise
  optimizers (SGD, Adam, AdamW, ...) step exactly as one optimizer over the
  whole model would; optimizers that couple layers (LAMB's global norm,
  gradient clipping by global norm) do not, and are not supported.

Live switching (:meth:`Trainer.switch`): before every iteration rank 0 polls
its :class:`~hetpilot.trainer.plans.PlanSource` and broadcasts what it got
(:meth:`Trainer.fit`; two integers when nothing changed),
so all ranks take the same version at the same step; every rank checks the
plan (:func:`~hetpilot.trainer.plans.check_plan`); each layer whose new
owner did not hold it receives its parameters and optimizer state from its
owner in the old plan's group 0; the bucket process groups are rebuilt. The
step counter and the data order carry on unchanged.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import plan_from_dict, plan_to_dict
from hetpilot.planner.types import Plan
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from hetpilot.emulation import EmulationFile, allreduce_s

from .activations import wire_device
from .gradsync import Bucket, GradSync
from .itemseed import read_items
from .optimstep import OptimizerStep
from .pipeline import StageRunner, StageStats, microbatch_seed
from .plans import PlanSource, PlanVersion, check_plan
from .precision import LossScaler, cast_floating, precision_for
from .replicas import (
    Tie,
    find_ties,
    hidden_reference,
    load_nonpersistent,
    nonpersistent_buffers,
    reconcile_buffers,
    snapshot_buffers,
    tie_param,
)

__all__ = ["EVAL_EPOCH", "JsonlReporter", "NoPlanError", "Trainer", "build_layer", "copy_layers",
           "layer_seed", "place_loss"]

LayerSpec = nn.Module | Callable[[], nn.Module]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Metric = Callable[[Any, Any], Any]
Reporter = Callable[[dict[str, Any]], None]

log = logging.getLogger("hetpilot.trainer")


def layer_seed(seed: int, layer: int) -> int:
    """Seed under which layer ``layer``'s factory is called (same on every rank)."""
    return seed * 1_000_003 + 7919 * layer + 1


def build_layer(spec: LayerSpec, seed: int, layer: int) -> nn.Module:
    """Layer ``layer``'s module: ``spec`` itself, or its factory called under
    :func:`layer_seed`. A factory that cannot be called without arguments (a function such
    as ``torch.tanh``), or that returns no module, or one with uninitialized (lazy)
    parameters is refused here, by a ``ValueError`` naming the layer, rather than failing
    later in a rank's forward."""
    if isinstance(spec, nn.Module):
        return spec
    name = getattr(spec, "__qualname__", None) or type(spec).__name__
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, layer))
        try:
            module = spec()
        except TypeError as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
                raise  # raised inside the factory: the user's own error
            raise ValueError(f"layers: item {layer} ({name}) is neither a module nor a "
                             f"zero-argument factory (calling it raised: {exc}); wrap a "
                             "function in an nn.Module") from exc
    if not isinstance(module, nn.Module):
        raise ValueError(f"layers: item {layer}: its factory ({name}) returned a "
                         f"{type(module).__name__}, not an nn.Module")
    if any(getattr(m, "has_uninitialized_params", lambda: False)() for m in module.modules()):
        raise ValueError(f"layers: item {layer}: its factory ({name}) returned a module with "
                         "uninitialized (lazy) parameters; build it with their shapes")
    return module


def copy_layers(specs: Sequence[Any], memo: dict[int, Any] | None = None) -> list[Any]:
    """``copy.deepcopy`` of a list of layers (one memo: modules and parameters shared between
    layers stay shared), whose parameters are leaves as the originals are.

    Deep-copying a ``torch.jit.script``-ed module clones its parameters inside the autograd
    graph (non-leaf tensors with a ``CloneBackward`` function), which an optimizer refuses
    ("can't optimize a non-leaf Tensor") and which never get a ``.grad``: such copies are
    detached in place here, keeping each parameter's ``requires_grad``.

    The weight that ``torch.nn.utils.weight_norm`` (the hook API, common in vocoders) keeps
    as a plain attribute is a non-leaf tensor, which ``deepcopy`` refuses; its hook computes
    it again before every forward, so the copy takes it detached. Any other non-leaf
    tensor attribute is refused by name.

    ``deepcopy`` drops a parameter's own hooks (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``): each copy gets its original's again, so the
    pre-flight and the profile run the backward the ranks run (a gradient clamp, a hook
    that raises). A hook closing over the original parameter or module still acts on
    those; only the hook objects are shared."""
    import copy

    memo = {} if memo is None else memo
    for i, spec in enumerate(specs):
        if isinstance(spec, nn.Module):
            _detach_hook_computed(spec, i, memo)
    copies = copy.deepcopy(list(specs), memo)
    for spec, dup in zip(specs, copies, strict=True):
        if not isinstance(spec, nn.Module):
            continue
        for (_, p), (_, q) in zip(spec.named_parameters(remove_duplicate=False),
                                  dup.named_parameters(remove_duplicate=False), strict=True):
            if not q.is_leaf:
                q.detach_()
                q.requires_grad_(p.requires_grad)
            _copy_parameter_hooks(p, q)
    return copies


def _copy_parameter_hooks(original: torch.Tensor, dup: torch.Tensor) -> None:
    """Register ``original``'s gradient hooks on its copy ``dup`` (see :func:`copy_layers`),
    once: a parameter shared by several layers, or met again through a shared memo,
    already has them."""
    if original is dup or dup._backward_hooks or getattr(
            dup, "_post_accumulate_grad_hooks", None):
        return
    for hook in (original._backward_hooks or {}).values():
        dup.register_hook(hook)
    for hook in (getattr(original, "_post_accumulate_grad_hooks", None) or {}).values():
        dup.register_post_accumulate_grad_hook(hook)


def _detach_hook_computed(layer: nn.Module, index: int, memo: dict[int, Any]) -> None:
    """Put detached copies of ``weight_norm``'s computed weights into a deepcopy ``memo``
    (see :func:`copy_layers`); raise ValueError naming any other non-leaf tensor attribute."""
    from torch.nn.utils.weight_norm import WeightNorm

    for path, module in layer.named_modules():
        computed = {hook.name for hook in module._forward_pre_hooks.values()
                    if isinstance(hook, WeightNorm)}
        for attr, value in vars(module).items():
            if not (isinstance(value, torch.Tensor) and not value.is_leaf):
                continue
            if attr not in computed:
                where = f"{path}.{attr}" if path else attr
                raise ValueError(
                    f"layers: item {index} ({type(layer).__name__}): attribute {where!r} is "
                    "a tensor computed from the parameters (not a leaf), which cannot be "
                    "copied to the ranks; compute it in forward, or use "
                    "torch.nn.utils.parametrize")
            memo.setdefault(id(value), value.detach())


def place_loss(loss_fn: Any, device: torch.device | None, dtype: torch.dtype | None) -> Any:
    """A loss (or metric) that is a module (``nn.CrossEntropyLoss(weight=w)``,
    ``nn.BCEWithLogitsLoss(pos_weight=w)``) moved, in place, to ``device`` and its floating
    buffers and parameters cast to ``dtype`` (None: kept), as the layers are: the class
    weights must meet the outputs' device and dtype. Anything else is returned as it is."""
    if isinstance(loss_fn, nn.Module):
        if device is not None:
            loss_fn.to(device=device)
        if dtype is not None:
            cast_floating(loss_fn, dtype)
    return loss_fn


EVAL_EPOCH = -1
"""The epoch under which the held-out set's items are read (:func:`read_items`)."""


class JsonlReporter:
    """Appends each report as one JSON line (offline measurement)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __call__(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


class NoPlanError(RuntimeError):
    """Training cannot start: the source has no plan, or refused the only one it gave."""


class _Slot:
    """What one rank measured since the last record."""

    def __init__(self) -> None:
        self.total = StageStats()
        self.steps = 0
        self.started = time.perf_counter()
        self.switch_s: float | None = None
        """Seconds of the plan switch that opened this slot (None: it opened without one)."""

    def add(self, stats: StageStats | None) -> None:
        self.steps += 1
        if stats is not None:
            self.total.add(stats)


class Trainer:
    """One rank of a hybrid DP + pipeline job. See the module docstring."""

    def __init__(
        self,
        layers: Sequence[LayerSpec] | nn.Sequential,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: OptimizerFactory,
        dataset: Any,
        *,
        global_batch: int,
        device_id: str,
        plan_source: PlanSource | None = None,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        slowdown: float = 1.0,
        emulate_tflops: float | None = None,
        layer_gflop: Sequence[tuple[float, float]] | None = None,
        reporter: Reporter | None = None,
        report_from_rank0: bool = False,
        keep_plan_on_refusal: bool = False,
        emulate_file: str | Path | None = None,
        eval_dataset: Any = None,
        metric: Metric | None = None,
        overlap_sync: bool = True,
        bucket_cap_mb: float = 25.0,
        merge_optimizers: bool = True,
        gradient_group: bool | None = None,
    ) -> None:
        """``slowdown`` and ``emulate_tflops`` are the two EMULATION modes (off by default):
        sleep-ratio (each op takes ``slowdown`` times its compute) and target-time (each op
        lasts at least ``m * GFLOP / (1000 * emulate_tflops)`` s, spec 5.1, with the
        per-sample ``(fwd_gflop, bwd_gflop)`` of each layer in ``layer_gflop``, e.g. from
        :func:`hetpilot.trainer.profile.profile_model`).

        ``report_from_rank0``: gather every rank's epoch record to rank 0, which calls the
        reporter once per rank (a reporter that talks to the daemon lives on rank 0 only).
        ``keep_plan_on_refusal``: a polled plan that :func:`check_plan` refuses is logged and
        skipped, identically on every rank, and the running plan goes on (daemon sources).
        ``emulate_file``: EMULATED conditions (:mod:`hetpilot.emulation`, off by default),
        re-read before every iteration: this rank's device speed there replaces
        ``emulate_tflops`` (target-time mode, needs ``layer_gflop``), and each gradient
        all-reduce lasts at least spec 5.3's time over the file's host links.

        ``dtype``: None keeps every parameter, buffer and input in the dtype it has;
        float32/float64 cast the layers' floating parameters and buffers and the floating
        input and target leaves to it (integer token ids are never cast); bfloat16/float16
        are mixed precision with float32 master weights (:mod:`hetpilot.trainer.precision`;
        float16 with dynamic loss scaling agreed by every rank).
        ``eval_dataset`` and ``metric``: at the end of each epoch, group 0's pipeline runs
        the held-out set forward (layers in ``eval()`` mode, no gradients) and the epoch
        record's ``eval_metric`` is the sample-weighted mean of ``metric(output, target)``
        over its microbatches (``metric`` returns the mean over one microbatch).
        ``overlap_sync``: all-reduce each chunk of at most ``bucket_cap_mb`` of gradients as
        soon as the iteration's last backward has produced it (:mod:`hetpilot.trainer.gradsync`);
        False syncs after the backward, bucket by bucket. ``merge_optimizers``: step the
        layers' optimizers as one where that is exact (:mod:`hetpilot.trainer.optimstep`);
        False steps each alone. ``gradient_group``: pipeline gradients cross in a process
        group of their own, apart from the activations (:mod:`hetpilot.trainer.pipeline`);
        None: under NCCL only, which needs it. gloo progresses each message by itself, and
        on a 2-core machine the second group's threads made a balanced 2-stage 1F1B
        pipeline 10-20% slower (bench/RESULTS-trainer.md).
        """
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group before Trainer()")
        if slowdown < 1.0:
            raise ValueError(f"slowdown must be >= 1 (an emulated slower device), got {slowdown}")
        self._emu = EmulationFile(emulate_file) if emulate_file is not None else None
        if self._emu is not None and emulate_tflops is None:
            emulate_tflops = self._emu.state().devices.get(device_id)
            if emulate_tflops is None:
                raise ValueError(f"emulate_file: names no speed for device {device_id!r}; "
                                 "give emulate_tflops too")
        if emulate_tflops is not None:
            if not emulate_tflops > 0:
                raise ValueError(f"emulate_tflops must be > 0, got {emulate_tflops}")
            if slowdown != 1.0:
                raise ValueError("choose one emulation mode: slowdown or emulate_tflops")
            if layer_gflop is None or len(layer_gflop) != len(layers):
                raise ValueError("emulate_tflops needs layer_gflop: (fwd, bwd) GFLOP per sample "
                                 "for every layer")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._specs: list[LayerSpec] = list(layers)
        if not self._specs:
            raise ValueError("the model needs at least one layer")
        self.precision = precision_for(dtype)
        self.device = torch.device(device)
        self._loss_fn = place_loss(loss_fn, self.device, self.precision.param_dtype)
        self._opt_factory = optimizer
        self.dataset = dataset
        self.global_batch = global_batch
        self.iterations_per_epoch = len(dataset) // global_batch
        if self.iterations_per_epoch < 1:
            raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one batch")
        self.seed = seed
        self._order_cache: tuple[int, torch.Tensor] | None = None  # (epoch, its order)
        self._optim_step = OptimizerStep(merge=merge_optimizers)  # the layers' as one
        self.precision = precision_for(dtype)
        self._scaler = LossScaler() if self.precision.scaled else None
        self.device = torch.device(device)
        self.slowdown = slowdown
        self.emulate_tflops = emulate_tflops
        self._layer_gflop = [tuple(map(float, g)) for g in layer_gflop] if layer_gflop else []
        self.reporter = reporter
        self.report_from_rank0 = report_from_rank0
        self.keep_plan_on_refusal = keep_plan_on_refusal
        self.refused: list[tuple[int, str]] = []
        """(version, error) of plans skipped under ``keep_plan_on_refusal``."""
        self._refused_version = 0
        self.source = plan_source
        self.device_id = device_id
        if (eval_dataset is None) != (metric is None):
            raise ValueError("eval_dataset and metric go together: give both or neither")
        self.eval_dataset = eval_dataset
        self.metric = place_loss(metric, self.device, self.precision.param_dtype)
        ids: list[Any] = [None] * self.world
        dist.all_gather_object(ids, device_id)
        self.device_ids: list[str] = [str(i) for i in ids]
        if len(set(self.device_ids)) != self.world:
            raise ValueError(f"two ranks report the same device id: {self.device_ids}")
        self.rank_of = {d: r for r, d in enumerate(self.device_ids)}
        hidden = hidden_reference(self._specs)
        if hidden is not None:
            raise ValueError(f"layers: {hidden}")
        self.ties: list[Tie] = find_ties(self._specs)
        """Parameters shared between layers (see :mod:`hetpilot.trainer.replicas`)."""
        found: list[Any] = [None] * self.world
        dist.all_gather_object(found, [t.uses for t in self.ties])
        if any(f != found[0] for f in found):
            raise ValueError("ranks found different tied parameters in the model; the job "
                             "function must build the same modules on every rank")
        self._tie_of: dict[int, list[int]] = {}
        """layer -> indices of the ties it uses."""
        for t, tie in enumerate(self.ties):
            for layer in tie.layers:
                self._tie_of.setdefault(layer, []).append(t)
        self._tie_optims: dict[int, torch.optim.Optimizer | None] = {}
        """The ties this rank holds (any of their layers), each with its own optimizer."""

        self.plan: Plan | None = None
        self.version = 0
        self.epoch = 0
        self.iteration = 0
        """Next iteration within ``epoch``."""
        self.step = 0
        """Optimizer steps taken (global iterations)."""
        self._held: dict[int, nn.Module] = {}
        self._optims: dict[int, torch.optim.Optimizer | None] = {}
        # owners[l]: ranks holding layer l now; [] means "build it where needed".
        self._owners: list[list[int]] = [[] for _ in self._specs]
        if any(isinstance(s, nn.Module) for s in self._specs):
            # Modules built by user code may differ per rank: rank 0's are the truth.
            self._owners = [[0] for _ in self._specs]
            if self.rank == 0:
                for layer in range(self.num_layers):
                    self._install(layer)
                for t in range(len(self.ties)):
                    self._install_tie(t)
        self._ckpt_dir: Path | None = None
        self._runner: StageRunner | None = None
        self._ops: tuple[tuple[bool, int], ...] = ()
        self._role: tuple[int, int] | None = None
        self._buckets: list[tuple[int, int, Any]] = []  # (first, end, process group) I take part in
        self._tie_groups: list[tuple[int, Any]] = []  # (tie, process group of its holders)
        self._loss_sum = 0.0
        """Sum of this rank's scaled microbatch losses since the last epoch record."""
        self.overlap_sync = overlap_sync
        self.bucket_cap_mb = bucket_cap_mb
        self._gradsync: GradSync | None = None
        self._groups_made: list[Any] = []
        if gradient_group is None:
            gradient_group = dist.get_backend() == "nccl"
        self.gradient_group = gradient_group
        self._grad_group: Any = None
        """The process group pipeline gradients cross in, apart from the activations' (the
        default group), with ``gradient_group``: made at the first plan."""
        self.last_switch: dict[str, Any] = {}

    # -- layers ---------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._specs)

    @property
    def held_layers(self) -> dict[int, nn.Module]:
        return dict(self._held)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """float16's dynamic loss scaler (None for other dtypes)."""
        return self._scaler

    def _tied_names(self, layer: int) -> set[str]:
        return {name for t in self._tie_of.get(layer, ()) for name in self.ties[t].names_in(layer)}

    def _install(self, layer: int, state: dict[str, Any] | None = None) -> None:
        """Hold ``layer``: its module, moved here, with an optimizer over its untied parameters."""
        spec = self._specs[layer]
        module = build_layer(spec, self.seed, layer)
        if module is not spec:
            self._refuse_hidden_ties(layer, module)
        module.to(device=self.device)
        if self.precision.param_dtype is not None:
            cast_floating(module, self.precision.param_dtype)
        tied = {id(module.get_parameter(n)) for n in self._tied_names(layer)}
        # Frozen parameters are left out: no optimizer steps them, and a layer of only frozen
        # ones (a distillation teacher) gets none, where the common factory
        # ``Adam(p for p in params if p.requires_grad)`` raised on an empty list.
        params = [p for p in module.parameters() if id(p) not in tied and p.requires_grad]
        optim = self._opt_factory(params) if params else None
        if state is not None:
            missing, unexpected = module.load_state_dict(state["module"], strict=False)
            if unexpected or set(missing) - self._tied_names(layer):
                raise ValueError(f"layer {layer}: the saved state does not fit the module "
                                 f"(missing {missing}, unexpected {unexpected})")
            if optim is not None and state.get("optim") is not None:
                optim.load_state_dict(state["optim"])
            load_nonpersistent(module, state.get("nonpersistent") or {})
        self._held[layer] = module
        self._optims[layer] = optim

    def _refuse_hidden_ties(self, layer: int, module: nn.Module) -> None:
        others = {id(p) for at, m in self._held.items() if at != layer for p in m.parameters()}
        if any(id(p) in others for p in module.parameters()):
            raise ValueError(f"layer {layer}: its factory returned a module sharing a parameter "
                             "with another layer; pass tied layers as modules, not factories")

    def _layer_state(self, layer: int) -> dict[str, Any]:
        """The layer's module and optimizer state, without tied parameters (moved once, apart)."""
        optim = self._optims[layer]
        tied = self._tied_names(layer)
        return {
            "module": {k: v for k, v in self._held[layer].state_dict().items() if k not in tied},
            "optim": optim.state_dict() if optim is not None else None,
            "nonpersistent": nonpersistent_buffers(self._held[layer]),
        }

    def _install_tie(self, t: int, state: dict[str, Any] | None = None) -> None:
        """Hold tie ``t`` (a layer of it is held here): its value and its own optimizer."""
        param = tie_param(self.ties[t], self._held)
        optim = self._opt_factory([param]) if param.requires_grad else None
        if state is not None:
            with torch.no_grad():
                param.copy_(state["param"])
            if optim is not None and state.get("optim") is not None:
                optim.load_state_dict(state["optim"])
        self._tie_optims[t] = optim

    def _tie_state(self, t: int) -> dict[str, Any]:
        return {
            "keys": list(self.ties[t].keys),
            "param": tie_param(self.ties[t], self._held).detach(),
            "optim": optim.state_dict() if (optim := self._tie_optims[t]) is not None else None,
        }

    def _tie_holders(self, owners: list[list[int]], t: int) -> list[int]:
        return sorted({r for layer in self.ties[t].layers for r in owners[layer]})

    def _ckpt_tie_state(self, t: int) -> dict[str, Any] | None:
        """Tie ``t`` from the checkpoint being resumed (None: keep the module's own value)."""
        if self._ckpt_dir is None:
            return None
        from . import checkpoint as ckpt

        state: dict[str, Any] = ckpt.read_file(self._ckpt_dir, ckpt.tied_file(t),
                                               map_location=self.device)
        return state

    def _send_state(self, state: dict[str, Any], dst: int) -> int:
        buf = io.BytesIO()
        torch.save(state, buf)
        wire = wire_device(self.device)  # host memory under gloo on CUDA
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(wire)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=wire), dst=dst)
        dist.send(data, dst=dst)
        return data.numel()

    def _recv_state(self, src: int) -> dict[str, Any]:
        wire = wire_device(self.device)  # host memory under gloo on CUDA
        size = torch.zeros(1, dtype=torch.int64, device=wire)
        dist.recv(size, src=src)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
        dist.recv(data, src=src)
        state: dict[str, Any] = torch.load(
            io.BytesIO(data.cpu().numpy().tobytes()), map_location=self.device, weights_only=True
        )
        return state

    # -- plans ----------------------------------------------------------------

    def _new_owners(self, plan: Plan) -> list[list[int]]:
        owners: list[list[int]] = [[] for _ in self._specs]
        for group in plan.groups:
            for stage in group.stages:
                for layer in range(*stage.layers):
                    owners[layer].append(self.rank_of[stage.device])
        return owners

    def _poll(self, slot_s: float = 0.0, slot_started: float = 0.0) -> tuple[Any, bool]:
        """Collective, once per iteration: rank 0 polls its source (and, with ``slot_s``,
        reads the slot's clock); every rank gets ``((version, plan dict) | None, slot over)``.

        Cheap when nothing changed: one broadcast of two integers; the plan itself is
        broadcast only when there is a new version."""
        found: PlanVersion | None = None
        over = False
        if self.rank == 0:
            if self.source is not None:
                if hasattr(self.source, "epoch"):
                    self.source.epoch = self.epoch
                if hasattr(self.source, "step"):
                    self.source.step = self.step
                # before the first plan (or after a resume) any version is taken
                after = self.version if self.plan is not None else 0
                found = self.source.poll(max(after, self._refused_version))
            over = slot_s > 0 and time.perf_counter() - slot_started >= slot_s
        flags = torch.tensor([found.version if found is not None else 0, int(over)],
                             dtype=torch.int64, device=self.device)
        dist.broadcast(flags, src=0)
        version, over_flag = (int(v) for v in flags.tolist())
        if version <= 0:
            return None, bool(over_flag)
        box: list[Any] = [plan_to_dict(found.plan) if found is not None else None]
        dist.broadcast_object_list(box, src=0)
        return (version, box[0]), bool(over_flag)

    def _take(self, payload: tuple[int, dict[str, Any]] | None) -> bool:
        """Switch to a polled plan; a refused one is skipped (``keep_plan_on_refusal``)."""
        if payload is None:
            return False
        version, data = payload
        try:
            self.switch(plan_from_dict(data), version)
        except ValidationError as exc:  # raised before anything moved, the same on every rank
            if not self.keep_plan_on_refusal:
                raise
            self._refused_version = max(self._refused_version, version)
            self.refused.append((version, str(exc)))
            if self.rank == 0:
                log.warning("plan version %d refused, keeping version %d: %s",
                            version, self.version, exc)
            return False
        return True

    def poll_plan(self) -> bool:
        """Rank 0 polls its source, all ranks take its answer; switch if there is a new plan."""
        payload, _ = self._poll()
        return self._take(payload)

    def switch(self, plan: Plan, version: int | None = None) -> dict[str, Any]:
        """Take ``plan`` at this iteration boundary (every rank calls this with the same plan).

        Raises InvalidPlanError (same on every rank) before anything moves.
        """
        orders = check_plan(plan, self.device_ids, self.num_layers, self.global_batch)
        started = time.perf_counter()
        new = self._new_owners(plan)
        moved = 0
        for layer, (old, now) in enumerate(zip(self._owners, new, strict=True)):
            if not old:  # nobody holds it yet: build it (seeded) or load it from a checkpoint
                if self.rank in now:
                    self._install(layer, self._ckpt_state(layer))
                continue
            for dst in now:
                if dst in old:
                    continue
                if self.rank == old[0]:
                    moved += self._send_state(self._layer_state(layer), dst)
                elif self.rank == dst:
                    self._install(layer, self._recv_state(old[0]))
        for t in range(len(self.ties)):  # after the layers: a tie needs one of its layers here
            was, now = self._tie_holders(self._owners, t), self._tie_holders(new, t)
            for dst in now:
                if dst in was:
                    continue
                if not was:
                    if self.rank == dst:
                        self._install_tie(t, self._ckpt_tie_state(t))
                elif self.rank == was[0]:
                    moved += self._send_state(self._tie_state(t), dst)
                elif self.rank == dst:
                    self._install_tie(t, self._recv_state(was[0]))
            if self.rank in was and self.rank not in now:
                del self._tie_optims[t]
        for layer in list(self._held):
            if self.rank not in new[layer]:
                del self._held[layer]
                del self._optims[layer]
        self._owners = new
        self._ckpt_dir = None
        move_s = time.perf_counter() - started
        self._rebuild(plan, orders)
        self.plan = plan
        self.version = self.version + 1 if version is None else version
        dist.barrier()
        self.last_switch = {
            "version": self.version,
            "bytes_sent": moved,
            "move_s": move_s,
            "total_s": time.perf_counter() - started,
            "step": self.step,
            "unix_s": time.time(),
        }
        return self.last_switch

    def _rebuild(self, plan: Plan, orders: list[list[tuple[tuple[bool, int], ...]]]) -> None:
        if self._gradsync is not None:
            self._gradsync.close()
            self._gradsync = None
        for pg in self._groups_made:
            dist.destroy_process_group(pg)
        self._groups_made, self._buckets, self._tie_groups = [], [], []
        self._runner, self._role, self._ops = None, None, ()
        made: dict[tuple[int, ...], Any] = {}
        if self.gradient_group and self._grad_group is None and self.world > 1:  # every rank
            self._grad_group = dist.new_group(ranks=list(range(self.world)))
        # buckets of spec 5.3: maximal runs of layers with the same owner tuple
        if len(plan.groups) > 1:
            layer = 0
            while layer < self.num_layers:
                owners = tuple(self._owners[layer])
                end = layer
                while end < self.num_layers and tuple(self._owners[end]) == owners:
                    end += 1
                key = tuple(sorted(owners))
                if key not in made:  # every rank calls new_group, in the same order
                    made[key] = dist.new_group(ranks=list(key))
                    self._groups_made.append(made[key])
                if self.rank in owners:
                    self._buckets.append((layer, end, made[key]))
                layer = end
        for t in range(len(self.ties)):  # every rank creates the same groups in the same order
            key = tuple(self._tie_holders(self._owners, t))
            if len(key) < 2:
                continue
            if key not in made:
                made[key] = dist.new_group(ranks=list(key))
                self._groups_made.append(made[key])
            if self.rank in key:
                self._tie_groups.append((t, made[key]))
        for gi, group in enumerate(plan.groups):
            for si, stage in enumerate(group.stages):
                if self.rank_of[stage.device] != self.rank:
                    continue
                self._role = (gi, si)
                self._ops = orders[gi][si]
                n = len(group.stages)
                fwd_t, bwd_t = self._targets(plan.microbatch_size, stage.layers, stage.recompute)
                self._runner = StageRunner(
                    [self._held[layer] for layer in range(*stage.layers)],
                    prev_rank=self.rank_of[group.stages[si - 1].device] if si > 0 else None,
                    next_rank=self.rank_of[group.stages[si + 1].device] if si + 1 < n else None,
                    recompute=stage.recompute,
                    loss_fn=self._loss_fn,
                    loss_scale=plan.microbatch_size / self.global_batch,
                    precision=self.precision,
                    device=self.device,
                    slowdown=self.slowdown,
                    fwd_target_s=fwd_t,
                    bwd_target_s=bwd_t,
                    recv_order=[k for bwd, k in orders[gi][si - 1] if not bwd] if si > 0 else None,
                    grad_order=[k for bwd, k in orders[gi][si + 1] if bwd] if si + 1 < n else None,
                    grad_group=self._grad_group,
                )
        if self._runner is not None:
            self._gradsync = GradSync(
                [Bucket(self._untied_params(first, end), pg, f"layers {first}-{end - 1}")
                 for first, end, pg in self._buckets],
                [(tie_param(self.ties[t], self._held), pg) for t, pg in self._tie_groups],
                bucket_cap_mb=self.bucket_cap_mb, overlap=self.overlap_sync,
                min_seconds=self._emulated_allreduce if self._emu is not None else None)
            self._runner.before_last_backward = self._gradsync.arm

    def _targets(self, m: int, layers: tuple[int, int], recompute: bool) -> tuple[float, float]:
        """EMULATION (target-time): spec 5.1's F_j and B_j on a device of ``emulate_tflops``."""
        if self.emulate_tflops is None:
            return 0.0, 0.0
        a, b = layers
        scale = m / (1000.0 * self.emulate_tflops)
        fwd = scale * sum(g[0] for g in self._layer_gflop[a:b])
        bwd = scale * sum(g[1] for g in self._layer_gflop[a:b])
        return fwd, bwd + (fwd if recompute else 0.0)

    # -- iterations -------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order, kept for the epoch: drawing it for every iteration
        cost a ``randperm`` of the whole data set per iteration (about 10 ms for a million
        samples, on every rank's critical path)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order_cache = (epoch, torch.randperm(len(self.dataset), generator=gen))
        return self._order_cache[1]

    def batch_indices(self, epoch: int, iteration: int) -> list[int]:
        """Dataset indices of one global batch; independent of the plan."""
        b = self.global_batch
        return self._epoch_order(epoch)[iteration * b : (iteration + 1) * b].tolist()

    @staticmethod
    def _collate(dataset: Any, indices: Sequence[int], which: int, seed: int = 0,
                 epoch: int = 0) -> Any:
        """Inputs (``which`` 0) or targets (1) of ``indices``, batched as a DataLoader would
        (``default_collate``: tensors stacked, numbers to tensors, tuples and dicts kept);
        dtypes are the dataset's (the stage casts floating leaves when ``dtype`` is set).
        Items are read by :func:`read_items` (random augmentation seeded per item).

        A ``TensorDataset`` is gathered with one ``index_select`` per tensor instead: the
        same rows stacked, without a Python call per sample (0.48 against 0.08 ms for 128
        rows of 512 floats; per microbatch, on the pipeline's critical path). Not
        ``tensor[index]``, which runs in parallel: for 8 rows of 512 token ids on a 16-core
        H100 host it took 32 us against ``index_select``'s 6 us in a loop, and 1.5 ms a call
        in a profiled GPT-2 iteration."""
        if type(dataset) is TensorDataset and len(indices):
            return dataset.tensors[which].index_select(
                0, torch.as_tensor(indices, dtype=torch.long))
        return default_collate(read_items(dataset, indices, which, seed, epoch))

    def train_step(self) -> tuple[StageStats | None, float]:
        """One iteration of the current plan; returns this rank's stage stats and wall time."""
        if self.plan is None:
            raise RuntimeError("no plan yet: call switch() or poll_plan() first")
        self._apply_emulation()
        started = time.perf_counter()
        stats = None
        step = True
        if self._runner is not None and self._role is not None:
            gi, _ = self._role
            m = self.plan.microbatch_size
            offset = sum(g.samples for g in self.plan.groups[:gi])
            mine = self.batch_indices(self.epoch, self.iteration)[
                offset : offset + self.plan.groups[gi].samples
            ]
            buffers_before = self._snapshot_replica_buffers()
            if self._scaler is not None:
                self._runner.grad_scale = self._scaler.scale
            first_layer = self.plan.groups[gi].stages[self._role[1]].layers[0]
            self._runner.rng_seed = functools.partial(
                microbatch_seed, self.seed, self.epoch, self.iteration, gi, first_layer)
            stats, loss = self._runner.run(
                self._ops,
                lambda k: self._collate(self.dataset, mine[k * m : (k + 1) * m], 0,
                                        self.seed, self.epoch),
                lambda k: self._collate(self.dataset, mine[k * m : (k + 1) * m], 1,
                                        self.seed, self.epoch),
            )
            self._loss_sum += loss
            assert self._gradsync is not None
            sync = self._gradsync.finish()
            stats.sync_s = sync.exposed_s
            stats.sync_bytes += sync.bucket_bytes
            stats.sync_early_bytes += sync.launched_in_backward * sync.bucket_bytes
            if self._scaler is not None:
                step = self._scaler.update(self._grads(), self.device)
            optims = self._all_optims()
            if step:
                self._optim_step.step(optims)
            self._optim_step.zero_grad(optims)
            self._gradsync.zero_grad()  # the synced gradients live on in its buffers
            self._reconcile_buffers(buffers_before)
        elif self._scaler is not None:  # an idle rank still takes part in the overflow vote
            self._scaler.update([], self.device)
        self.iteration += 1
        self.step += 1
        return stats, time.perf_counter() - started

    def _all_optims(self) -> list[torch.optim.Optimizer]:
        return [o for o in [*self._optims.values(), *self._tie_optims.values()] if o is not None]

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for o in self._all_optims() for group in o.param_groups
                for p in group["params"] if p.grad is not None]

    def _apply_emulation(self) -> None:
        """EMULATED: take this rank's device speed from the emulation file, if it changed."""
        if self._emu is None:
            return
        tflops = self._emu.state().devices.get(self.device_id)
        if tflops is None or tflops == self.emulate_tflops:
            return
        self.emulate_tflops = tflops
        if self._runner is not None and self._role is not None and self.plan is not None:
            gi, si = self._role
            stage = self.plan.groups[gi].stages[si]
            self._runner.fwd_target_s, self._runner.bwd_target_s = self._targets(
                self.plan.microbatch_size, stage.layers, stage.recompute)

    def _untied_params(self, first: int, end: int) -> list[nn.Parameter]:
        tied = {id(tie_param(self.ties[t], self._held)) for t in self._tie_optims}
        return [p for layer in range(first, end) for p in self._held[layer].parameters()
                if id(p) not in tied]

    def _snapshot_replica_buffers(self) -> list[list[torch.Tensor]]:
        return [snapshot_buffers([self._held[la] for la in range(first, end)])
                for first, end, _ in self._buckets]

    def _reconcile_buffers(self, before: list[list[torch.Tensor]]) -> None:
        """Replicas' buffers after the step, by the rule of :mod:`hetpilot.trainer.replicas`."""
        if self.plan is None or self._role is None:
            return
        share = self.plan.groups[self._role[0]].samples / self.global_batch
        for (first, end, pg), saved in zip(self._buckets, before, strict=True):
            if saved:
                reconcile_buffers([self._held[la] for la in range(first, end)], saved, share, pg)

    def _emulated_allreduce(self, bucket: int, nbytes: int) -> float | None:
        """EMULATED links: spec 5.3's all-reduce time of ``nbytes`` over a bucket's hosts."""
        assert self._emu is not None
        first = self._buckets[bucket][0]
        hosts = [self.device_ids[r].rpartition(":")[0] for r in self._owners[first]]
        return allreduce_s(nbytes, hosts, self._emu.state())

    def train_epoch(self, max_iterations: int | None = None) -> dict[str, Any]:
        """Run the rest of the current epoch (or ``max_iterations`` of it) on the current
        plan, without polling; report one record; advance the epoch when it ended."""
        slot = _Slot()
        while self.iteration < self.iterations_per_epoch:
            if max_iterations is not None and slot.steps >= max_iterations:
                break
            slot.add(self.train_step()[0])
        return self._close(slot, "epoch" if self.iteration >= self.iterations_per_epoch
                           else "iterations")

    def _close(self, slot: _Slot, why: str) -> dict[str, Any]:
        """Collective: the record of ``slot`` (loss summed over last stages, evaluation at an
        epoch's end), reported; the epoch advances when it ended."""
        wall = time.perf_counter() - slot.started
        record = self._record(slot.total, slot.steps, wall)
        record["closed_by"] = why
        record["unix_s"] = time.time()
        if slot.switch_s is not None:
            record["switch_s"] = slot.switch_s
        ended = self.iteration >= self.iterations_per_epoch
        evaluated = self._evaluate() if ended and self.metric is not None else 0.0
        # on the device: NCCL reduces nothing else ("No backend type associated with device
        # type cpu", the first GPU run's one failure)
        sums = torch.tensor([self._loss_sum, evaluated], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # last stages and group 0's last stage
        self._loss_sum = 0.0
        record["loss"] = float(sums[0]) / slot.steps if slot.steps else None
        if ended and self.metric is not None:
            record["eval_metric"] = float(sums[1]) / len(self.eval_dataset)
        if ended:
            self.epoch += 1
            self.iteration = 0
        if self._scaler is not None:
            record["loss_scale"] = self._scaler.scale
            record["skipped_steps"] = self._scaler.skipped
        if self.report_from_rank0:
            records: list[Any] = [None] * self.world
            dist.all_gather_object(records, record)
            if self.rank == 0 and self.reporter is not None:
                for rec in records:
                    self.reporter(rec)
        elif self.reporter is not None:
            self.reporter(record)
        return record

    def _evaluate(self) -> float:
        """Group 0 runs the held-out set forward; its last stage returns the weighted sum."""
        if self._runner is None or self._role is None or self._role[0] != 0:
            return 0.0
        assert self.plan is not None and self.metric is not None
        m, n = self.plan.microbatch_size, len(self.eval_dataset)
        sizes = [min(m, n - start) for start in range(0, n, m)]

        def batch(k: int, which: int) -> Any:
            return self._collate(self.eval_dataset, range(k * m, k * m + sizes[k]), which,
                                 self.seed, EVAL_EPOCH)

        return self._runner.evaluate(sizes, lambda k: batch(k, 0), lambda k: batch(k, 1),
                                     self.metric)

    def _record(self, total: StageStats, steps: int, wall: float) -> dict[str, Any]:
        per_mb = max(total.microbatches, 1)
        record: dict[str, Any] = {
            "rank": self.rank,
            "device_id": self.device_id,
            "plan_version": self.version,
            "epoch": self.epoch,
            "iterations": steps,
            "step": self.step,
            "group": None if self._role is None else self._role[0],
            "group_samples": None if self._role is None or self.plan is None
            else self.plan.groups[self._role[0]].samples,
            "stage": None if self._role is None else self._role[1],
            "fwd_s": total.fwd_s / per_mb,
            "bwd_s": total.bwd_s / per_mb,
            "transfer_wait_s": total.wait_s / max(steps, 1),
            "sync_s": total.sync_s / max(steps, 1),
            "sync_overlap": total.sync_early_bytes / total.sync_bytes if total.sync_bytes
            else None,
            "iteration_s": wall / max(steps, 1),
            "samples_per_s": self.global_batch * steps / wall if wall > 0 else 0.0,
        }
        if self.slowdown != 1.0:
            record["emulated_slowdown"] = self.slowdown
        if self.emulate_tflops is not None:
            record["emulated_tflops"] = self.emulate_tflops
        return record

    def fit(
        self,
        epochs: int,
        *,
        max_steps: int | None = None,
        slot_iterations: int = 0,
        slot_s: float = 0.0,
        on_record: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Train until ``epochs`` epochs (or ``max_steps`` optimizer steps in all) are done.

        Before **every iteration** rank 0 polls the plan source and every rank takes
        its answer, so a new plan runs from the next iteration on, mid-epoch, on the
        same data position (no sample skipped or repeated). A record (reported, and
        passed to ``on_record``) closes each slot: ``slot_iterations`` iterations,
        ``slot_s`` seconds (rank 0's clock, broadcast), the end of an epoch, or a plan
        switch (a record covers one plan); with neither setting a slot is an epoch.
        """
        if slot_iterations < 0 or slot_s < 0:
            raise ValueError("slot_iterations and slot_s must be >= 0")
        records: list[dict[str, Any]] = []

        def close(slot: _Slot, why: str) -> None:
            records.append(self._close(slot, why))
            if on_record is not None:
                on_record(records[-1])

        slot: _Slot | None = None
        while self.epoch < epochs and (max_steps is None or self.step < max_steps):
            payload, timed_out = self._poll(slot_s, slot.started if slot else 0.0)
            if slot is not None and slot.steps and (payload is not None or timed_out):
                close(slot, "switch" if payload is not None else "seconds")
                slot = None
            switched = self._take(payload)
            if self.plan is None:
                why = self.refused[-1][1] if self.refused else "the plan source gave no plan"
                raise NoPlanError(why)
            if slot is None:
                slot = _Slot()
                if switched:
                    slot.switch_s = float(self.last_switch["total_s"])
            slot.add(self.train_step()[0])
            if self.iteration >= self.iterations_per_epoch:
                close(slot, "epoch")
                slot = None
            elif slot_iterations and slot.steps >= slot_iterations:
                close(slot, "iterations")
                slot = None
        if slot is not None and slot.steps:
            close(slot, "steps")
        return records

    # -- checkpoints ------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path, keep: int = 2,
                        extra: dict[str, Any] | None = None) -> None:
        """Save atomically into ``directory`` (one all ranks see; every rank calls this).
        ``extra``: more entries for ``meta.json`` (rank 0's; the model's tensor names).

        Layout and crash safety: :mod:`hetpilot.trainer.checkpoint`. Rank 0 opens
        a fresh staging directory; each layer's owner in group 0 writes the layer,
        each tie's first holder the tie; rank 0 then writes the position, commits
        (``step-NNNNNNNN``, ``latest``) and keeps the newest ``keep`` commits.
        A failure on any rank raises on every rank, the previous commit intact.
        """
        from . import checkpoint as ckpt

        if self.plan is None:
            raise RuntimeError("nothing to save before the first plan")
        plan, root, step = self.plan, Path(directory), self.step
        staging = ckpt.staging_dir(root, step)

        def write() -> None:
            for stage in plan.groups[0].stages:
                if self.rank_of[stage.device] == self.rank:
                    for layer in range(*stage.layers):
                        ckpt.write_file(staging, ckpt.layer_file(layer), self._layer_state(layer))
            for t in range(len(self.ties)):
                if self._tie_holders(self._owners, t)[:1] == [self.rank]:
                    ckpt.write_file(staging, ckpt.tied_file(t), self._tie_state(t))

        meta = {
            "epoch": self.epoch,
            "iteration": self.iteration,
            "step": step,
            "plan_version": self.version,
            "num_layers": self.num_layers,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "plan": plan_to_dict(plan),
        }
        if self._scaler is not None:
            meta["loss_scaler"] = self._scaler.state_dict()
        meta.update({k: v for k, v in (extra or {}).items() if k not in meta})
        self._ckpt_phase(root, lambda: ckpt.begin_save(root, step) if self.rank == 0 else None)
        self._ckpt_phase(root, write)
        self._ckpt_phase(root, lambda: ckpt.commit(root, step, meta, keep)
                         if self.rank == 0 else None)

    def _ckpt_phase(self, root: Path, work: Callable[[], Any]) -> None:
        """Run this rank's part of a save phase; then, as a barrier, learn every rank's
        outcome, so that all ranks raise (and none waits forever) if one failed."""
        error: str | None = None
        try:
            work()
        except Exception as exc:  # reported to every rank, raised below
            error = f"{type(exc).__name__}: {exc}"
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise OSError(f"checkpoint {str(root)!r} not saved: "
                          + "; ".join(f"rank {r}: {e}" for r, e in failed))

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Resume from ``directory`` (its ``latest`` commit, or a legacy flat checkpoint:
        :func:`hetpilot.trainer.checkpoint.resolve`), under any plan and world size.

        Before the first plan: the next :meth:`switch` loads each layer on its
        new owners. After it: held layers are reloaded now (every rank calls this).
        """
        from . import checkpoint as ckpt

        path = ckpt.resolve(directory)
        if path is None:
            raise FileNotFoundError(f"no checkpoint in {str(directory)!r}")
        meta: dict[str, Any] = ckpt.read_meta(path)
        if meta["num_layers"] != self.num_layers or meta["global_batch"] != self.global_batch:
            raise ValueError(
                f"checkpoint {str(path)!r} is of {meta['num_layers']} layers and batch "
                f"{meta['global_batch']}, not {self.num_layers} and {self.global_batch}"
            )
        self.epoch, self.iteration, self.step = meta["epoch"], meta["iteration"], meta["step"]
        self.version = meta["plan_version"]
        if self._scaler is not None and "loss_scaler" in meta:
            self._scaler.load_state_dict(meta["loss_scaler"])
        self._ckpt_dir = path
        if self.plan is None:
            self._held.clear()
            self._optims.clear()
            self._tie_optims.clear()
            self._owners = [[] for _ in self._specs]
        else:
            for layer in list(self._held):
                self._install(layer, self._ckpt_state(layer))
            for t in list(self._tie_optims):  # after the layers: the tie lives in them
                self._install_tie(t, self._ckpt_tie_state(t))
            assert self.plan is not None
            self._rebuild(self.plan, check_plan(self.plan, self.device_ids, self.num_layers,
                                                self.global_batch))
            self._ckpt_dir = None
        dist.barrier()
        return meta

    def _ckpt_state(self, layer: int) -> dict[str, Any] | None:
        if self._ckpt_dir is None:
            return None
        from . import checkpoint as ckpt

        state: dict[str, Any] = ckpt.read_file(self._ckpt_dir, ckpt.layer_file(layer),
                                               map_location=self.device)
        return state
