"""Module-level pieces of the time-to-accuracy benchmark (spawned ranks pickle them)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

LAYERS = 8


def digits_mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    dims = [64] + [128] * (LAYERS - 1)
    linears = [nn.Linear(a, b) for a, b in itertools.pairwise(dims)]
    for lin in linears:  # He init: a plain 8-layer ReLU MLP barely trains with torch's default
        nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")
        nn.init.zeros_(lin.bias)
    out: list[nn.Module] = [nn.Sequential(lin, nn.ReLU()) for lin in linears]
    return [*out, nn.Linear(128, 10)]


@dataclass(frozen=True)
class Speeds:
    """EMULATED speed of each rank; ``hit`` slows to ``factor`` from microbatch ``at`` on."""

    base: tuple[float, ...]
    hit: int = -1
    factor: float = 1.0
    at: int = 10**9

    def __call__(self, rank: int, k: int) -> float:
        s = self.base[rank]
        return s * self.factor if rank == self.hit and k >= self.at else s
