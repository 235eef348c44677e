"""``hetpilot train`` under torchrun with 2 ranks, and target-time emulation pacing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hetpilot.trainer.pipeline import StageRunner
from torch import nn

PLAN = {  # 2-stage 1F1B pipeline over both ranks
    "microbatch_size": 4, "schedule": "1f1b",
    "groups": [{"samples": 16, "stages": [{"device": "local:0", "layers": [0, 2]},
                                          {"device": "local:1", "layers": [2, 6]}]}],
}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_train_under_torchrun_two_ranks(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    report = tmp_path / "report.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hetpilot", "train", "--model", "hetpilot.trainer.examples:mlp",
         "--plan", str(plan), "--epochs", "2", "--device-id", "local:{local_rank}",
         "--report", str(report), "--checkpoint", str(tmp_path / "ckpt"),
         "--emulate-tflops", "0.002,0.001"],
        env=env, capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "EMULATED device speed" in res.stderr
    printed = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[1] for line in printed] == ["epoch 0", "epoch 1"]  # training log
    assert all(line.endswith(" | plan v1 | local:0,local:1") for line in printed), printed
    assert "tokens/s" not in res.stdout  # the mlp's inputs are not token ids
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert sorted((r["rank"], r["epoch"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in records:
        assert r["plan_version"] == 1 and r["group"] == 0 and r["stage"] == r["rank"]
        assert r["iterations"] == 4 and r["emulated_tflops"] == [0.002, 0.001][r["rank"]]
    commit = tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text().strip()
    meta = json.loads((commit / "meta.json").read_text())
    assert commit.name == "step-00000008" and meta["epoch"] == 2 and meta["step"] == 8
    assert sorted(p.name for p in commit.glob("layer*.pt")) == [
        f"layer{i:05d}.pt" for i in range(6)]


def test_target_time_emulation_paces_each_op() -> None:
    """Each op lasts at least its target (a lower bound the sleep guarantees)."""
    runner = StageRunner(
        [nn.Linear(3, 2)], prev_rank=None, next_rank=None, recompute=False,
        loss_fn=nn.functional.mse_loss, loss_scale=1.0,
        device=torch.device("cpu"), fwd_target_s=0.02, bwd_target_s=0.03)
    ops = [(False, 0), (False, 1), (True, 0), (True, 1)]
    stats, _ = runner.run(ops, lambda k: torch.randn(2, 3), lambda k: torch.randn(2, 2))
    assert stats.microbatches == 2
    assert stats.fwd_s >= 2 * 0.02 and stats.bwd_s >= 2 * 0.03
    assert stats.emulated_s > 0
