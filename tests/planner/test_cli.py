"""`hetpilot plan` and `hetpilot evaluate` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import example


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetpilot", *args], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name in ("cluster", "model", "plan"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(example(f"{name}.json")))
        out[name] = path
    return out


def test_plan_prints_only_a_valid_plan(files: dict[str, Path], tmp_path: Path) -> None:
    res = _run("plan", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--batch", "144", "--microbatch", "8")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)  # stdout is the plan and nothing else
    out = tmp_path / "p.json"
    out.write_text(res.stdout)
    ev = _run("evaluate", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
              "--plan", str(out), "--batch", "144")
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    assert result["valid"] is True
    assert result["iteration_s"] == pytest.approx(plan["predicted"]["iteration_s"], rel=1e-5)


def test_plan_writes_out_file(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "written.json"
    res = _run("plan", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--batch", "144", "--microbatch", "8", "--schedule", "gpipe", "--out", str(out))
    assert res.returncode == 0 and res.stdout == ""
    assert json.loads(out.read_text())["schedule"] == "gpipe"


def test_evaluate_example(files: dict[str, Path]) -> None:
    res = _run("evaluate", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--plan", str(files["plan"]))
    assert res.returncode == 0
    got, want = json.loads(res.stdout), example("plan.evaluation.json")
    assert list(got) == list(want)
    assert got["iteration_s"] == pytest.approx(want["iteration_s"], rel=1e-9)


def test_evaluate_invalid_plan_is_a_result(files: dict[str, Path], tmp_path: Path) -> None:
    plan = example("plan.json")
    plan["groups"][1]["stages"][1]["device"] = "c:0"  # used twice
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))
    res = _run("evaluate", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--plan", str(path))
    assert res.returncode == 0
    out = json.loads(res.stdout)
    assert out["valid"] is False and "plan.groups[1].stages[1].device" in out["error"]


@pytest.mark.parametrize("edit,field", [
    (lambda c, m: m["layers"][3].__setitem__("fwd_gflop", -1), "model.layers[3].fwd_gflop"),
    (lambda c, m: c["devices"][0].__setitem__("tflops", "fast"), "cluster.devices[0].tflops"),
    (lambda c, m: c["devices"][1].__setitem__("id", "a:0"), "cluster.devices[1].id"),
    (lambda c, m: m["layers"][1].__setitem__("kind_scale", {"V100": {"2": -1}}),
     "model.layers[1].kind_scale.V100.2"),
    (lambda c, m: c["devices"][2].__setitem__("kind", ""), "cluster.devices[2].kind"),
])
def test_bad_input_exits_2_with_one_line(files: dict[str, Path], edit, field: str) -> None:  # type: ignore[no-untyped-def]
    cluster, model = example("cluster.json"), example("model.json")
    edit(cluster, model)
    files["cluster"].write_text(json.dumps(cluster))
    files["model"].write_text(json.dumps(model))
    res = _run("plan", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--batch", "144", "--microbatch", "8")
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in res.stderr


def test_batch_not_divisible_exits_2(files: dict[str, Path]) -> None:
    res = _run("plan", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--batch", "100", "--microbatch", "8")
    assert res.returncode == 2 and res.stderr.startswith("hetpilot: error: --batch: must be a multiple of --microbatch 8")


def test_not_json_exits_2(files: dict[str, Path]) -> None:
    files["cluster"].write_text("{not json")
    res = _run("evaluate", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--plan", str(files["plan"]))
    assert res.returncode == 2 and res.stderr.startswith("hetpilot: error: --cluster:")


def test_nothing_fits_exits_3(files: dict[str, Path]) -> None:
    model = example("model.json")
    for layer in model["layers"]:
        layer["param_mb"] = 100_000.0
    files["model"].write_text(json.dumps(model))
    res = _run("plan", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--batch", "144", "--microbatch", "8")
    assert res.returncode == 3 and "no plan fits in memory" in res.stderr


@pytest.mark.parametrize("policy", ["even-dp", "uniform-pp", "megatron", "balanced-homogeneous"])
def test_baseline_policies(files: dict[str, Path], policy: str) -> None:
    res = _run("plan", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
               "--batch", "144", "--microbatch", "8", "--policy", policy)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["groups"]
