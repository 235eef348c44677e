"""Pre-flight refusals of an optimizer the runtime cannot step one layer at a time.

The runtime gives each layer (and each tied parameter) an optimizer of its own, built by
the job's factory, so that a layer moves to another rank with its state. On copies of the
layers, :func:`checked_step` steps the job's optimizer with the gradients in each form the
runtime may hand them, and refuses (``optimizer``) a step that fails on them, a step that
couples the layers (one optimizer over all of them steps to other values than one per
layer: a gradient-norm clip over all its parameters), and state kept outside the
optimizer's ``state_dict`` (by which it moves with its layer).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["COUPLED_TOLERANCE", "OnJobParameters", "checked_step"]


class OnJobParameters:
    """The job's optimizer factory as preflight calls it: on the job's own parameters, then
    pointed at the copies preflight steps. The ranks and train-check's reference hand the
    factory the job's own parameters, so a factory choosing parameter groups by identity
    (``p is emb.weight``) works there; called on copies, it put every parameter in the
    other group, and preflight refused valid jobs (an SGD group without weight decay for a
    sparse embedding: 'add(sparse, dense) is not supported')."""

    def __init__(self, factory: Any, origin: dict[int, tuple[nn.Parameter, nn.Parameter]]
                 ) -> None:
        self.factory = factory
        self.origin = origin

    def _original(self, p: nn.Parameter) -> nn.Parameter:
        held = self.origin.get(id(p))
        return held[1] if held is not None else p

    def __call__(self, params: Sequence[nn.Parameter]) -> Any:
        originals = [self._original(p) for p in params]
        optim = self.factory(originals)
        back = {id(o): p for o, p in zip(originals, params, strict=True)}
        for group in optim.param_groups:
            group["params"] = [back.get(id(q), q) for q in group["params"]]
        # and in the optimizer's own attributes: a wrapper clipping the gradient norm over
        # the list it was given (``self.params``) clipped the originals, which have no
        # gradients here, so its coupling went unseen and it was not refused
        _repoint(optim, back, depth=2)
        return optim

    def dense_copies(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """:func:`_dense_copies`, each copy mapped to its parameter's original."""
        out = _dense_copies(params)
        for p, q in zip(params, out, strict=True):
            self.origin[id(q)] = (q, self._original(p))
        return out


def _repoint(obj: Any, back: dict[int, nn.Parameter], depth: int) -> None:
    """Point the parameters an optimizer keeps in its attributes (lists, tuples, dicts of
    them; an optimizer it wraps, ``depth`` levels down) at their copies in ``back`` (by
    the original's id). Lists and dicts change in place, so what shares them still does."""
    def mapped(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return back.get(id(value), value)
        if isinstance(value, list):
            value[:] = [mapped(v) for v in value]
        elif isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(mapped(v) for v in value)
        elif isinstance(value, dict):
            for k in list(value):
                value[k] = mapped(value[k])
        elif depth > 0 and isinstance(value, torch.optim.Optimizer):
            for group in value.param_groups:  # a wrapped optimizer steps its own groups
                group["params"] = [back.get(id(q), q) for q in group["params"]]
            _repoint(value, back, depth - 1)
        return value

    try:
        attributes = list(vars(obj).items())
    except TypeError:  # no __dict__
        return
    for name, value in attributes:
        if name in ("param_groups", "state", "defaults") or name.startswith("__"):
            continue
        new = mapped(value)
        if new is not value:
            object.__setattr__(obj, name, new)


def checked_step(layers: Sequence[nn.Module], loss: torch.Tensor, factory: OnJobParameters,
          bad: Any) -> None:
    """The backward, then each layer's optimizer (over its parameters not already given to
    an earlier layer's, as the runtime builds them) steps on the copies with the gradients
    in each form the runtime may hand them: a sparse embedding gradient as the backward
    leaves it (one group: Adam refuses it), then dense (several groups: the sync sums it
    into a dense buffer, which SparseAdam refuses)."""
    if not loss.requires_grad:
        return
    try:
        loss.backward()
    except RuntimeError as exc:  # e.g. an in-place op on what the backward needs
        raise bad("layers", f"the backward of one microbatch failed, as it would in one "
                            f"process: {type(exc).__name__}: {exc}") from exc
    refuse_coupled_steps(layers, factory, bad)
    refuse_state_outside_state_dict(layers, factory, bad)
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        params = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        params = [p for p in params if p.requires_grad]  # as the runtime: frozen ones left out
        if not params:
            continue
        forms = ["dense"]
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            forms.insert(0, "sparse")  # as the backward leaves them: plans of one group
        for form in forms:
            if form == "dense":
                for p in params:
                    if p.grad is not None and p.grad.is_sparse:
                        p.grad = p.grad.to_dense()
            try:
                optim = factory(params)  # held: a scheduler's step wrapper holds it weakly
                optim.step()
            except Exception as exc:
                how = ("sparse, as the backward leaves them under a plan of one data-parallel "
                       "group" if form == "sparse" else "dense, summed over replicas")
                hint = ("; a sparse embedding needs an optimizer taking both sparse and dense "
                        "gradients (SGD, Adagrad), or sparse=False" if len(forms) > 1 else "")
                if "closure" in str(exc).lower():
                    hint += ("; the runtime calls step() without a closure, as its layers' "
                             "forwards run on other ranks: optimizers re-evaluating the loss "
                             "(LBFGS, SAM) are not supported")
                raise bad("optimizer", f"its step failed on item {i}'s ({type(layer).__name__}) "
                                       f"gradients as the runtime hands them ({how}): "
                                       f"{type(exc).__name__}: {exc}{hint}") from exc


COUPLED_TOLERANCE = 1e-6
"""Relative difference (to the largest change) between one optimizer over all the layers'
parameters and one per layer, above which the optimizer is not taken for per-layer."""


def refuse_coupled_steps(layers: Sequence[nn.Module], factory: OnJobParameters,
                          bad: Any) -> None:
    """An optimizer whose step on one layer's parameters depends on other layers' gradients
    (a wrapper clipping the gradient norm over all its parameters, a norm or trust ratio
    taken over the whole model): the runtime gives each layer (and each tied parameter) an
    optimizer of its own, as the layers sit on different ranks, so that such a step would
    train other values than the one optimizer over the model the job means. Seen on copies
    of the parameters and gradients (dense), one step over all of them against one step per
    layer (the parameter lists as in :func:`checked_step`). A factory failing here is left to
    :func:`checked_step`."""
    lists: list[list[nn.Parameter]] = []
    items: list[int] = []
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        params = [p for p in layer.parameters() if id(p) not in seen and p.grad is not None]
        seen.update(id(p) for p in layer.parameters())
        if params:
            lists.append(params)
            items.append(i)
    if len(lists) < 2:
        return

    together = [factory.dense_copies(params) for params in lists]
    apart = [factory.dense_copies(params) for params in lists]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optim = factory([q for qs in together for q in qs])
            optim.step()
            for qs in apart:
                optim = factory(qs)
                optim.step()
    except Exception:  # checked_step says what fails
        return
    moved = diff = 0.0
    where = ""
    for i, params, a, b in zip(items, lists, together, apart, strict=True):
        for p, u, v in zip(params, a, b, strict=True):
            if u.numel() == 0 or not (u.is_floating_point() or u.is_complex()):
                continue
            moved = max(moved, float((u.detach() - p.detach()).abs().max()))
            d = float((u.detach() - v.detach()).abs().max())
            if d > diff:
                diff, where = d, f"item {i} ({type(layers[i]).__name__})"
    if diff > COUPLED_TOLERANCE * max(moved, 1e-30) and diff > 0.0:
        raise bad("optimizer", "one optimizer over all the layers' parameters steps them to "
                               "other values than one optimizer per layer does (largest "
                               f"difference {diff:.3g}, {where}, against a largest change of "
                               f"{moved:.3g}): its step couples parameters of different "
                               "layers (a gradient-norm clip or a norm taken over all its "
                               "parameters), or the factory builds another optimizer (or "
                               "settings) depending on which parameters it is given, and "
                               "the runtime gives each layer an optimizer "
                               "of its own, as layers sit on different ranks; clip or "
                               "normalise per parameter or per layer, or use an element-wise "
                               "optimizer (SGD, Adam, AdamW, ...)")


def _dense_copies(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """Leaf copies of ``params`` with copies of their gradients (dense)."""
    out = []
    for p in params:
        q = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        assert p.grad is not None
        q.grad = (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach().clone()
        out.append(q)
    return out


def refuse_state_outside_state_dict(layers: Sequence[nn.Module], factory: OnJobParameters,
                                     bad: Any) -> None:
    """An optimizer keeping state its ``state_dict`` does not hold (a step count in a
    Python attribute driving an lr warm-up): a layer's optimizer moves to another rank by
    its ``state_dict`` when a plan switch moves the layer (and a checkpoint holds that
    only), so such state would restart there. Seen on copies of the first layer's
    parameters with gradients: after two steps, one more step of the optimizer against one
    of a fresh optimizer given its ``state_dict``. A factory failing here is left to
    :func:`checked_step`."""
    params = next(([p for p in layer.parameters() if p.grad is not None]
                   for layer in layers if any(p.grad is not None for p in layer.parameters())),
                  [])
    if not params:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ran = factory.dense_copies(params)
            optim = factory(ran)
            optim.step()
            optim.step()
            moved = factory.dense_copies(ran)
            fresh = factory(moved)
            fresh.load_state_dict(copy.deepcopy(optim.state_dict()))
            optim.step()
            fresh.step()
    except Exception:  # checked_step says what fails
        return
    diff = max((float((a.detach() - b.detach()).abs().max()) for a, b in
                zip(ran, moved, strict=True) if a.numel() and a.is_floating_point()),
               default=0.0)
    change = max((float((a.detach() - p.detach()).abs().max()) for a, p in
                  zip(ran, params, strict=True) if a.numel() and a.is_floating_point()),
                 default=0.0)
    if diff > COUPLED_TOLERANCE * max(change, 1e-30):
        raise bad("optimizer", f"{type(optim).__name__} steps otherwise after a fresh one "
                               "is given its state_dict (largest difference "
                               f"{diff:.3g}, against a change of {change:.3g}): it keeps state "
                               "outside its state_dict (a step count in a Python attribute), "
                               "which is lost when a plan switch moves a layer and its "
                               "optimizer to another rank, or at a checkpoint; keep it in "
                               "self.state or param_groups (torch's lr schedulers step "
                               "param_groups' 'lr'), or return it from state_dict")
    # A scheduler stepped from a hook sets the next step's lr after this one: the
    # parameters agree, but its count restarted in the fresh one (LambdaLR's lr parts).
    try:
        drift = numbers_apart(optim.state_dict(), fresh.state_dict())
    except Exception:  # a state_dict that fails here fails where it is used
        drift = None
    if drift is not None:
        raise bad("optimizer", f"{type(optim).__name__}'s state_dict {drift} parts after a "
                               "step from a fresh one given its state_dict: it keeps state "
                               "outside its state_dict (a learning-rate scheduler stepped "
                               "from a hook counts its own steps), which is lost when a plan "
                               "switch moves a layer and its optimizer to another rank, or at "
                               "a checkpoint; keep the schedule in param_groups or "
                               "self.state, or return the scheduler's state from state_dict")


def numbers_apart(ours: Any, theirs: Any, where: str = "") -> str | None:
    """Where two state_dicts first hold numbers apart (a relative difference above 1e-9;
    ``['param_groups'][0]['lr']``), or None. Tensors are left to the parameters' check.
    Read from ``state_dict()``, not ``param_groups``: a wrapper holding a scheduler may keep
    a ``param_groups`` attribute that loading leaves stale."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in ours:
            if key in theirs:
                found = numbers_apart(ours[key], theirs[key], f"{where}[{key!r}]")
                if found is not None:
                    return found
    elif isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)):
        for i, (u, v) in enumerate(zip(ours, theirs, strict=False)):
            found = numbers_apart(u, v, f"{where}[{i}]")
            if found is not None:
                return found
    elif isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) \
            and not isinstance(ours, bool) and not isinstance(theirs, bool) \
            and abs(ours - theirs) > 1e-9 * max(abs(ours), abs(theirs), 1e-30):
        return where
    return None
