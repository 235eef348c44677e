"""The model's layers as the runtime takes them: built from a module or a factory, copied,
and a loss module placed beside them.

A layer is an ``nn.Module`` or a zero-argument factory of one; a factory is called under a
per-layer seed (:func:`layer_seed`) so that every rank builds the same weights without
sending them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .precision import cast_floating

__all__ = ["LayerSpec", "OptimizerFactory", "build_layer", "copy_layers", "layer_seed",
           "place_loss"]

LayerSpec = nn.Module | Callable[[], nn.Module]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


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
