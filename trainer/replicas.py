"""Keeping copies equal: parameters tied between layers, and buffers of data-parallel replicas.

**Tied parameters.** A parameter shared by identity between layers (GPT-2's
token embedding and output head) is one parameter. When its layers land on
different stages, each stage's rank holds a copy, and the copies stay equal
the way Megatron keeps its word embeddings equal: every iteration the
gradient of the tied parameter is summed over every rank that holds any of
its layers (each rank's local gradient already sums its own layers' uses, in
every group), and each of those ranks steps it with its own optimizer state,
which is therefore identical too. The tie has its own optimizer on each
holder (the layers' optimizers leave it out), moves once when its holders
change, and is checkpointed once (``tiedNNNNN.pt``).

Ties are found on layers given as modules (every rank builds the same modules,
so every rank finds the same ties; the runtime checks that). Layers given as
factories are built separately and cannot share parameters: the runtime refuses
a factory whose module shares a parameter with another layer.

**Buffers of replicas.** Layers held by several data-parallel groups are
replicas; their buffers (BatchNorm's running statistics) drift apart as each
group sees other samples. After every iteration they are reconciled by one
rule, the same on every rank: with ``b0`` the value before the iteration and
``b_g`` group g's value after it, floating buffers become
``b0 + sum_g (samples_g / B) * (b_g - b0)`` (the sample-weighted mean of the
groups' values, exact for buffers no group changed), integer buffers
``b0 + sum_g (b_g - b0)`` (``num_batches_tracked`` counts every microbatch
seen). ``SyncBatchNorm`` is not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Tie", "find_ties", "full_state", "load_nonpersistent", "nonpersistent_buffers",
           "reconcile_buffers", "snapshot_buffers", "tie_param"]


@dataclass(frozen=True)
class Tie:
    """One parameter used by several layers: ``(layer, name in that layer)`` for each use."""

    uses: tuple[tuple[int, str], ...]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.uses}))

    @property
    def keys(self) -> tuple[str, ...]:
        """Its keys in ``nn.Sequential(*layers).state_dict()``."""
        return tuple(f"{layer}.{name}" for layer, name in self.uses)

    def names_in(self, layer: int) -> list[str]:
        return [name for at, name in self.uses if at == layer]


def find_ties(specs: Sequence[Any]) -> list[Tie]:
    """Parameters shared by identity between two or more of the module layers, in layer order."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for layer, spec in enumerate(specs):
        if not isinstance(spec, nn.Module):
            continue
        for name, param in spec.named_parameters(remove_duplicate=False):
            seen.setdefault(id(param), []).append((layer, name))
    return [Tie(tuple(uses)) for uses in seen.values() if len({u[0] for u in uses}) > 1]


def tie_param(tie: Tie, held: dict[int, nn.Module]) -> nn.Parameter:
    """The tied parameter as this rank holds it (any held layer of the tie)."""
    for layer, name in tie.uses:
        if layer in held:
            param = held[layer].get_parameter(name)
            assert isinstance(param, nn.Parameter)
            return param
    raise KeyError(f"no layer of the tie {tie.keys} is held here")


def nonpersistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict`` leaves out (``register_buffer(..., persistent=False)``),
    by their dotted names. A forward may update them (a running mean it reads): a layer
    moving to another rank takes them along, as it takes its ``state_dict``."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for name in sorted(sub._non_persistent_buffers_set):
            buf = sub._buffers.get(name)
            if buf is not None:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def load_nonpersistent(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put :func:`nonpersistent_buffers` values back (in place where the shape fits)."""
    with torch.no_grad():
        for key, value in values.items():
            prefix, _, name = key.rpartition(".")
            sub = module.get_submodule(prefix) if prefix else module
            buf = sub._buffers.get(name)
            if buf is not None and buf.shape == value.shape:
                buf.copy_(value)
            else:
                sub._buffers[name] = value.to(buf.device if buf is not None else value.device)


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` plus the non-persistent buffers: what train-check compares."""
    return {**module.state_dict(), **nonpersistent_buffers(module)}


def snapshot_buffers(modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [b.detach().clone() for m in modules for b in m.buffers()]


def reconcile_buffers(
    modules: Sequence[nn.Module], before: Sequence[torch.Tensor], weight: float, group: Any
) -> None:
    """Apply the replica rule (module docstring) to ``modules``' buffers over ``group``;
    ``weight`` is this rank's group's share of the batch."""
    buffers = [b for m in modules for b in m.buffers()]
    if not buffers:
        return
    floats = [(b, b0) for b, b0 in zip(buffers, before, strict=True) if b.is_floating_point()]
    ints = [(b, b0) for b, b0 in zip(buffers, before, strict=True)
            if not b.is_floating_point() and not b.is_complex() and b.dtype != torch.bool]
    with torch.no_grad():
        for pairs, scale in ((floats, weight), (ints, None)):
            if not pairs:
                continue
            by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for b, b0 in pairs:
                by_dtype.setdefault(b.dtype, []).append((b, b0))
            for same in by_dtype.values():
                flat = torch.cat([(b - b0).reshape(-1) for b, b0 in same])
                if scale is not None:
                    flat.mul_(scale)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                pos = 0
                for b, b0 in same:
                    n = b.numel()
                    b.copy_(b0 + flat[pos : pos + n].view_as(b))
                    pos += n
