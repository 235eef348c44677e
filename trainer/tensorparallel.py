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

Dropout modules (``nn.Dropout`` and its kin) that see a sharded activation (after a
column-parallel submodule) draw the FULL-shape mask, as one process draws it, and apply
this rank's slice (:class:`FullMaskDropout`), so a split stage trains exactly like one
process.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FullMaskDropout", "full_tensors", "matched", "parallelize", "shard_like",
           "shared_parameters", "split_problem"]

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
    probe = _meta_copy(module) if _dropouts(module) else None
    split = parallelize_module(module, mesh, plan)  # type: ignore[arg-type]
    if probe is not None:
        _full_mask_dropouts(split, probe, mesh.get_local_rank(), mesh.size())
    return split


def _dropouts(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if n and isinstance(m, _DropoutNd)]


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module`` unsplit on the meta device (no memory): run to learn full shapes."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


class _Shapes:
    """The full input shape of each dropout in one unsplit forward of the layer, in call
    order, learnt once per input shape by running the layer's meta copy (no RNG drawn)."""

    def __init__(self, probe: nn.Module, names: list[str]) -> None:
        self.probe = probe
        self.names = names
        self.cache: dict[tuple[Any, ...], dict[str, list[torch.Size]]] = {}
        self.current: dict[str, list[torch.Size]] = {}
        self.calls: dict[str, int] = {}

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> None:
        """Forward pre-hook of the split layer: the full shapes for this input."""
        from torch.utils import _pytree as pytree

        self.calls = {}
        if not module.training:
            self.current = {}
            return
        leaves = pytree.tree_leaves((args, kwargs))
        key = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                    for t in leaves)
        if key not in self.cache:
            self.cache[key] = self._probe(args, kwargs)
        self.current = self.cache[key]

    def _probe(self, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> dict[str, list[torch.Size]]:
        from torch.utils import _pytree as pytree

        seen: dict[str, list[torch.Size]] = {n: [] for n in self.names}
        hooks = [self.probe.get_submodule(n).register_forward_pre_hook(
            lambda _m, a, n=n: seen[n].append(a[0].shape)) for n in self.names]
        meta = pytree.tree_map(
            lambda t: t.detach().to("meta") if isinstance(t, torch.Tensor) else t,
            (args, kwargs))
        self.probe.train()
        try:
            with torch.no_grad():
                self.probe(*meta[0], **meta[1])
        finally:
            for h in hooks:
                h.remove()
        return seen

    def full(self, name: str) -> torch.Size | None:
        shapes = self.current.get(name)
        i = self.calls.get(name, 0)
        self.calls[name] = i + 1
        return shapes[i] if shapes is not None and i < len(shapes) else None


class FullMaskDropout(nn.Module):
    """A dropout of a split layer: on a shard (its input's shape is the unsplit forward's
    with one dim ``1/degree`` as long) it runs the dropout on the full shape, this rank's
    values at its slice and zeros elsewhere, and keeps the slice, so the mask is drawn
    from the same generator state with the same shape as in one process, and each rank
    applies its own part of it; on a whole (replicated) input it is the dropout itself."""

    def __init__(self, inner: nn.Module, name: str, shapes: _Shapes, rank: int,
                 degree: int) -> None:
        super().__init__()
        self.inner = inner
        self.name = name
        self.shapes = shapes
        self.rank = rank
        self.degree = degree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.shapes.full(self.name) if self.training else None
        if full is None or tuple(full) == tuple(x.shape):
            return self.inner(x)
        dims = [d for d in range(x.dim()) if x.shape[d] != full[d]]
        if len(full) != x.dim() or len(dims) != 1 or x.shape[dims[0]] * self.degree != full[
                dims[0]]:
            raise RuntimeError(
                f"dropout {self.name!r} of a split layer sees shape {tuple(x.shape)}, not "
                f"the unsplit {tuple(full)} cut {self.degree} ways along one dim")
        d, n = dims[0], x.shape[dims[0]]
        start = self.rank * n

        def zeros(k: int) -> torch.Tensor:
            shape = list(x.shape)
            shape[d] = k
            return x.new_zeros(shape)

        whole = torch.cat([zeros(start), x, zeros(full[d] - start - n)], d)
        return self.inner(whole).narrow(d, start, n)


def _full_mask_dropouts(split: nn.Module, probe: nn.Module, rank: int, degree: int) -> None:
    """Wrap each dropout of ``split`` in a :class:`FullMaskDropout` (in place)."""
    names = _dropouts(split)
    shapes = _Shapes(probe, names)
    split.register_forward_pre_hook(shapes.before, with_kwargs=True)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = split.get_submodule(parent_name) if parent_name else split
        setattr(parent, child, FullMaskDropout(getattr(parent, child), name, shapes, rank,
                                               degree))


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
        drawn_whole, drawn_part = _RandomOps(), _RandomOps()
        try:
            with drawn_whole:
                whole = _without_dropouts(copy.deepcopy(layer))(x)
        except Exception as exc:  # the preflight reports the unsplit forward's own errors
            return f"its forward raised {type(exc).__name__}: {exc}"
        local = _without_dropouts(_local_copy(layer, styles, degree))
        try:
            with drawn_part:
                part = local(x)
        except Exception as exc:
            return (f"its forward cannot run split {degree} ways ({type(exc).__name__}: "
                    f"{exc}); a reshape with a fixed head or feature count needs -1 there, "
                    "and each colwise submodule's output a rowwise one consuming it")
    if drawn_part.ops != drawn_whole.ops:
        op = next((p for p, w in zip(drawn_part.ops, drawn_whole.ops, strict=False) if p != w),
                  (drawn_part.ops or drawn_whole.ops)[-1])
        return (f"dropout inside a split region: its forward draws random numbers "
                f"(aten.{op[0]}) on an activation split {degree} ways, which one process "
                "draws whole (functional dropout, e.g. scaled_dot_product_attention's "
                "dropout_p > 0 in training); use an nn.Dropout module there, whose mask a "
                "split stage draws whole, or p = 0")
    got, want = _shapes(part), _shapes(whole)
    if got != want:
        return (f"split {degree} ways its output has shapes {got}, not {want}: the "
                "plan leaves a column-parallel output unreduced (pair each colwise with a "
                "rowwise after it)")
    return None


_RANDOM = {"bernoulli", "bernoulli_", "native_dropout", "rand", "randn", "rand_like",
           "randn_like", "randint", "randint_like", "normal", "normal_", "uniform_",
           "exponential_", "multinomial", "randperm", "cauchy_", "log_normal_", "geometric_",
           "random_"}
"""aten ops that draw from a generator."""


class _RandomOps(TorchDispatchMode):
    """Records (op, input shapes) of each random op a forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = str(getattr(func, "__name__", func)).split(".")[0]
        if name in _RANDOM:
            self.ops.append((name, _shapes(args)))
        return func(*args, **(kwargs or {}))


def _without_dropouts(layer: nn.Module) -> nn.Module:
    """``layer`` (a copy) with its dropout modules replaced by identities: a split stage
    draws their masks whole (:class:`FullMaskDropout`), so they never differ."""
    for name in _dropouts(layer):
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, child, nn.Identity())
    return layer


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
