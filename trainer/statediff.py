"""Differences between the ranks' layer states and a one-process reference, and the
rounding-noise floors they are counted beyond (``hetpilot train-check``,
:mod:`hetpilot.trainer.traincheck`).

In float64 each tensor's largest absolute difference counts beyond
:data:`NOISE_FACTOR` times its floor: how far copies of the reference started a
few ulps away (:func:`_perturb`) end from it (:func:`_floors`). Under mixed
precision a layer's floating tensors are compared together, relative to how far
the reference moved the layer (:func:`_relative`), each tensor beyond
:data:`MIXED_NOISE_FACTOR` times its floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MIXED_NOISE_FACTOR", "NOISE_FACTOR", "Difference", "Floors"]

NOISE_FACTOR = 10.0
"""A tensor's difference is counted beyond this many times its rounding-noise floor
(module docstring): noise is random, so two noise trajectories differ by a few times
their spread; a lost or mis-weighted gradient differs by the learning rate."""
MIXED_NOISE_FACTOR = 2.0
"""Under mixed precision each tensor's distance from the same-precision reference is counted
beyond this many times the perturbed copies' (module docstring): there rounding noise can be
the size of the tolerance itself, so only a factor above 1 keeps a noise trajectory from
failing, and a lost or mis-weighted gradient is an error of order 1 where the floor is small."""
@dataclass
class Difference:
    """The largest absolute difference found, and where."""

    value: float = 0.0
    where: str = "nothing compared"
    beyond_noise: bool = False
    """Counted beyond each tensor's rounding-noise floor (float64, the second pass)."""
    loss_floor: float = 0.0
    """How far rounding noise alone moved the mean loss (``NOISE_FACTOR`` times the
    perturbed copies' distance), the largest over the plans; above the tolerance the
    check is inconclusive (:func:`inconclusive`)."""
    floor: float = 0.0
    """``NOISE_FACTOR`` times the highest tensor floor in that plan."""
    noisiest: str = ""
    """Where that was, and the tensor with the highest floor there."""

    def update(self, value: float, where: str) -> None:
        """Keep the largest; a NaN is larger than any (it was lost when it came second)."""
        if self.where != "nothing compared" and (math.isnan(self.value) or value <= self.value):
            return
        self.value, self.where = value, where


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float(_minus(a, b).abs().max())


def _inexact(t: torch.Tensor) -> bool:
    """Compared up to a tolerance: floating or complex (an integer tensor must be equal)."""
    return t.is_floating_point() or t.is_complex()


def _minus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b`` in float64 (complex128 where either is complex: ``.double()`` of a complex
    tensor drops its imaginary part, which went uncompared), 0 where they are equal: a
    causal mask's ``-inf`` in both is no difference (``inf - inf`` would be NaN); NaN in
    either stays NaN. Norms take ``.abs()`` of it."""
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    a, b = a.to(wide), b.to(wide)
    return torch.where(a == b, torch.zeros((), dtype=wide), a - b)


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
              start: dict[str, torch.Tensor] | None, floors: dict[str, float] | None = None,
              factor: float = 1.0) -> tuple[float, str]:
    """One layer under mixed precision: ``|got - want| / |want - start|`` over all its
    floating tensors together (L2), and the tensor contributing most to the error;
    ``start`` None: ``|got - want| / |want|``. With ``floors`` (per tensor, an L2 distance)
    each tensor's distance counts only beyond ``factor`` times its floor.

    Per layer, not per tensor: a gradient that is zero in exact arithmetic (the key
    bias of attention) is rounding noise in either run, and Adam turns noise into
    full-size steps in random directions; over the layer those few entries weigh
    little. Integer tensors (``num_batches_tracked``) must be equal."""
    err2 = moved2 = 0.0
    worst, worst_key = -1.0, "nothing"
    for key, b in want.items():
        a = got.get(key)
        if a is None or a.shape != b.shape:
            return float("inf"), key
        if not _inexact(b):
            if not torch.equal(a, b):
                return float("inf"), key
            continue
        e2 = float(_minus(a, b).abs().pow(2).sum())
        if floors is not None:
            e2 = max(e2 ** 0.5 - factor * floors.get(key, 0.0), 0.0) ** 2
        err2 += e2
        moved2 += float(_moved(b, start, key).abs().pow(2).sum())
        if e2 > worst:
            worst, worst_key = e2, key
    if err2 == 0.0:
        return 0.0, worst_key
    return (err2 / moved2) ** 0.5 if moved2 > 0 else float("inf"), worst_key


def _moved(want: torch.Tensor, start: dict[str, torch.Tensor] | None, key: str) -> torch.Tensor:
    """What a relative difference is relative to: the reference's change, or its value."""
    if start is None:
        return _minus(torch.where(torch.isfinite(want), want, 0), torch.zeros_like(want))
    return _minus(want, start[key])


def _l2(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(_minus(a, b).abs().pow(2).sum()) ** 0.5


def _perturb(layers: list[nn.Module], seed: int) -> None:
    """Multiply every floating parameter by ``1 + u * 4 eps`` (``u`` uniform in [-1, 1],
    ``eps`` its dtype's): a start a few ulps away, for :func:`_noise_floors`."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                if id(p) in seen or not _inexact(p):
                    continue
                seen.add(id(p))
                u = torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1
                p.mul_((1 + 4 * torch.finfo(p.real.dtype).eps * u).to(p.dtype))


Floors = list[dict[str, float]]
"""Per layer, per tensor: how far the run may be from a reference by noise alone
(:func:`_floors`)."""


def _floors(before: dict[str, list[dict[str, torch.Tensor]]],
            after: dict[str, list[dict[str, torch.Tensor]]],
            copies: list[list[dict[str, torch.Tensor]]], mixed: bool) -> dict[str, Floors]:
    """Per reference label, its floors after one plan. The first reference's are how far
    its perturbed copies ended from it, per tensor: the largest absolute difference
    (float64) or the L2 distance (mixed precision). Under mixed precision the float32
    reference's are how far the first (one process in the low dtype) ended from it, per
    tensor (L2): the model's own sensitivity to the dtype, which the ranks share and
    cannot be blamed for."""
    first, *rest = after
    dist = _l2 if mixed else _max_abs
    out = {first: [{key: max(dist(copy[layer][key], want) for copy in copies)
                    for key, want in state.items() if _inexact(want)}
                   for layer, state in enumerate(after[first])]}
    for label in rest:
        out[label] = [{key: _l2(after[first][layer][key], want)
                       for key, want in state.items() if _inexact(want)}
                      for layer, state in enumerate(after[label])]
    return out


def _noisiest(held: list[dict[int, dict[str, torch.Tensor]]],
              expected: list[dict[str, torch.Tensor]],
              before: list[dict[str, torch.Tensor]] | None, floors: Floors,
              names: list[str], mixed: bool) -> str:
    """The tensor with the highest floor (mixed precision: relative to its layer's change,
    or value), and how far the run is from the reference there, the same way (the line
    train-check prints after each plan)."""
    def scale(layer: int) -> float:
        if not mixed:
            return 1.0
        moved = sum(float(_moved(t, None if before is None else before[layer], k)
                          .abs().pow(2).sum())
                    for k, t in expected[layer].items() if _inexact(t)) ** 0.5
        return 1.0 / moved if moved > 0 else float("inf")

    scales = [scale(layer) for layer in range(len(floors))]
    layer, key = max(((i, k) for i, f in enumerate(floors) for k in f),
                     key=lambda lk: floors[lk[0]][lk[1]] * scales[lk[0]], default=(None, None))
    if layer is None or key is None:
        return "no floating tensor"
    dist = _l2 if mixed else _max_abs
    run = max((dist(state[layer][key], expected[layer][key])
               for state in held if layer in state), default=0.0)
    what = "relative to the layer's change" if mixed and before is not None else (
        "relative to the layer" if mixed else "")
    return (f"floor up to {floors[layer][key] * scales[layer]:.3e}{' ' if what else ''}{what} "
            f"at layer {layer} ({names[layer]}) {key!r}, where the run differs by "
            f"{run * scales[layer]:.3e}")


def _compare(held: list[dict[int, dict[str, torch.Tensor]]],
             expected: list[dict[str, torch.Tensor]],
             before: list[dict[str, torch.Tensor]] | None,
             names: list[str], mixed: bool, floors: Floors | None = None,
             factor: float = NOISE_FACTOR) -> Difference:
    """The largest difference over every replica: relative per layer under mixed precision
    (:func:`_relative`), else absolute per tensor, less ``factor`` times each tensor's
    floor (``floors``; module docstring)."""
    here = Difference()
    for rank, layers in enumerate(held):
        for layer, state in layers.items():
            if mixed:
                value, key = _relative(state, expected[layer],
                                       None if before is None else before[layer],
                                       None if floors is None else floors[layer], factor)
                if key == "nothing":  # no floating tensor (ReLU): nothing to name
                    continue
                here.update(value, f"layer {layer} ({names[layer]}), most in {key!r}, "
                                   f"on rank {rank}")
                continue
            for key, tensor in state.items():
                floor = floors[layer].get(key, 0.0) if floors is not None else 0.0
                value = _max_abs(tensor, expected[layer][key])
                here.update(max(value - factor * floor, 0.0),
                            f"layer {layer} ({names[layer]}) {key!r} on rank {rank}")
    return here
