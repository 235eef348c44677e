"""The layers' optimizers stepped as one (hetpilot.trainer.optimstep)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hetpilot.trainer.optimstep import OptimizerStep
from torch import nn

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _layers(n: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 6, dtype=torch.float64) for _ in range(n)]


def _run(layers: list[nn.Module], factory: Factory, stepper: OptimizerStep | None,
         steps: int = 5) -> list[torch.optim.Optimizer]:
    optims = [factory(list(m.parameters())) for m in layers]
    _run_more(layers, optims, stepper, steps, seed=1, zero=True)
    return optims


def _state(optims: list[torch.optim.Optimizer]) -> list[Any]:
    return [o.state_dict() for o in optims]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("factory,merged", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), True),
    # a multi-tensor step of CPU parameters stays per layer (faster there)
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True), False),
    (lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True), True),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), True),
    # two groups a layer (no weight decay on biases): two merged groups
    (lambda ps: torch.optim.AdamW([{"params": [p for p in ps if p.dim() > 1]},
                                  {"params": [p for p in ps if p.dim() == 1],
                                   "weight_decay": 0.0}], lr=1e-2), True),
], ids=["adamw", "adamw-foreach", "adam-amsgrad", "sgd-nesterov", "two-groups"])
def test_one_step_for_all_is_each_layers_own_step(factory: Factory, merged: bool) -> None:
    alone, together = _layers(), _layers()
    stepper = OptimizerStep()
    expected = _state(_run(alone, factory, None))
    got = _state(_run(together, factory, stepper))
    assert stepper.merged == merged
    for a, b in zip(alone, together, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(),
                                                     strict=True))
        assert all(q.grad is None for q in b.parameters())
    # each layer's optimizer holds its own state, as if it had stepped itself
    assert _equal(expected, got)


class _Wrapped(torch.optim.SGD):
    """A job's own optimizer class: stepped as it is."""


def test_what_is_not_exactly_the_same_is_stepped_one_by_one() -> None:
    stepper = OptimizerStep()
    _run(_layers(), lambda ps: _Wrapped(ps, lr=0.1), stepper)
    assert not stepper.merged
    # an LR scheduler replaces the instance's step: its counter must see every step
    optims: list[torch.optim.Optimizer] = []

    def with_scheduler(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        o = torch.optim.SGD(ps, lr=0.1)
        optims.append(o)
        torch.optim.lr_scheduler.StepLR(o, step_size=1)
        return o

    _run(_layers(), with_scheduler, stepper)
    assert not stepper.merged
    hooked = _layers()
    stepper = OptimizerStep()
    calls: list[int] = []

    def with_hook(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        o = torch.optim.SGD(ps, lr=0.1)
        o.register_step_post_hook(lambda *_: calls.append(1))
        return o

    _run(hooked, with_hook, stepper, steps=2)
    assert not stepper.merged and len(calls) == 2 * len(hooked)
    # a tensor hyperparameter cannot be compared as a group key
    _run(_layers(), lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1)), stepper)
    assert not stepper.merged
    # different classes
    mixed = iter([torch.optim.SGD, torch.optim.Adam] * 2)
    _run(_layers(), lambda ps: next(mixed)(ps, lr=0.1), stepper)
    assert not stepper.merged


def test_a_loaded_state_is_the_one_stepped() -> None:
    """load_state_dict gives a layer's optimizer new state and groups: the merged
    optimizer is rebuilt on them (a moved layer, a checkpoint)."""
    layers = _layers(2)
    factory: Factory = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    stepper = OptimizerStep()
    optims = _run(layers, factory, stepper, steps=3)
    saved = copy.deepcopy(optims[0].state_dict())
    before = [p.detach().clone() for p in layers[0].parameters()]
    _run_more(layers, optims, stepper, steps=2)
    with torch.no_grad():
        for p, b in zip(layers[0].parameters(), before, strict=True):
            p.copy_(b)
    optims[0].load_state_dict(saved)  # layer 0 back to after step 3
    _run_more(layers, optims, stepper, steps=2)
    # layer 0 replayed the same two steps from the same state: the same values
    reference = _layers(2)
    ref_optims = _run(reference, factory, None, steps=3)
    _run_more(reference, ref_optims, None, steps=2)
    assert all(torch.equal(p, q) for p, q in zip(layers[0].parameters(),
                                                 reference[0].parameters(), strict=True))
    assert int(optims[0].state_dict()["state"][0]["step"]) == 5


def _run_more(layers: list[nn.Module], optims: list[torch.optim.Optimizer],
              stepper: OptimizerStep | None, steps: int, seed: int = 2,
              zero: bool = False) -> None:
    """``steps`` steps on random gradients (from ``seed``), each alone or by ``stepper``;
    ``zero``: then zero the gradients the same way."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for m in layers:
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if stepper is not None:
            stepper.step(optims)
            if zero:
                stepper.zero_grad(optims)
            continue
        for o in optims:
            o.step()
            if zero:
                o.zero_grad(set_to_none=True)
