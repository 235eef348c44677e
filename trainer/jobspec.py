"""The job function a user points hetpilot at (``--model`` / ``--job MODULE:FN``).

It returns a dict: ``layers`` (modules or zero-argument factories; each layer
is called with the previous layer's output, any pytree), ``loss`` (mean over a
microbatch, ``loss(output, target)``), ``optimizer`` (a factory over a
parameter list), ``dataset`` (map-style, item ``(input, target)``),
``global_batch``; optionally ``sample`` (one microbatch of inputs, for
profiling; ``hetpilot train`` takes the dataset's first items without it), ``eval_dataset`` and ``metric`` (evaluation at each epoch's end),
``microbatch_size`` (train-check's choice), ``model`` (the module whose
tensors the layers hold: checkpoints then record their names in it). Every rank calls it, so it must
build the same model and data on every rank (seed it).

This module imports no torch: the CLI loads jobs with it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from hetpilot.planner.errors import ValidationError

__all__ = ["TP_STYLES", "TRAIN_KEYS", "check_tp_plan", "load_job"]

TRAIN_KEYS = ("layers", "loss", "optimizer", "dataset", "global_batch")
OPTIONAL_KEYS = ("microbatch_size", "sample", "eval_dataset", "metric", "model", "tp_plan")
"""The other keys a job function's dict may have (docs/trainer.md)."""

HINTS = {
    "scheduler": "have the optimizer factory return an optimizer whose step() also steps "
                 "the scheduler and whose state_dict() holds both states, as layers move "
                 "between ranks with their optimizer's state_dict (docs/trainer.md, "
                 "'Optimizer')",
}
"""Why a key that users reach for is not one, and what to do instead."""


TP_STYLES = ("colwise", "rowwise")
"""The values a ``tp_plan`` entry may take (:mod:`hetpilot.trainer.tensorparallel`)."""


def check_tp_plan(tp_plan: Any, field: str) -> dict[str, str]:
    """``tp_plan`` as a dict of pattern -> style; ValueError naming ``field`` when malformed."""
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise ValueError(f"{field}: must be a non-empty dict of submodule-name pattern -> "
                         f"'colwise' or 'rowwise', got {type(tp_plan).__name__}")
    out: dict[str, str] = {}
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{field}: a key {pattern!r} is not a submodule-name pattern")
        if style not in TP_STYLES:
            raise ValueError(f"{field}[{pattern!r}]: must be 'colwise' or 'rowwise', "
                             f"got {style!r}")
        out[pattern] = style
    return out


def load_job(target: str, field: str, required: Sequence[str] = TRAIN_KEYS) -> dict[str, Any]:
    """Call ``MODULE:FN`` (importable from the working directory too, as with ``python -m``);
    raise :class:`ValidationError` naming ``field`` when it cannot be loaded, lacks a key, or
    a key's value cannot be used (naming the key too)."""
    module_name, _, fn_name = target.partition(":")
    if not module_name or not fn_name:
        raise ValidationError(field, f"must be MODULE:FN, got {target!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValidationError(field, f"cannot load {target!r}: {exc}") from exc
    try:
        spec = fn()
    except Exception as exc:  # the user's code: one line naming where it raised
        frames = traceback.extract_tb(exc.__traceback__)
        at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        raise ValidationError(field, f"{target}() raised {type(exc).__name__}: {exc}{at}") \
            from exc
    if not isinstance(spec, dict):
        raise ValidationError(field, f"{target}() must return a dict, got {type(spec).__name__}")
    missing = [k for k in required if k not in spec]
    if missing:
        raise ValidationError(field, f"{target}() returned no {', '.join(map(repr, missing))}")
    _check_keys(spec, f"{field}: {target}()")
    _check_values(spec, f"{field}: {target}()")
    return spec


def _check_keys(spec: dict[str, Any], where: str) -> None:
    """A key the trainer does not read is refused, naming it: a misspelt
    ``micro_batch_size`` or a ``scheduler`` would otherwise be ignored without a word."""
    known = (*TRAIN_KEYS, *OPTIONAL_KEYS)
    for key in spec:
        if key in known:
            continue
        name = key if isinstance(key, str) else repr(key)
        hint = HINTS.get(name.removeprefix("lr_").rstrip("s"))  # lr_scheduler, schedulers
        if hint is None:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else \
                f"the keys are {', '.join(known)}"
        raise ValidationError(f"{where}['{name}']",
                              f"is not a key the trainer reads, so it would be ignored; {hint}")


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_values(spec: dict[str, Any], where: str) -> None:
    """The keys that are there have usable values; the error names the key."""
    def bad(key: str, problem: str) -> ValidationError:
        return ValidationError(f"{where}['{key}']", problem)

    if (spec.get("eval_dataset") is None) != (spec.get("metric") is None):
        raise bad("eval_dataset" if spec.get("metric") is None else "metric",
                  "eval_dataset and metric go together: give both or neither")
    if spec.get("tp_plan") is not None:
        try:
            check_tp_plan(spec["tp_plan"], "tp_plan")
        except ValueError as exc:
            raise bad("tp_plan", str(exc).removeprefix("tp_plan: ")) from exc
    if spec.get("metric") is not None and not callable(spec["metric"]):
        raise bad("metric", f"must be a function (output, target) -> number, got "
                            f"{type(spec['metric']).__name__}")
    if "layers" in spec:
        layers = spec["layers"]
        if isinstance(layers, (str, bytes, dict)) or not hasattr(layers, "__len__") \
                or not hasattr(layers, "__getitem__"):
            raise bad("layers", f"must be a list of modules or factories, got "
                                f"{type(layers).__name__}")
        if len(layers) == 0:
            raise bad("layers", "is empty: a model needs at least one layer")
        for i, layer in enumerate(layers):
            if not callable(layer):
                raise bad("layers", f"item {i} ({type(layer).__name__}) is neither a module "
                                    "nor a factory")
            if _needs_arguments(layer):
                raise bad("layers", f"item {i} ({_name(layer)}) takes an argument: a layer is a "
                                    "module or a zero-argument factory of one (wrap a function "
                                    "in an nn.Module)")
            lazy = _lazy_part(layer)
            if lazy is not None:
                raise bad("layers", f"item {i} ({type(layer).__name__}) has uninitialized "
                                    f"parameters{f' (its {lazy})' if lazy else ''}: run one "
                                    "forward of a sample through the model in the job "
                                    "function before returning its layers, so that every "
                                    "rank starts from the same values")
    for key in ("loss", "optimizer", "metric"):
        if key in spec and spec[key] is not None and not callable(spec[key]):
            raise bad(key, f"must be callable, got {type(spec[key]).__name__}")
    learned = _learned_parameters(spec.get("loss"))
    if learned:
        raise bad("loss", f"{type(spec['loss']).__name__} has parameters that require grad "
                          f"({', '.join(learned[:4])}{', ...' if len(learned) > 4 else ''}): "
                          "the trainer trains the layers' parameters only, so these would "
                          "stay at their initial values on every rank; compute them in the "
                          "last layer (its output can be a tuple the loss unpacks), or "
                          "freeze them with requires_grad_(False)")
    for key in ("global_batch", "microbatch_size"):
        if key in spec and spec[key] is not None and not _positive_int(spec[key]):
            raise bad(key, f"must be a positive integer, got {spec[key]!r}")
    for key in ("dataset", "eval_dataset"):
        data = spec.get(key)
        if data is not None and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise bad(key, f"must be a map-style dataset (len and indexing), got "
                           f"{type(data).__name__}")
        if data is not None and len(data) > 0:
            item = data[0]
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                what = (f"a dict with keys {sorted(map(str, item))}" if isinstance(item, dict)
                        else f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(
                            item, (tuple, list)) else ""))
                raise bad(key, f"items must be (input, target) pairs; item 0 is {what} (an "
                               "input of several tensors goes as one dict or tuple in the pair)")
    data, batch = spec.get("dataset"), spec.get("global_batch")
    if data is not None and _positive_int(batch) and len(data) < batch:
        raise bad("global_batch", f"is {batch}, more than the dataset's {len(data)} samples")
    micro = spec.get("microbatch_size")
    if _positive_int(micro) and _positive_int(batch) and micro > batch:
        raise bad("microbatch_size", f"is {micro}, more than global_batch {batch}")
    if _positive_int(micro) and _positive_int(batch) and batch % micro:
        raise bad("microbatch_size", f"is {micro}, which does not divide global_batch {batch}")
    if spec.get("optimizer") is not None and callable(spec["optimizer"]):
        problem = _optimizer_problem(spec["optimizer"])
        if problem is not None:
            raise bad("optimizer", problem)


def _learned_parameters(loss: Any) -> list[str]:
    """The names of a loss module's parameters that require grad (a learned temperature,
    a loss-weighting scheme's log-variances): no optimizer and no gradient sync sees them.
    Duck-typed (``named_parameters``), so that this module imports no torch."""
    named = getattr(loss, "named_parameters", None)
    if not callable(named) or not hasattr(loss, "forward"):
        return []
    return [name for name, p in named() if getattr(p, "requires_grad", False)]


def _name(value: Any) -> str:
    return getattr(value, "__qualname__", None) or type(value).__name__


def _needs_arguments(layer: Any) -> bool:
    """A callable that is not a module or a class and cannot be called without arguments
    (a function such as ``torch.tanh``: not a factory). Unknown signatures pass."""
    if inspect.isclass(layer) or hasattr(layer, "parameters"):
        return False
    if inspect.isbuiltin(layer):  # torch.tanh: no signature to read, and no factory
        return True
    try:
        sig = inspect.signature(layer)
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                     p.KEYWORD_ONLY)
               for p in sig.parameters.values())


def _step_needs_closure(optim: Any) -> bool:
    """Whether ``optim.step`` cannot be called without arguments. Read on the class: a
    learning-rate scheduler made on the optimizer replaces the instance's ``step`` by a
    wrapper whose ``__wrapped__`` is the unbound ``step(self, closure=None)``, which read
    as needing an argument (``self``), so any optimizer with a scheduler was refused."""
    step = getattr(type(optim), "step", None)
    if not inspect.isfunction(step):
        return _needs_arguments(optim.step)
    params = list(inspect.signature(step).parameters.values())[1:]  # after self
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                     p.KEYWORD_ONLY) for p in params)


def _lazy_part(layer: Any) -> str | None:
    """The name of a submodule with uninitialized (lazy) parameters ("" for the layer
    itself), if any; without importing torch (``LazyModuleMixin.has_uninitialized_params``)."""
    modules = getattr(layer, "named_modules", None)
    if modules is None or inspect.isclass(layer):
        return None
    for name, module in modules():
        check = getattr(module, "has_uninitialized_params", None)
        if callable(check) and check():
            return f"{type(module).__name__} {name!r}" if name else ""
    return None


def _optimizer_problem(factory: Any) -> str | None:
    """What makes ``factory`` unusable, seen on two probe parameters (a matrix and a
    vector, so that groups split by ``ndim`` are both there): it returns no optimizer, or
    one whose ``step`` needs a closure (LBFGS re-evaluates the loss inside its step, which
    a pipeline cannot do). A factory that fails on the probe is left to the ranks."""
    import torch

    probe = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    try:
        optim = factory(probe)
    except Exception:  # its own error shows where it is really used
        return None
    if not all(hasattr(optim, a) for a in ("step", "zero_grad", "param_groups", "state_dict",
                                            "load_state_dict")):
        return (f"must return an optimizer (a torch.optim.Optimizer) for the parameters it "
                f"is given, got {type(optim).__name__}")
    given = {id(p) for p in probe}
    held = [p for g in optim.param_groups for p in g.get("params", ())]
    foreign = [p for p in held if id(p) not in given]
    if foreign:
        return (f"returned an optimizer over {len(foreign)} parameter(s) it was not given "
                "(model.parameters() instead of its argument?): hetpilot calls the factory "
                "once per layer with that layer's parameters, so the optimizer must be built "
                "on the list it receives")
    if _step_needs_closure(optim):
        return (f"{type(optim).__name__}.step needs a closure that re-evaluates the loss, "
                "which a pipeline cannot provide; use an optimizer that steps from the "
                "gradients (SGD, Adam, AdamW, ...)")
    return None
