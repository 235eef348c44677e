"""Jobs with a ``tp_plan`` for the tensor-parallel tests: dropout inside a split region.

:func:`gpt_tp_dropout` is :func:`~hetpilot.trainer.examples.gpt_tp` whose blocks drop out
the attention probabilities (split by heads), the MLP's hidden activation (between the
column-parallel up and the row-parallel down projections) and the block's output
(replicated), so a tensor-parallel stage must draw each sharded mask as one process does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..examples import GPT_TP_PLAN, _gpt_init, gpt

__all__ = ["gpt_tp_dropout"]


class DropAttention(nn.Module):
    """Causal attention with separate q/k/v and dropout on its probabilities."""

    def __init__(self, d_model: int, heads: int, p: float) -> None:
        super().__init__()
        self.head_dim = d_model // heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / self.head_dim ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, -1))


class DropMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, p: float) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.drop = nn.Dropout(p)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(F.gelu(self.up(x))))


class DropBlock(nn.Module):
    """Pre-LN block with dropout on sharded (probabilities, MLP hidden) and replicated
    (residual branch) activations; submodule names as :data:`GPT_TP_PLAN` splits them."""

    def __init__(self, d_model: int, heads: int, p: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = DropAttention(d_model, heads, p)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = DropMLP(d_model, 4 * d_model, p)
        self.resid = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.resid(self.mlp(self.ln2(x)))


def gpt_tp_dropout(p: float = 0.3) -> dict[str, Any]:
    """Two :class:`DropBlock` blocks (4 heads, d_model 32) between gpt's embedding and
    tied head, with ``GPT_TP_PLAN``."""
    job = gpt(64, 16, 32, 4, 2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        body = [DropBlock(32, 4, p) for _ in range(2)]
        for module in body:
            module.apply(_gpt_init)
    layers = job["layers"]
    return {**job, "layers": [layers[0], *body, *layers[-2:]], "tp_plan": dict(GPT_TP_PLAN)}
