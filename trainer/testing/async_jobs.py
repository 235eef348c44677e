"""Module-level functions for spawned async-pipeline ranks (they must pickle)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_mlp() -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
            nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)]


def tiny_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
