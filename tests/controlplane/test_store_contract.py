"""One contract, two stores: MemoryStore and SqliteStore behave the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hetpilot.daemon.records import (
    AgentRecord,
    AgentReport,
    DeviceInfo,
    DeviceReport,
    JobRecord,
    JobStatus,
    LinkReport,
    PlanRecord,
    StageTiming,
    TimingsRecord,
)
from hetpilot.daemon.store import MemoryStore, SqliteStore, Store

pytestmark = pytest.mark.timeout(30)


def _job(job_id: str, owner: str = "alice", request_id: str = "") -> JobRecord:
    return JobRecord(job_id=job_id, owner=owner, name="n", state="running", global_batch=8,
                     microbatch_size=2, schedules=("1f1b",), budgets={"price_per_hour": 3.0},
                     V=10.0, slot_s=1.0, allowed_hosts=("a",), model_json="{}",
                     request_id=request_id)


def _plan(job_id: str, version: int) -> PlanRecord:
    return PlanRecord(job_id=job_id, version=version, slot=version, plan={"groups": []},
                      iteration_s=0.5, costs={"price_per_hour": 1.0},
                      queues={"price_per_hour": 0.0}, warnings=("w",))


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "s.db")
    yield s
    s.close()


def test_jobs(store: Store) -> None:
    a = store.create_job(_job("j1", request_id="r"))
    assert store.create_job(_job("j2", request_id="r")) == a  # same owner + request id
    store.create_job(_job("j3", owner="bob", request_id="r"))
    store.create_job(_job("j4"))
    assert [j.job_id for j in store.list_jobs("alice")] == ["j1", "j4"]
    assert [j.job_id for j in store.list_jobs()] == ["j1", "j3", "j4"]
    assert store.get_job("j1") == a and store.get_job("nope") is None
    store.update_job(a.with_changes(state="cancelled", V=2.0))
    assert store.get_job("j1") == a.with_changes(state="cancelled", V=2.0)
    with pytest.raises(KeyError):
        store.update_job(_job("missing"))


def test_slots_and_plans(store: Store) -> None:
    store.create_job(_job("j1"))
    assert store.job_status("j1") == (JobStatus(), None)
    status = JobStatus(slot=1, plan_version=1, iteration_s=0.5, costs={"price_per_hour": 1.0},
                       cost_sums={"price_per_hour": 1.0}, queues={"price_per_hour": 0.2},
                       devices=("a:0",))
    store.record_slot("j1", status=status, controller_state={"q": [1, 2]}, plan=_plan("j1", 1))
    store.record_slot("j1", status=status, controller_state={"q": [3]})
    store.record_slot("j1", status=status, controller_state={"q": [4]}, plan=_plan("j1", 2))
    assert store.job_status("j1") == (status, {"q": [4]})
    assert [p.version for p in store.plans("j1")] == [1, 2]
    assert store.plans("j1", 1) == [_plan("j1", 2)]
    assert store.plans("other") == []


def test_agents_reports_timings(store: Store) -> None:
    agent = AgentRecord(host="a", probe_address="a:1", devices=(
        DeviceInfo(index="0", name="x", kind="emulated", tflops=1.0, memory_gb=2.0,
                   emulated=True),))
    store.put_agent(agent)
    store.put_agent(agent)
    assert store.agents() == [agent]
    r1 = AgentReport(agent_id="a", seq=1, unix_ms=5,
                     devices=(DeviceReport(index="0", tflops=1.5),),
                     links=(LinkReport(peer_host="b", gbps=9.0, rtt_us=40.0),))
    store.put_report(r1)
    store.put_report(AgentReport(agent_id="a", seq=2, unix_ms=6))
    assert store.latest_reports()["a"].seq == 2
    t = TimingsRecord(job_id="j", rank=0, plan_version=1, iteration=2, stages=(
        StageTiming(stage_index=0, device_id="a:0", fwd_s=1, bwd_s=2, comm_s=0,
                    samples_per_s=3),))
    store.put_timings(t)
    assert store.latest_timings("j") == [t]


def test_sqlite_survives_reopen(tmp_path: Path) -> None:
    s = SqliteStore(tmp_path / "s.db")
    s.create_job(_job("j1"))
    s.record_slot("j1", status=JobStatus(slot=3), controller_state={"x": 1}, plan=_plan("j1", 1))
    # no close(): as after kill -9, the WAL holds what was committed
    s2 = SqliteStore(tmp_path / "s.db")
    assert s2.get_job("j1") == _job("j1")
    assert s2.job_status("j1") == (JobStatus(slot=3), {"x": 1})
    assert [p.version for p in s2.plans("j1")] == [1]
    s2.close()
