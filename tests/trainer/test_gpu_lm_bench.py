"""bench/gpu_lm.py (issue 14's GPU check) runs end to end: on this CPU in its --tiny
form, labelled as not a GPU, so a session with a GPU only has to run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_lm_bench_runs_on_a_cpu_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_lm.py"), "--tiny",
                          "--device", "cpu", "--steps", "2", "--warmup", "1", "--rounds", "2",
                          "--dtype", "bfloat16", "--json", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "NOT A GPU" in run.stderr
    assert "| hetpilot, one-stage plan |" in run.stdout and "predicted" in run.stdout
    figures = json.loads(out.read_text())
    assert figures["device"] == "CPU" and figures["peak_tflops"] is None
    assert all(figures[k] > 0 for k in ("plain_s", "hetpilot_s", "predicted_s",
                                        "fitted_tflops", "gflop_per_iteration"))
    assert len(figures["round_ratios"]) == 2 and len(figures["predictions_s"]) == 2
    # two rounds are two slots, fewer than a correction needs (three): the "corrected"
    # prediction, made again from the same layer times, is the first one
    assert "corrected from the stage timings (none due)" in run.stdout
    assert figures["corrections"] == []
    assert figures["corrected_s"] == pytest.approx(figures["predictions_s"][0], rel=1e-12)
