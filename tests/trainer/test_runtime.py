"""Checkpoint/resume under another plan and world size, live refusal, measurements."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hetpilot.planner.serde import plan_from_dict, plan_to_dict
from hetpilot.trainer.check import _adam, _dataset, _reference, make_layers
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.plans import StaticPlanSource
from hetpilot.trainer.runtime import JsonlReporter, Trainer
from torch import nn

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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_under_other_plan_and_world_size(tmp_path: Path) -> None:
    spawn(_first_run, 3, (str(tmp_path),), timeout_s=90)
    assert (tmp_path / "ckpt" / "meta.json").exists()
    spawn(_resumed_run, 2, (str(tmp_path),), timeout_s=90)
    reference = _reference(CFG, 2)[1]
    for rank in range(2):
        held = torch.load(tmp_path / f"held{rank}.pt", weights_only=True)
        assert held, f"rank {rank} holds no layer"
        for layer, state in held.items():
            for key, value in state.items():
                assert float((value - reference[layer][key]).abs().max()) <= 1e-9
    # measurements: one record per rank per epoch with per-stage times
    records = [json.loads(line) for line in (tmp_path / "report0.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    assert {"fwd_s", "bwd_s", "transfer_wait_s", "samples_per_s", "plan_version"} <= set(records[0])
    assert records[0]["samples_per_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_unknown_device_is_refused_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"no rank has device 'local:9'"):
        spawn(_bad_device_run, 2, (str(tmp_path),), timeout_s=45)
    assert not (tmp_path / "report0.jsonl").exists()  # nothing ran


def test_plan_dicts_round_trip() -> None:
    assert plan_to_dict(plan_from_dict(PLAN_A))["groups"][0]["samples"] == 10
