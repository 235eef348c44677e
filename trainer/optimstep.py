"""One optimizer step for all the layers a rank holds, so the trainer keeps GPU speed.

Why: the trainer keeps one optimizer per layer (and per tied parameter), so that a layer
moves to another rank with its own optimizer state. Stepping them one by one costs a
Python step and a set of kernel launches per layer: AdamW's multi-tensor (``foreach``)
kernels take many parameters a launch, so 14 optimizers of GPT-2 small's layers launch
about 14 times what one optimizer over the same parameters does. Where the host's
launches bound the GPU, hetpilot's iteration spent 3-7 ms more outside its ops than a
plain loop with one optimizer (bench/RESULTS-gpu.md, leases I and J).

:class:`OptimizerStep` steps them as one where that is exactly the same computation:

* every optimizer is of the same class from ``torch.optim`` (a job's own class or a
  wrapper, e.g. with a scheduler inside, is stepped as it is);
* none has step hooks, nor are there global ones, and none had its ``step`` replaced
  on the instance (an LR scheduler's step counter does that);
* every hyperparameter of every group is a plain value (number, string, bool, None,
  tuples of them) so groups can be compared;
* not a multi-tensor (``foreach``, ``fused``) step of CPU parameters, which is faster
  per layer (see :func:`_mergeable`).

Then one optimizer of that class holds one group per distinct set of hyperparameters
(the layers' groups with equal settings joined) and a state that hands out each layer
optimizer's own per-parameter state dicts: a step writes into the layers' states, so
their ``state_dict()``, checkpoints and moves see every step. The element-wise update of
each parameter is the one its own optimizer would make (``train-check`` compares it with
one process in float64). The merged optimizer is rebuilt when an optimizer, its state
object or its groups change (a plan switch, ``load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as _optimizer_module

__all__ = ["OptimizerStep"]

_PLAIN = (int, float, bool, str, type(None))


class _SharedState(dict):  # type: ignore[type-arg]
    """The merged optimizer's ``state``: each parameter's entry is its own optimizer's."""

    def __init__(self, owner: dict[int, Optimizer]) -> None:
        super().__init__()
        self._owner = owner

    def __missing__(self, param: torch.Tensor) -> Any:
        entry = self._owner[id(param)].state[param]
        self[param] = entry
        return entry


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _mergeable(optims: Sequence[Optimizer], cpu_multi_tensor: bool = False) -> bool:
    cls = type(optims[0])
    if not cls.__module__.startswith("torch.optim."):
        return False
    if _optimizer_module._global_optimizer_pre_hooks or \
            _optimizer_module._global_optimizer_post_hooks:
        return False
    for o in optims:
        if type(o) is not cls or "step" in vars(o) or "zero_grad" in vars(o):
            return False
        if o._optimizer_step_pre_hooks or o._optimizer_step_post_hooks:
            return False
        # the one default a step reads outside its groups (torch's _use_grad wrapper)
        if o.defaults.get("differentiable") != optims[0].defaults.get("differentiable"):
            return False
        if not all(_plain(v) for g in o.param_groups for k, v in g.items() if k != "params"):
            return False
    # Multi-tensor steps of CPU parameters stay per layer: each op then runs over one
    # layer's tensors while they are in cache; over all layers at once AdamW(foreach=True)
    # took 1.05-1.09x the time on a CPU (bench/optim_step.py). torch's default on a CPU is the
    # single-tensor step, which joining does not reorder.
    groups = [g for o in optims for g in o.param_groups]
    multi_tensor = any(g.get("foreach") or g.get("fused") for g in groups)
    on_cpu = any(p.device.type == "cpu" for g in groups for p in g["params"])
    return cpu_multi_tensor or not (multi_tensor and on_cpu)


def _merged(optims: Sequence[Optimizer], cpu_multi_tensor: bool = False) -> Optimizer | None:
    """One optimizer stepping all of ``optims`` (see the module docstring), or None."""
    if len(optims) < 2 or not _mergeable(optims, cpu_multi_tensor):
        return None
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    owner: dict[int, Optimizer] = {}
    n_groups = 0
    for o in optims:
        for g in o.param_groups:
            n_groups += 1
            key = tuple(sorted((k, v) for k, v in g.items() if k != "params"))
            merged = groups.setdefault(key, {**dict(key), "params": []})
            for p in g["params"]:
                merged["params"].append(p)
                owner[id(p)] = o
    if len(groups) == n_groups:
        return None  # nothing joined: no fewer steps
    cls = type(optims[0])
    one = cls.__new__(cls)
    one.__setstate__({"defaults": dict(optims[0].defaults), "state": _SharedState(owner),
                      "param_groups": list(groups.values())})
    one._warned_capturable_if_run_uncaptured = True
    return one


class OptimizerStep:
    """``step()`` and ``zero_grad()`` for a list of optimizers: as one where that is exact,
    else one by one."""

    def __init__(self, merge: bool = True, cpu_multi_tensor: bool = False) -> None:
        self.merge = merge
        """False: always one by one (to compare)."""
        self.cpu_multi_tensor = cpu_multi_tensor
        """True: join multi-tensor steps of CPU parameters too (to compare)."""
        self._key: tuple[Any, ...] | None = None
        self._one: Optimizer | None = None
        self.merged = False
        """Whether the last call stepped one merged optimizer."""

    def _current(self, optims: Sequence[Optimizer]) -> Optimizer | None:
        key = tuple((id(o), id(o.state), id(o.param_groups), *map(id, o.param_groups))
                    for o in optims)
        if key != self._key:
            self._key = key
            self._one = _merged(optims, self.cpu_multi_tensor) if self.merge else None
        self.merged = self._one is not None
        return self._one

    def step(self, optims: Sequence[Optimizer]) -> None:
        one = self._current(optims)
        if one is not None:
            one.step()
            return
        for o in optims:
            o.step()

    def zero_grad(self, optims: Sequence[Optimizer]) -> None:
        one = self._current(optims)
        if one is not None:
            one.zero_grad(set_to_none=True)
            return
        for o in optims:
            o.zero_grad(set_to_none=True)
