"""What a plan's training must equal: the same steps taken by one process, in float64.

The reference is what a user would write in one process: one optimizer over
the model's parameters (tied ones once), and each iteration's global batch
cut into the plan's microbatches, their mean-reduced losses scaled by
``m / B`` and their gradients accumulated. The runtime must reproduce it to
rounding, whatever the plan: groups, uneven samples, cuts, schedules,
recompute, live switches.

Two things depend on the plan by design and are reproduced here, not
ignored: the order in which each stage runs its forwards (BatchNorm's running
statistics are updated in that order), and the replica rule for buffers
after each iteration (:mod:`hetpilot.trainer.replicas`): every group starts
from the same buffers, and the groups' results are merged by samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hetpilot.planner.types import Plan
from torch import nn
from torch.utils.data import default_collate

from .activations import map_tensors
from .itemseed import read_items
from .layers import build_layer, place_loss
from .pipeline import loss_problem, microbatch_seed, seeded
from .plans import check_plan
from .precision import Precision, cast_floating
from .replicas import full_state, merge_buffer

__all__ = ["ReferenceRun", "build_layers"]


def build_layers(specs: Sequence[Any], seed: int, dtype: torch.dtype | None) -> list[nn.Module]:
    """The layers as the runtime builds them (:func:`~hetpilot.trainer.layers.build_layer`):
    modules as given, factories under ``layer_seed``; floating state cast to ``dtype``."""
    out = []
    for layer, spec in enumerate(specs):
        module = build_layer(spec, seed, layer)
        if dtype is not None:
            cast_floating(module, dtype)
        out.append(module)
    return out


def _unique_params(layers: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for layer in layers:
        for p in layer.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _buffers(layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [b for layer in layers for b in layer.buffers()]


@dataclass
class ReferenceRun:
    """One process stepping ``layers`` through plans, iteration by iteration, like the runtime."""

    layers: list[nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    dataset: Any
    global_batch: int
    seed: int = 0
    dtype: torch.dtype | None = torch.float64
    epoch: int = 0
    iteration: int = 0
    losses: list[float] = field(default_factory=list)
    """Mean loss of each iteration (the sum of its scaled microbatch losses)."""
    compute_dtype: torch.dtype | None = None
    """Mixed precision as the runtime runs it: forwards under autocast, floating
    outputs cast to this dtype at the plan's cuts; None: plain ``dtype``."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the layers, the data and the random draws are (the ranks' device, so that the
    same kernels run); :meth:`states` are on the CPU wherever this is."""

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        for layer in self.layers:  # before the optimizer: it holds the parameters it is given
            layer.to(device=self.device)
        self.loss_fn = place_loss(self.loss_fn, self.device, self.dtype)  # as the runtime does
        self._optim = self.optimizer(_unique_params(self.layers))
        self._precision = (Precision(torch.float32, self.compute_dtype)
                           if self.compute_dtype is not None else Precision())
        self._per_epoch = len(self.dataset) // self.global_batch

    def _cast(self, value: Any) -> Any:
        dtype = self.dtype
        if dtype is None:
            return value
        return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, value)

    def _batch(self, indices: Sequence[int], which: int) -> Any:
        batch = self._cast(default_collate(read_items(self.dataset, indices, which, self.seed,
                                                      self.epoch)))
        if self.device.type == "cpu":
            return batch
        return map_tensors(lambda t: t.to(self.device), batch)

    def indices(self) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(len(self.dataset), generator=gen)
        b = self.global_batch
        return perm[self.iteration * b : (self.iteration + 1) * b].tolist()

    def step(self, plan: Plan, apply: bool = True, scale: float = 1.0) -> float:
        """One iteration under ``plan``; returns its mean loss. ``apply=False``: the
        gradients are dropped instead of stepped (a float16 step the loss scaler skipped);
        ``scale``: float16's loss scale, taken out of the gradients before the step."""
        devices = sorted({d for g in plan.groups for s in g.stages for d in s.devices})
        orders = check_plan(plan, devices, len(self.layers), self.global_batch,
                            tensor_parallel=True)  # one process runs a split stage whole
        batch = self.indices()
        m, b = plan.microbatch_size, self.global_batch
        buffers = _buffers(self.layers)
        start = [t.detach().clone() for t in buffers]
        ends: list[list[torch.Tensor]] = []
        loss_total = 0.0
        offset = 0
        for gi, group in enumerate(plan.groups):
            with torch.no_grad():
                for t, value in zip(buffers, start, strict=True):
                    t.copy_(value)
            mine = batch[offset : offset + group.samples]
            offset += group.samples
            micro = group.samples // m
            acts = {k: self._batch(mine[k * m : (k + 1) * m], 0) for k in range(micro)}
            for si, stage in enumerate(group.stages):
                for is_bwd, k in orders[gi][si]:
                    if is_bwd:
                        continue
                    x = acts[k]
                    draws = microbatch_seed(self.seed, self.epoch, self.iteration, gi,
                                            stage.layers[0], k)
                    with seeded(draws, self.device), self._precision.autocast(self.device):
                        for layer in range(*stage.layers):
                            x = self.layers[layer](x)
                    if si + 1 < len(group.stages):
                        x = map_tensors(self._precision.wire, x)
                    acts[k] = x
            for k in range(micro):
                target = self._batch(mine[k * m : (k + 1) * m], 1)
                with self._precision.autocast(self.device):
                    loss = self.loss_fn(acts[k], target)
                if (problem := loss_problem(loss)) is not None:
                    raise ValueError(f"loss: {problem}")
                loss = loss * (m / b)
                loss_total += float(loss.detach())
                if loss.requires_grad:
                    (loss * scale if scale != 1.0 else loss).backward()
            ends.append([t.detach().clone() for t in buffers])
        with torch.no_grad():
            for i, t in enumerate(buffers):
                if len(plan.groups) == 1:
                    continue  # one group: nothing to merge (the runtime merges nothing either)
                if t.dtype != torch.bool:  # floating, complex and integer: the rule's
                    t.copy_(merge_buffer(start[i], [end[i] for end in ends],
                                         [g.samples / b for g in plan.groups]))
        if apply:
            if scale != 1.0:
                for p in _unique_params(self.layers):
                    if p.grad is not None:
                        p.grad.mul_(1.0 / scale)
            self._optim.step()
        self._optim.zero_grad(set_to_none=True)
        self.iteration += 1
        if self.iteration >= self._per_epoch:
            self.epoch, self.iteration = self.epoch + 1, 0
        self.losses.append(loss_total)
        return loss_total

    def states(self) -> list[dict[str, torch.Tensor]]:
        """Each layer's ``state_dict`` (parameters and buffers) and non-persistent buffers,
        detached copies on the CPU."""
        return [{k: v.detach().to("cpu", copy=True) for k, v in full_state(layer).items()}
                for layer in self.layers]
