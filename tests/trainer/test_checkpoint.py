"""Atomic checkpoints (``hetpilot.trainer.checkpoint``) and ``hetpilot export``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hetpilot.planner.serde import plan_from_dict
from hetpilot.trainer import checkpoint as ckpt
from hetpilot.trainer.examples import mlp
from hetpilot.trainer.launch import free_port, init_local
from hetpilot.trainer.plans import StaticPlanSource
from hetpilot.trainer.runtime import Trainer, TrainerConfig
from torch import nn

PLAN = {"microbatch_size": 4, "schedule": "1f1b",
        "groups": [{"samples": 16, "stages": [{"device": "solo:0", "layers": [0, 6]}]}]}


def _save(root: Path, step: int, files: dict[str, object], keep: int = 2) -> Path:
    ckpt.begin_save(root, step)
    for name, obj in files.items():
        ckpt.write_file(ckpt.staging_dir(root, step), name, obj)
    return ckpt.commit(root, step, {"step": step, "num_layers": 1}, keep=keep)


def _layer(value: float) -> dict[str, object]:
    return {"module": {"weight": torch.full((2,), value)}, "optim": None}


def test_successive_saves_move_latest_and_prune(tmp_path: Path) -> None:
    for step in (4, 8, 12):
        _save(tmp_path, step, {ckpt.layer_file(0): _layer(step)})
    assert (tmp_path / "latest").read_text().strip() == "step-00000012"
    assert [p.name for _, p in ckpt.step_dirs(tmp_path)] == ["step-00000008", "step-00000012"]
    assert ckpt.resolve(tmp_path) == tmp_path / "step-00000012"
    assert ckpt.export_state_dict(tmp_path)["0.weight"].tolist() == [12.0, 12.0]
    _save(tmp_path, 12, {ckpt.layer_file(0): _layer(-1)})  # the same step again: replaced
    assert ckpt.export_state_dict(tmp_path)["0.weight"].tolist() == [-1.0, -1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step-00000008", "step-00000012"]
    # resumed from step 8 (latest lost): step 12 is an abandoned timeline, dropped
    (tmp_path / "latest").unlink()
    _save(tmp_path, 10, {ckpt.layer_file(0): _layer(10)}, keep=1)
    assert [p.name for _, p in ckpt.step_dirs(tmp_path)] == ["step-00000010"]


def test_crash_before_commit_leaves_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 4, {ckpt.layer_file(0): _layer(4)})
    # a save that died after writing its files, even its meta.json, but before the rename
    staging = ckpt.begin_save(tmp_path, 8)
    ckpt.write_file(staging, ckpt.layer_file(0), _layer(8))
    (staging / "meta.json").write_text(json.dumps({"step": 8, "num_layers": 1}))
    # ... and one that died after the rename, before `latest` moved
    (tmp_path / "step-00000012").mkdir()
    (tmp_path / "step-00000012" / "meta.json").write_text("{}")
    assert ckpt.resolve(tmp_path) == tmp_path / "step-00000004"
    assert ckpt.export_state_dict(tmp_path)["0.weight"].tolist() == [4.0, 4.0]
    # the next save clears what the crash left before anyone writes into it
    staging = ckpt.begin_save(tmp_path, 8)
    assert list(staging.iterdir()) == []
    ckpt.write_file(staging, ckpt.layer_file(0), _layer(9))
    ckpt.commit(tmp_path, 8, {"step": 8, "num_layers": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step-00000004", "step-00000008"]
    assert ckpt.export_state_dict(tmp_path)["0.weight"].tolist() == [9.0, 9.0]


def test_legacy_flat_layout_and_dangling_latest(tmp_path: Path) -> None:
    assert not ckpt.has_checkpoint(tmp_path) and not ckpt.has_checkpoint(tmp_path / "none")
    torch.save(_layer(1), tmp_path / "layer00000.pt")
    (tmp_path / "meta.json").write_text(json.dumps({"num_layers": 1}))
    assert ckpt.resolve(tmp_path) == tmp_path
    assert ckpt.export_state_dict(tmp_path)["0.weight"].tolist() == [1.0, 1.0]
    _save(tmp_path, 4, {ckpt.layer_file(0): _layer(4)})
    assert ckpt.resolve(tmp_path) == tmp_path / "step-00000004"  # the new layout wins
    (tmp_path / "latest").write_text("step-00000099\n")  # names nothing: newest commit
    assert ckpt.resolve(tmp_path) == tmp_path / "step-00000004"
    with pytest.raises(ValueError, match="file name"):
        ckpt.write_file(tmp_path, "../x.pt", {})


class _Head(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def test_export_fills_tied_keys_from_tied_files(tmp_path: Path) -> None:
    emb = nn.Embedding(5, 3)
    layers = [emb, nn.Linear(3, 3), _Head(emb)]
    tied = torch.arange(15.0).view(5, 3)
    ckpt.begin_save(tmp_path, 1)
    staging = ckpt.staging_dir(tmp_path, 1)
    for i, layer in enumerate(layers):  # as the trainer writes them: tied keys left out
        state = {k: v for k, v in layer.state_dict().items() if k != "weight" or i == 1}
        ckpt.write_file(staging, ckpt.layer_file(i), {"module": state, "optim": None})
    ckpt.write_file(staging, ckpt.tied_file(0),
                    {"keys": ["0.weight", "2.weight"], "param": tied, "optim": None})
    ckpt.commit(tmp_path, 1, {"num_layers": 3})
    state = ckpt.export_state_dict(tmp_path)
    fresh_emb = nn.Embedding(5, 3)
    model = nn.Sequential(fresh_emb, nn.Linear(3, 3), _Head(fresh_emb))
    model.load_state_dict(state, strict=True)
    assert torch.equal(model[0].weight, tied) and torch.equal(model[1].weight, layers[1].weight)
    (tmp_path / "step-00000001" / ckpt.layer_file(1)).unlink()
    with pytest.raises(ValueError, match=r"has no layer00001\.pt"):
        ckpt.export_state_dict(tmp_path)


# -- the trainer: a crash between the layer files and the commit -----------------------


@pytest.fixture
def one_rank() -> Iterator[None]:
    init_local(0, 1, free_port())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trainer() -> Trainer:
    spec = mlp()
    return Trainer(spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
                   TrainerConfig(global_batch=spec["global_batch"], device_id="solo:0"),
                   plan_source=StaticPlanSource([plan_from_dict(PLAN)]))


def _held(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.detach().clone() for i, m in trainer.held_layers.items()
            for k, v in m.state_dict().items()}


@pytest.mark.timeout(60)
def test_trainer_crash_before_commit_resumes_from_previous(
        tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _trainer()
    first.fit(1)
    first.save_checkpoint(tmp_path)
    at_epoch_1 = _held(first)
    first.fit(2)
    at_epoch_2 = _held(first)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("killed")

    with monkeypatch.context() as patch:  # every layer file written, then no commit
        patch.setattr(ckpt, "commit", crash)
        with pytest.raises(OSError, match="rank 0: OSError: killed"):
            first.save_checkpoint(tmp_path)
    leftover = ckpt.staging_dir(tmp_path, 8)
    assert sorted(p.name for p in leftover.iterdir()) == [ckpt.layer_file(i) for i in range(6)]
    assert ckpt.resolve(tmp_path) == tmp_path / "step-00000004"

    second = _trainer()
    meta = second.load_checkpoint(tmp_path)
    assert (meta["epoch"], meta["step"]) == (1, 4)
    second.poll_plan()  # the layers come from the step-4 commit, untouched by the crash
    assert _held(second).keys() == at_epoch_1.keys()
    assert all(torch.equal(v, at_epoch_1[k]) for k, v in _held(second).items())
    second.fit(2)
    second.save_checkpoint(tmp_path)
    assert not leftover.exists()
    assert (tmp_path / "latest").read_text().strip() == "step-00000008"
    exported = ckpt.export_state_dict(tmp_path)
    assert all(torch.equal(exported[k], v) for k, v in at_epoch_2.items())


# -- hetpilot export ---------------------------------------------------------------------


def _hetpilot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetpilot", *args], capture_output=True,
                          text=True, timeout=80)


@pytest.mark.timeout(90)
def test_export_command_loads_into_the_users_sequential(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    res = _hetpilot("train", "--model", "hetpilot.trainer.examples:mlp", "--plan", str(plan),
                    "--epochs", "2", "--device-id", "solo:0", "--checkpoint", str(tmp_path / "ck"))
    assert res.returncode == 0, res.stderr
    res = _hetpilot("export", str(tmp_path / "ck"), "--out", str(tmp_path / "model.pt"))
    assert res.returncode == 0, res.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    model = nn.Sequential(*(factory() for factory in mlp()["layers"]))
    model.load_state_dict(state, strict=True)
    commit = tmp_path / "ck" / "step-00000008"
    for i, layer in enumerate(model):
        saved = torch.load(commit / ckpt.layer_file(i), weights_only=True)["module"]
        assert saved.keys() == layer.state_dict().keys()
        for key, value in layer.state_dict().items():
            assert torch.equal(value, saved[key])

    (tmp_path / "empty").mkdir()
    res = _hetpilot("export", str(tmp_path / "empty"), "--out", str(tmp_path / "x.pt"))
    assert res.returncode == 2
    assert res.stderr.startswith("hetpilot: error: CKPT: no checkpoint in ")
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.pt").exists()


@pytest.mark.timeout(90)
def test_a_run_stopped_by_steps_between_saves_saves_where_it_stopped(tmp_path: Path) -> None:
    """--steps 3 mid-epoch (4 iterations an epoch), no --checkpoint-every: the last save was
    at step 0 and --resume silently redid the steps since (found by a helper's battery 6)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    res = _hetpilot("train", "--model", "hetpilot.trainer.examples:mlp", "--plan", str(plan),
                    "--epochs", "2", "--steps", "3", "--device-id", "solo:0",
                    "--checkpoint", str(tmp_path / "ck"))
    assert res.returncode == 0, res.stderr
    where = ckpt.resolve(tmp_path / "ck")
    assert where is not None and ckpt.read_meta(where)["step"] == 3
