"""A job whose float64 check cannot see anything (train-check must say inconclusive): the
last BatchNorm normalises 2 values a channel (microbatch 2, 1x1 images after the
convolutions), so rounding alone sends two float64 runs apart, as resnet18 at microbatch
2 on 32x32 images does."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _block(a: int, b: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(a, b, 3, stride=2, padding=1, bias=False),
                         nn.BatchNorm2d(b), nn.ReLU())


def chaotic_bn() -> dict[str, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = [_block(3, 8), _block(8, 16), _block(16, 16), _block(16, 16),
                  nn.Sequential(nn.Flatten(), nn.Linear(16, 4))]
        x = torch.randn(32, 3, 8, 8)
        y = torch.randint(0, 4, (32,))
    return {"layers": layers, "loss": nn.functional.cross_entropy,
            "optimizer": lambda ps: torch.optim.Adam(ps, lr=5e-2),
            "dataset": torch.utils.data.TensorDataset(x, y), "global_batch": 8,
            "microbatch_size": 2}
