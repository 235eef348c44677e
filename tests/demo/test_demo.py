"""``hetpilot demo`` end to end as a real subprocess (shortened), and its clean-up.

The run is 3 epochs per phase: the slowdown lands at epoch 2, the throttle at
epoch 3. Each test is bounded (pytest-timeout and the subprocess timeout).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _alive(pid: int) -> bool:
    """The process or any member of its process group still exists (zombies count as gone)."""
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _children(out: Path) -> list[dict]:
    path = out / "run" / "pids.json"
    return json.loads(path.read_text()) if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_demo_runs_replans_reports_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "hetpilot", "demo", "--quick", "--epochs", "3", "--out", str(out),
         "--no-live", "--timeout", "70"],
        capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "EMULATED" in proc.stdout and "hetpilot vs static" in proc.stdout
    report = (out / "report.md").read_text()
    assert "EMULATED" in report and "## Headline" in report
    for png in ("iteration_time.png", "plans.png", "accuracy.png", "cost.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png})" in report
    summary = json.loads((out / "summary.json").read_text())
    # the daemon re-planned once the slowdown was reported (plan version increased)
    assert summary["daemon_versions"] >= 2, summary["plans"]
    assert len(summary["plans"]) == summary["daemon_versions"]
    assert [r["epoch"] for r in summary["static"]] == [0, 1, 2]
    assert [r["epoch"] for r in summary["hetpilot"]] == [0, 1, 2]
    assert all(r["accuracy"] is not None for r in summary["static"] + summary["hetpilot"])
    # the trainer felt the same EMULATED events the agents reported: on the static plan the
    # 8x slower hostA:0 doubles the iteration (its 16 samples now take 8x longer than the
    # nominal bottleneck hostC:0's), and the throttled links add spec 5.3's all-reduce time
    it = [r["iteration_s"] for r in summary["static"]]
    assert it[1] > 1.5 * it[0] and it[2] > it[1] + 0.03, it
    children = _children(out)
    assert {c["name"] for c in children} >= {"daemon", "agent-hostA", "static-rank0",
                                             "hetpilot-rank3"}
    assert not [c for c in children if _alive(c["pid"])]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_stops_every_process(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetpilot", "demo", "--quick", "--out", str(out), "--no-live"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not any(c["name"] == "static-rank3" for c in _children(out)):
            assert proc.poll() is None and time.monotonic() < deadline, "ranks never started"
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    children = _children(out)
    assert len(children) == 8  # daemon, 3 agents, 4 ranks
    assert not [c for c in children if _alive(c["pid"])]
