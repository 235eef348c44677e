"""Small models for ``hetpilot profile`` / ``hetpilot train`` examples and the checks.

A job spec is a zero-argument function returning a dict with ``layers`` (a
list of modules or factories), ``sample`` (one microbatch of inputs, for
``profile``), and for ``train`` also ``loss``, ``optimizer`` (a factory over
a parameter list), ``dataset`` and ``global_batch``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .check import make_layers

__all__ = ["mlp"]


def mlp() -> dict[str, Any]:
    """The train-check tanh MLP (6 layers) on 64 random regression samples, batch 16."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = torch.randn(64, 2, generator=gen)
    return {
        "layers": make_layers(6),
        "sample": x[:4],
        "loss": nn.functional.mse_loss,
        "optimizer": lambda params: torch.optim.Adam(params, lr=0.01),
        "dataset": torch.utils.data.TensorDataset(x, y),
        "global_batch": 16,
    }
