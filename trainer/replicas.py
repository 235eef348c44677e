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
rule, the same on every rank (:func:`merge_buffer` states it on plain
tensors; the reference applies it so). With ``b0`` the value before the
iteration, ``b_g`` group g's value after it and ``w_g`` its share of the
batch:

* floating (and complex) elements become ``b0 + sum_g w_g * (b_g - b0)``, the sample-weighted
  mean of the groups' values, exact for elements no group changed; where
  ``b0`` is not finite (a causal mask's ``-inf``, an observer's ``min_val``
  before its first input) ``sum_g w_g * b_g``, since ``inf - inf`` would make
  the element NaN;
* an integer buffer that no group made smaller is a counter
  (``num_batches_tracked``, a step count): ``b0 + sum_g (b_g - b0)`` counts
  every microbatch seen; one that some group made smaller is a value (a
  quantizer's ``zero_point``): the sample-weighted mean of the groups' values,
  rounded (a sum of its moves left the quantizer's range).

``SyncBatchNorm`` is not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Tie", "find_ties", "full_state", "hidden_reference", "load_nonpersistent",
           "merge_buffer", "nonpersistent_buffers", "reconcile_buffers", "snapshot_buffers",
           "tie_param"]


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


def hidden_reference(specs: Sequence[Any]) -> str | None:
    """How a module layer reaches another layer's parameters outside its registered
    submodules and parameters (a module kept in a Python list or dict attribute, so that
    ``parameters()`` does not list it twice: a tied head holding the embedding so), or
    None. Ties are found on registered parameters only; through such a reference the
    layer would use its rank's stale copy of the other layer's parameter and its gradient
    would be lost."""
    owner: dict[int, int] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, nn.Module):
            for q in spec.parameters():
                owner.setdefault(id(q), i)
    for i, spec in enumerate(specs):
        if not isinstance(spec, nn.Module):
            continue
        own = {id(q) for q in spec.parameters()}
        for prefix, sub in spec.named_modules():
            for attr, value in vars(sub).items():
                if attr in ("_parameters", "_buffers", "_modules"):  # registered: seen
                    continue
                items = (value.values() if isinstance(value, dict)
                         else value if isinstance(value, (list, tuple)) else ())
                for item in items:
                    held = (list(item.parameters()) if isinstance(item, nn.Module)
                            else [item] if isinstance(item, nn.Parameter) else [])
                    for q in held:
                        other = owner.get(id(q))
                        if id(q) not in own and other is not None and other != i:
                            where = f"{prefix}.{attr}" if prefix else attr
                            return (f"item {i} ({type(spec).__name__}) reaches parameters of "
                                    f"item {other} through the Python attribute '{where}' (a "
                                    "module kept in a list or dict): the ranks see no tie "
                                    "there, so it would use a stale copy and lose its "
                                    "gradient; register it (self.emb = emb, or share the "
                                    "nn.Parameter) so that the layers are tied")
    return None


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


def merge_buffer(b0: torch.Tensor, values: Sequence[torch.Tensor],
                 weights: Sequence[float]) -> torch.Tensor:
    """The replica rule (module docstring) for one floating or integer buffer: its value
    before the iteration, each group's after it, and each group's share of the batch."""
    if b0.is_floating_point() or b0.is_complex():
        finite = torch.isfinite(b0)
        moved = sum(w * torch.where(finite, v - b0, v) for v, w in zip(values, weights,
                                                                        strict=True))
        return torch.where(finite, b0 + moved, moved).to(b0.dtype)
    if all(bool((v >= b0).all()) for v in values):
        return b0 + sum(v - b0 for v in values)
    mean = sum((w * v.double() for v, w in zip(values, weights, strict=True)),
               torch.zeros(b0.shape, dtype=torch.float64, device=b0.device))
    return torch.round(mean).to(b0.dtype)


def reconcile_buffers(
    modules: Sequence[nn.Module], before: Sequence[torch.Tensor], weight: float, group: Any
) -> None:
    """Apply the replica rule (module docstring) to ``modules``' buffers over ``group``;
    ``weight`` is this rank's group's share of the batch. All-reduces: the floating moves
    (or values, where ``b0`` is not finite), one per dtype; with integer buffers, whether
    each fell anywhere (MAX), then the counters' moves, one per dtype, and the other
    integer buffers' weighted values."""
    buffers = [b for m in modules for b in m.buffers()]
    if not buffers:
        return
    floats = [(b, b0) for b, b0 in zip(buffers, before, strict=True)
              if b.is_floating_point() or b.is_complex()]
    ints = [(b, b0) for b, b0 in zip(buffers, before, strict=True)
            if not b.is_floating_point() and not b.is_complex() and b.dtype != torch.bool]
    with torch.no_grad():
        for same in _by_dtype(floats):
            finite = [torch.isfinite(b0) for _, b0 in same]
            flat = torch.cat([torch.where(f, b - b0, b).reshape(-1)
                              for (b, b0), f in zip(same, finite, strict=True)]).mul_(weight)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            for (b, b0), f, moved in zip(same, finite, _split(flat, same), strict=True):
                b.copy_(torch.where(f, b0 + moved, moved))
        if not ints:
            return
        fell = torch.stack([(b < b0).any() for b, b0 in ints]).double()  # on their device: NCCL
        dist.all_reduce(fell, op=dist.ReduceOp.MAX, group=group)
        counters = [(b, b0) for (b, b0), f in zip(ints, fell.tolist(), strict=True) if not f]
        values = [(b, b0) for (b, b0), f in zip(ints, fell.tolist(), strict=True) if f]
        for same in _by_dtype(counters):
            flat = torch.cat([(b - b0).reshape(-1) for b, b0 in same])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            for (b, b0), moved in zip(same, _split(flat, same), strict=True):
                b.copy_(b0 + moved)
        if values:
            flat = torch.cat([b.double().reshape(-1) for b, _ in values]).mul_(weight)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            for (b, _), mean in zip(values, _split(flat, values), strict=True):
                b.copy_(torch.round(mean))


def _by_dtype(pairs: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    out: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for b, b0 in pairs:
        out.setdefault(b.dtype, []).append((b, b0))
    return list(out.values())


def _split(flat: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]
           ) -> list[torch.Tensor]:
    """``flat`` cut back into the shapes of ``pairs``' buffers."""
    out, pos = [], 0
    for b, _ in pairs:
        out.append(flat[pos : pos + b.numel()].view_as(b))
        pos += b.numel()
    return out
