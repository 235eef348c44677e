"""Model profile from measurement, and the trainer's command lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hetpilot.planner.serde import model_from_dict
from hetpilot.trainer.profile import profile_model
from torch import nn


def test_profile_counts_flops_and_bytes() -> None:
    layers = [nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 4), nn.Tanh())]
    m = 4
    model = profile_model(layers, torch.randn(m, 8), name="t")
    parsed = model_from_dict(model)  # spec section 2 shape
    first, second = parsed.layers
    assert first.fwd_gflop == pytest.approx(2 * 8 * 16 / 1e9)
    assert first.bwd_gflop == pytest.approx(2 * 8 * 16 / 1e9)  # weight grad only (layer 0)
    assert second.bwd_gflop == pytest.approx(2 * 2 * 16 * 4 / 1e9)  # weight and input grads
    assert first.out_mb == pytest.approx(16 * 4 / 1e6)
    assert first.param_mb == pytest.approx((8 * 16 + 16) * 4 / 1e6)
    assert second.act_mb > 0


def _hetpilot(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetpilot", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_profile_command_writes_model(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    res = _hetpilot("profile", "--model", "hetpilot.trainer.examples:mlp", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert len(model_from_dict(json.loads(out.read_text())).layers) == 6
    blocked = tmp_path / "model.json" / "inside"  # a file, not a folder
    res = _hetpilot("profile", "--model", "hetpilot.trainer.examples:mlp", "--out", str(blocked))
    assert res.returncode == 2 and "--out: cannot write" in res.stderr, res.stderr[-1000:]
    assert "Traceback" not in res.stderr


def test_profile_takes_a_sample_from_the_dataset_when_the_job_gives_none(tmp_path: Path) -> None:
    res = _hetpilot("profile", "--model", "hetpilot.trainer.testing.jobs:drowsy_tiny")
    assert res.returncode == 0, res.stderr
    assert len(model_from_dict(json.loads(res.stdout)).layers) == 4
    (tmp_path / "layers_only.py").write_text(
        "import torch\ndef job():\n    return {'layers': [torch.nn.Linear(2, 2)]}\n")
    res = subprocess.run([sys.executable, "-m", "hetpilot", "profile", "--model",
                          "layers_only:job"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 2 and "returned no 'sample' and no 'dataset'" in res.stderr


def _plan(samples: int, layers: tuple[int, int]) -> dict:
    return {"microbatch_size": 2, "schedule": "1f1b",
            "groups": [{"samples": samples, "stages": [{"device": "solo:0", "layers": list(layers)}]}]}


@pytest.mark.parametrize(
    ("plan", "words"),
    [(_plan(12, (0, 6)), "samples sum to 12, but the global batch is 16"),
     (_plan(16, (0, 7)), "ends past the model's 6 layers")],
)
def test_train_refuses_wrong_plan_before_starting(tmp_path: Path, plan: dict, words: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    res = _hetpilot("train", "--model", "hetpilot.trainer.examples:mlp", "--plan", str(path),
                    "--epochs", "1", "--device-id", "solo:0")
    assert res.returncode == 2
    assert words in res.stderr and "plan.groups" in res.stderr


@pytest.mark.parametrize("flag", ["--report", "--checkpoint"])
def test_train_refuses_an_unwritable_output_before_starting(tmp_path: Path, flag: str) -> None:
    """An output that cannot be written had failed the run at its first report or
    checkpoint, after training, with a traceback."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(16, (0, 6))))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = _hetpilot("train", "--model", "hetpilot.trainer.examples:mlp", "--plan", str(path),
                    "--epochs", "1", "--device-id", "solo:0", flag, str(blocker / "out"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"hetpilot: error: {flag}: cannot write" in res.stderr
    assert "Traceback" not in res.stderr and '"plan_version"' not in res.stdout


@pytest.mark.timeout(90)
def test_train_single_rank_reports_and_checkpoints(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(16, (0, 6))))
    report = tmp_path / "r.jsonl"
    res = _hetpilot("train", "--model", "hetpilot.trainer.examples:mlp", "--plan", str(path),
                    "--epochs", "2", "--device-id", "solo:0", "--report", str(report),
                    "--checkpoint", str(tmp_path / "ck"), "--emulate-slowdown", "1.5")
    assert res.returncode == 0, res.stderr
    assert "EMULATED" in res.stderr
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["emulated_slowdown"] == 1.5
    assert json.loads((tmp_path / "ck" / "step-00000008" / "meta.json").read_text())["epoch"] == 2
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000008"
