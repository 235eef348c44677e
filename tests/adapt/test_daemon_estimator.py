"""The daemon plans with the estimator's predicted speeds and learns from stage timings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hetpilot.adapt.estimator import Recorded, SlowdownEstimator
from hetpilot.adapt.features import FEATURES, Workload
from hetpilot.adapt.online import Adapter
from hetpilot.daemon.config import DaemonConfig
from hetpilot.daemon.controlplane import ControlPlane
from hetpilot.daemon.records import (
    AgentRecord,
    AgentReport,
    DeviceInfo,
    DeviceReport,
    JobRecord,
    LinkReport,
    PlanRecord,
    StageTiming,
    TimingsRecord,
)
from hetpilot.daemon.store import MemoryStore

ROOT = Path(__file__).resolve().parents[2]


def _synthetic() -> Recorded:
    """Slowdown = 1 + 3 * colocated_load (a rule the forest can learn)."""
    rng = np.random.default_rng(0)
    n = 200
    X = rng.uniform(0, 1, (n, len(FEATURES)))
    s = 1.0 + 3.0 * X[:, FEATURES.index("colocated_load")]
    return Recorded(X, s, np.ones(n), s, ("x",) * n, np.arange(n, dtype=float),
                    np.arange(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=int))


def _adapter(trees: int = 20) -> Adapter:
    # all features at each split: the synthetic rule has one informative feature of many
    est = SlowdownEstimator(_synthetic(), n_estimators=trees, refit_every=4, background=False,
                            max_features=1.0, min_samples_leaf=3)
    adapter = Adapter(est, default_workload=Workload(gflop=1.0, param_mb=1.0, act_mb=1.0,
                                                     out_mb=1.0))
    assert adapter.wait_ready(60)
    return adapter


def _plane() -> tuple[ControlPlane, dict[str, str]]:
    """A control plane with hosts h0 and h1, and their registrations."""
    adapter = _adapter()
    plane = ControlPlane(MemoryStore(), DaemonConfig(state_dir="/tmp"), adapter=adapter)
    regs = {host: plane.members.register(AgentRecord(host=host, probe_address="", devices=(
        DeviceInfo(index="0", name="cpu", kind="cpu", tflops=10.0, memory_gb=16.0),)))[1]
        for host in ("h0", "h1")}
    return plane, regs


def _report(host: str, load: float, seq: int = 1) -> AgentReport:
    return AgentReport(agent_id=host, seq=seq, unix_ms=0, devices=(
        DeviceReport(index="0", tflops=10.0, memory_total_gb=16.0, memory_free_gb=8.0,
                     utilization=load, colocated_load=load, colocated_processes=1),),
        links=(LinkReport(peer_host="h1" if host == "h0" else "h0", gbps=10.0,
                          rtt_us=100.0 + seq),))


def test_observed_cluster_uses_predicted_speeds() -> None:
    plane, regs = _plane()
    plane.members.report(_report("h0", 0.9), regs["h0"])
    plane.members.report(_report("h1", 0.0), regs["h1"])
    by = plane.observed_cluster().by_id
    # the forest predicts slowdown ~ 1 + 3 * 0.9 on h0, ~1 on h1
    assert by["h0:0"].tflops < 4.0
    assert by["h1:0"].tflops > 7.0


def _job_with_plan(plane: ControlPlane) -> None:
    """Job j1 with plan version 1 on h0:0 and h1:0."""
    model_json = (ROOT / "examples" / "model.json").read_text()
    n_layers = len(json.loads(model_json)["layers"])
    rec = plane.store.create_job(JobRecord(
        job_id="j1", owner="o", name="t", state="running", global_batch=8, microbatch_size=4,
        schedules=("1f1b",), budgets={}, V=10.0, slot_s=1.0, model_json=model_json))
    plan = {"microbatch_size": 4, "schedule": "1f1b", "groups": [{"samples": 8, "stages": [
        {"device": "h0:0", "layers": [0, 5]}, {"device": "h1:0", "layers": [5, n_layers]}]}]}
    from hetpilot.daemon.records import JobStatus

    plane.store.record_slot(rec.job_id, status=JobStatus(slot=1, plan_version=1),
                            controller_state={}, plan=PlanRecord(
                                job_id="j1", version=1, slot=0, plan=plan, iteration_s=1.0,
                                costs={}, queues={}))


def _timings(it: int) -> TimingsRecord:
    return TimingsRecord(job_id="j1", rank=0, plan_version=1, iteration=it,
                         stages=(StageTiming(stage_index=0, device_id="h0:0", fwd_s=0.2,
                                             bwd_s=0.4, comm_s=0.0, samples_per_s=10.0),))


def test_stage_timings_feed_the_estimator() -> None:
    plane, regs = _plane()
    plane.members.report(_report("h0", 0.5), regs["h0"])
    plane.members.report(_report("h1", 0.0), regs["h1"])
    _job_with_plan(plane)
    for it in range(4):
        plane.stage_timings(_timings(it))
    assert plane.adapter.learned == 4
    err = plane.adapter.status()
    assert err["samples"] == 4 and err["fits"] >= 2  # refit every 4 samples (in this thread)
    # the trainer's reports became the history features of the next prediction
    work = plane.adapter._workload["h0:0"]
    hist = plane.adapter.history("h0:0", work)
    assert hist.stage_last_slowdown == pytest.approx(1.0)  # same time each iteration
    assert hist.device_last_slowdown == pytest.approx(1.0)
    assert plane.adapter.history("h1:0", work).stage_last_slowdown == 0.0  # never ran there


def test_stage_timings_parse_each_plan_version_once(monkeypatch: pytest.MonkeyPatch) -> None:
    plane, regs = _plane()
    plane.members.report(_report("h0", 0.5), regs["h0"])
    plane.members.report(_report("h1", 0.0), regs["h1"])
    _job_with_plan(plane)
    reads: list[tuple[str, int]] = []
    plans = plane.store.plans

    def counted(job_id: str, after_version: int = 0) -> list[PlanRecord]:
        reads.append((job_id, after_version))
        return plans(job_id, after_version)

    monkeypatch.setattr(plane.store, "plans", counted)
    for it in range(6):
        plane.stage_timings(_timings(it))
    assert plane.adapter.learned == 6  # every report was learnt ...
    assert reads == [("j1", 0)]  # ... from one read of plan version 1


def test_a_subnormal_stage_time_is_ignored_and_does_not_poison_later_timings() -> None:
    # A stage time of 5e-324 s is finite and >= 0, so the servicer takes it; as the
    # device's calibration it made every later slowdown infinite, and every prediction
    # for that device failed (the daemon fuzz campaign of 2026-11-24).
    adapter = _adapter(10)
    layers = json.loads((ROOT / "examples" / "model.json").read_text())["layers"]
    from hetpilot.planner.serde import model_from_dict

    model = model_from_dict({"name": "m", "layers": layers})
    inter = adapter.interference("h0", DeviceReport(index="0", tflops=10.0,
                                                    memory_total_gb=16.0, memory_free_gb=8.0),
                                 10.0)
    for t in (5e-324, 0.0, 0.5, 0.5, 1.0):
        adapter.learn("h0:0", inter, model.layers, 4, 8, t, 10.0)
    assert adapter.learned == 3  # the subnormal and the zero were not learnt
    work = adapter._workload["h0:0"]
    assert adapter.history("h0:0", work).stage_last_slowdown == pytest.approx(2.0)
    predicted = adapter.predict_tflops("h0:0", inter, 10.0)
    assert 0 < predicted <= 10.0
