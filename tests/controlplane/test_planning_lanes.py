"""The daemon's planning lanes: a job whose solves are long does not hold up the others'
(daemon/planner_process.py; the daemon fuzz campaign of 2026-11-24 found two jobs at the
documented limits stopping every other job's slots for minutes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hetpilot.daemon import planner_process as planning
from hetpilot.daemon.planner_process import PlannerProcess
from hetpilot.daemon.records import JobRecord
from hetpilot.planner.serde import cluster_from_dict

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
MODEL = json.loads((Path(__file__).resolve().parents[2] / "examples" / "model.json").read_text())
CLUSTER = cluster_from_dict({
    "devices": [{"id": f"h{h}:{i}", "host": f"h{h}", "tflops": 50.0, "memory_gb": 24.0}
                for h in range(4) for i in range(8)],
    "network": {"intra_host_gbps": 100.0, "inter_host_gbps": 25.0}})


def _job(job_id: str, layers: int) -> JobRecord:
    model = {**MODEL, "layers": [dict(MODEL["layers"][1], name=f"l{i}") for i in range(layers)]}
    return JobRecord(job_id=job_id, owner="o", name=job_id, state="running", global_batch=64,
                     microbatch_size=1, schedules=("1f1b", "gpipe"), budgets={}, V=10.0,
                     slot_s=0.5, model_json=json.dumps(model))


def test_a_small_job_plans_while_a_large_one_solves() -> None:
    big, small = _job("big", 256), _job("small", 4)  # 256 x 32 devices: heavy at once

    async def run() -> tuple[list[str], PlannerProcess]:
        planner = PlannerProcess()
        done: list[str] = []
        gens = {"big": -1, "small": -1}

        async def step(rec: JobRecord) -> None:
            _, gens[rec.job_id] = await planner.step(rec.job_id, rec, None, gens[rec.job_id],
                                                     None, CLUSTER)
            done.append(rec.job_id)

        try:
            await step(small)  # the light lane's process is up and warm
            done.clear()
            await asyncio.gather(step(big), step(small), step(small))
            return done, planner
        finally:
            planner.close()

    done, planner = asyncio.run(run())
    assert planner.lane("big") == "heavy" and planner.lane("small") == "light"
    assert done == ["small", "small", "big"], done  # the small job's slots did not wait


def test_a_job_moves_lanes_by_its_warm_solve_times_and_keeps_its_controller_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _job("j", 4)
    inf = float("inf")

    async def run() -> list[tuple[str | None, int]]:
        planner = PlannerProcess()
        seen: list[tuple[str | None, int]] = []
        gen, state = -1, None
        try:
            # every solve "long" for the light lane, then every one "short"
            for limits in ((0.0, 1e9, inf),) * 3 + ((1e9, 1e9, inf),) * 2:
                monkeypatch.setattr(planning, "LIMITS", limits)
                out, gen = await planner.step("j", rec, state, gen, None, CLUSTER)
                state = out.state
                seen.append((planner.lane("j"), out.slot))
            return seen
        finally:
            planner.close()

    seen = asyncio.run(run())
    # the first step builds the controller (cold: not counted); the second, warm, is past
    # the light lane's limit; the third is cold again, in the heavy lane (rebuilt from the
    # state); the fourth is short there, so the fifth is light again
    assert [lane for lane, _ in seen] == ["light", "light", "heavy", "heavy", "light"]
    assert [slot for _, slot in seen] == [0, 1, 2, 3, 4]


def test_lane_rules() -> None:
    assert planning._lane_for(0.1, 0) == 0
    assert planning._lane_for(3.0, 0) == 1 and planning._lane_for(40.0, 0) == 2
    assert planning._lane_for(1.9, 1) == 1  # under the light limit, but not by a quarter
    assert planning._lane_for(0.4, 1) == 0 and planning._lane_for(0.4, 2) == 0
    assert planning._lane_for(10.0, 2) == 2 and planning._lane_for(4.0, 2) == 1


def test_a_planning_process_whose_daemon_is_gone_ends_even_if_it_went_while_starting() -> None:
    # the watch compared getppid() with getppid() taken as the process started: a daemon
    # that ended before then left it watching init for ever (sleeping planning processes
    # hours old were found on the test machine)
    import os
    import subprocess
    import sys
    import time

    code = ("import sys, time; from hetpilot.daemon.planner_process import _start; "
            "_start(0, int(sys.argv[1])); time.sleep(60)")
    gone = subprocess.run([sys.executable, "-c", code, "999999999"], timeout=60)
    assert gone.returncode == 0  # ended by the watch, long before its sleep
    alive = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())])
    try:
        time.sleep(3)
        assert alive.poll() is None  # its daemon (this process) is here: it stays
    finally:
        alive.kill()
        alive.wait(10)
