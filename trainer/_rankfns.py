"""Rank functions for the trainer's multi-rank tests.

They live in the package, not under tests/, because spawned ranks must import
them by module name (pytest's importlib mode gives test modules names that a
fresh interpreter cannot import).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from hetpilot.planner.serde import plan_from_dict
from torch import nn

from .check import _adam, _dataset, make_layers
from .plans import StaticPlanSource
from .runtime import JsonlReporter, Trainer

CFG: dict[str, Any] = {"num_layers": 6, "batch": 16, "iterations": 2, "seed": 3}

PLAN_A = {  # 3 ranks: a 2-stage pipeline and a single stage, uneven samples
    "microbatch_size": 2, "schedule": "1f1b",
    "groups": [
        {"samples": 10, "stages": [{"device": "local:0", "layers": [0, 2]},
                                   {"device": "local:1", "layers": [2, 6], "recompute": True}]},
        {"samples": 6, "stages": [{"device": "local:2", "layers": [0, 6]}]},
    ],
}
PLAN_B = {  # 2 ranks, other cut, gpipe
    "microbatch_size": 2, "schedule": "gpipe",
    "groups": [{"samples": 16, "stages": [{"device": "local:1", "layers": [0, 4]},
                                          {"device": "local:0", "layers": [4, 6]}]}],
}


def _trainer(rank: int, plan: dict, out: Path) -> Trainer:
    torch.set_default_dtype(torch.float64)
    return Trainer(
        make_layers(CFG["num_layers"]), nn.functional.mse_loss, _adam,
        _dataset(CFG["batch"] * CFG["iterations"], CFG["seed"]),
        global_batch=CFG["batch"], device_id=f"local:{rank}",
        plan_source=StaticPlanSource([plan_from_dict(plan)]), seed=CFG["seed"],
        dtype=torch.float64, reporter=JsonlReporter(out / f"report{rank}.jsonl"),
    )


def _save_held(trainer: Trainer, path: Path) -> None:
    torch.save({k: m.state_dict() for k, m in trainer.held_layers.items()}, path)


def _first_run(rank: int, world: int, out: str) -> None:
    trainer = _trainer(rank, PLAN_A, Path(out))
    trainer.fit(1)
    trainer.save_checkpoint(Path(out) / "ckpt")


def _resumed_run(rank: int, world: int, out: str) -> None:
    trainer = _trainer(rank, PLAN_B, Path(out))
    meta = trainer.load_checkpoint(Path(out) / "ckpt")
    assert meta["epoch"] == 1 and trainer.step == CFG["iterations"]
    trainer.fit(2)
    _save_held(trainer, Path(out) / f"held{rank}.pt")


def _bad_device_run(rank: int, world: int, out: str) -> None:
    bad = json.loads(json.dumps(PLAN_B))
    bad["groups"][0]["stages"][1]["device"] = "local:9"
    trainer = _trainer(rank, bad, Path(out))
    trainer.fit(1)
