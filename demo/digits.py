"""The demo's job: a small MLP (``nn.Sequential``) on scikit-learn's digits (ships offline).

``job()`` is the ``hetpilot train --model hetpilot.demo.digits:job`` spec;
:func:`held_out_accuracy` scores a trainer checkpoint on the held-out split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["GLOBAL_BATCH", "MICROBATCH", "held_out_accuracy", "job", "model"]

GLOBAL_BATCH = 64
MICROBATCH = 4
HIDDEN = 128


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 10))


def _split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return xtr, ytr, xte, yte


def job() -> dict[str, Any]:
    xtr, ytr, _, _ = _split()
    return {
        "layers": list(model()),
        "sample": xtr[:MICROBATCH],
        "loss": nn.functional.cross_entropy,
        "optimizer": lambda params: torch.optim.Adam(params, lr=2e-3),
        "dataset": torch.utils.data.TensorDataset(xtr, ytr),
        "global_batch": GLOBAL_BATCH,
    }


def held_out_accuracy(checkpoint: str | Path) -> float:
    """Accuracy on the held-out 20% of a checkpoint written by ``hetpilot train --checkpoint``
    (its latest commit, or the one commit directory given)."""
    from hetpilot.trainer.checkpoint import export_state_dict

    net = model()
    net.load_state_dict(export_state_dict(checkpoint))
    _, _, xte, yte = _split()
    with torch.no_grad():
        return float((net(xte).argmax(1) == yte).float().mean())
