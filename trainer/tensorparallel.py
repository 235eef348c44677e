"""Tensor-parallel stages: a job's ``tp_plan`` applied to one layer on a stage's device mesh.

A ``tp_plan`` maps fnmatch patterns of submodule names, relative to each layer (as Hugging
Face's ``base_model_tp_plan`` and torchtitan's parallelize plans name them), to
``"colwise"`` or ``"rowwise"``. Every layer of a tensor-parallel stage gets
:func:`torch.distributed.tensor.parallel.parallelize_module` with torch's
``ColwiseParallel`` / ``RowwiseParallel`` for its matching submodules (Megatron's split:
a column-parallel linear's output stays sharded, the row-parallel linear after it
all-reduces, so the layer's output is replicated on every rank of the stage). A layer
with no matching submodule is replicated: each rank of the stage runs it whole.

Between plans every layer is held whole (plain tensors): :meth:`Holdings.shard
<hetpilot.trainer.handoff.Holdings.shard>` splits a layer when a plan's stage needs it
split, :meth:`~hetpilot.trainer.handoff.Holdings.unshard` gathers it back (full tensors,
``DTensor.full_tensor``) before a switch or a checkpoint, so hand-offs, checkpoints and
export never see a shard.

Tied parameters are never split (a submodule holding one is replicated), since the tie's
value lives in two layers that may sit on different stages.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["full_tensors", "matched", "parallelize", "shard_like", "shared_parameters",
           "split_problem"]

_SPLITTABLE = (nn.Linear, nn.Embedding)
"""The module kinds torch's ColwiseParallel and RowwiseParallel split."""


def matched(module: nn.Module, tp_plan: Mapping[str, str],
            keep_whole: Iterable[int] = ()) -> dict[str, str]:
    """Submodule name -> style for the submodules of ``module`` the plan splits (the first
    pattern that matches a name wins). Submodules holding a parameter whose id is in
    ``keep_whole`` (a tie) are left whole."""
    whole = set(keep_whole)
    out: dict[str, str] = {}
    for name, sub in module.named_modules():
        if not name:
            continue
        style = next((s for p, s in tp_plan.items() if fnmatch.fnmatchcase(name, p)), None)
        if style is None:
            continue
        if any(id(p) in whole for p in sub.parameters(recurse=False)):
            continue
        out[name] = style
    return out


def shared_parameters(modules: Iterable[nn.Module]) -> set[int]:
    """ids of the parameters two of ``modules`` hold (ties: never split)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for module in modules:
        for p in {id(q) for q in module.parameters()}:
            (shared if p in seen else seen).add(p)
    return shared


def parallelize(module: nn.Module, mesh: Any, styles: Mapping[str, str]) -> nn.Module:
    """Collective-free: ``module`` split over ``mesh`` as ``styles`` says (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: kinds[style]() for name, style in styles.items()}
    return parallelize_module(module, mesh, plan)  # type: ignore[arg-type]


def full_tensors(value: Any) -> Any:
    """Collective over each DTensor's mesh: ``value`` (a tensor, or dicts/lists of them) with
    every DTensor replaced by its full tensor (a plain tensor), in a fixed traversal order."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().detach()
    if isinstance(value, dict):
        return {k: full_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [full_tensors(v) for v in value]
    if isinstance(value, tuple):
        return tuple(full_tensors(v) for v in value)
    return value


def shard_like(value: torch.Tensor, param: Any) -> Any:
    """``value`` (a full tensor of ``param``'s shape) split as the DTensor ``param`` is;
    each rank keeps its own slice, nothing is sent (every rank holds the same value)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or tuple(value.shape) != tuple(param.shape):
        return value
    return distribute_tensor(value.detach(), param.device_mesh, param.placements,
                             src_data_rank=None)


def split_problem(layer: nn.Module, x: Any, styles: Mapping[str, str], degree: int
                  ) -> str | None:
    """Why ``layer`` cannot run split ``degree`` ways (None: it can), found in one process by
    running the forward on ``x`` as one rank of the split runs it: each column-parallel
    submodule with 1/degree of its outputs, each row-parallel one with 1/degree of its
    inputs (the all-reduce after it changes values, not shapes). A reshape that fixes a
    head count fails there as it would on the ranks."""
    for name, style in styles.items():
        sub = layer.get_submodule(name)
        if not isinstance(sub, _SPLITTABLE):
            return (f"tp_plan splits {name!r} {style}, a {type(sub).__name__}; torch's "
                    "ColwiseParallel/RowwiseParallel split nn.Linear and nn.Embedding only")
        size = _split_size(sub, style)
        if size % degree:
            return (f"{name!r} ({type(sub).__name__}) has {size} "
                    f"{'outputs' if style == 'colwise' else 'inputs'}, not divisible by "
                    f"{degree}")
    with torch.no_grad():
        try:
            whole = copy.deepcopy(layer)(x)
        except Exception as exc:  # the preflight reports the unsplit forward's own errors
            return f"its forward raised {type(exc).__name__}: {exc}"
        local = _local_copy(layer, styles, degree)
        try:
            part = local(x)
        except Exception as exc:
            return (f"its forward cannot run split {degree} ways ({type(exc).__name__}: "
                    f"{exc}); a reshape with a fixed head or feature count needs -1 there, "
                    "and each colwise submodule's output a rowwise one consuming it")
    got, want = _shapes(part), _shapes(whole)
    if got != want:
        return (f"split {degree} ways its output has shapes {got}, not {want}: the "
                "plan leaves a column-parallel output unreduced (pair each colwise with a "
                "rowwise after it)")
    return None


def _split_size(sub: nn.Module, style: str) -> int:
    if isinstance(sub, nn.Linear):
        return sub.out_features if style == "colwise" else sub.in_features
    assert isinstance(sub, nn.Embedding)
    return sub.embedding_dim if style == "colwise" else sub.num_embeddings


def _local_copy(layer: nn.Module, styles: Mapping[str, str], degree: int) -> nn.Module:
    """A copy of ``layer`` whose split submodules hold one rank's slice (the first)."""
    local = copy.deepcopy(layer)
    for name, style in styles.items():
        parent_name, _, child = name.rpartition(".")
        parent = local.get_submodule(parent_name) if parent_name else local
        sub = getattr(parent, child)
        if isinstance(sub, nn.Linear):
            w = sub.weight.detach()
            if style == "colwise":
                n = sub.out_features // degree
                new = nn.Linear(sub.in_features, n, bias=sub.bias is not None,
                                dtype=w.dtype, device=w.device)
                new.weight.data.copy_(w[:n])
                if sub.bias is not None:
                    new.bias.data.copy_(sub.bias.detach()[:n])
            else:
                n = sub.in_features // degree
                new = nn.Linear(n, sub.out_features, bias=sub.bias is not None,
                                dtype=w.dtype, device=w.device)
                new.weight.data.copy_(w[:, :n])
                if sub.bias is not None:
                    new.bias.data.copy_(sub.bias.detach())
            setattr(parent, child, new)
        elif isinstance(sub, nn.Embedding) and style == "colwise":
            n = sub.embedding_dim // degree
            emb = nn.Embedding(sub.num_embeddings, n, dtype=sub.weight.dtype,
                               device=sub.weight.device)
            emb.weight.data.copy_(sub.weight.detach()[:, :n])
            setattr(parent, child, emb)
        # a row-parallel embedding keeps its output shape: left whole here
    return local


def _shapes(value: Any) -> list[tuple[int, ...]]:
    from torch.utils import _pytree as pytree

    return [tuple(t.shape) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
