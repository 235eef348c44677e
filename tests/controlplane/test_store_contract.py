"""One contract, two stores: MemoryStore and SqliteStore behave the same."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from hetpilot.daemon.records import (
    AgentRecord,
    AgentReport,
    DeviceInfo,
    DeviceReport,
    DrainRecord,
    HostLaunch,
    JobProgress,
    JobRecord,
    JobStatus,
    LaunchRecord,
    LayerTime,
    LinkReport,
    MeasurementRecord,
    PlanRecord,
    StageTiming,
    TimingsRecord,
)
from hetpilot.daemon.sqlite_schema import MIGRATIONS, SCHEMA_VERSION, SchemaError
from hetpilot.daemon.sqlite_store import SqliteStore
from hetpilot.daemon.store import MemoryStore, Store

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


def test_a_batch_of_reports_is_kept_in_one_commit(store: Store) -> None:
    store.put_report(AgentReport(agent_id="c", seq=1, unix_ms=1))
    store.put_reports([AgentReport(agent_id="a", seq=1, unix_ms=5),
                       AgentReport(agent_id="b", seq=7, unix_ms=5),
                       AgentReport(agent_id="a", seq=2, unix_ms=6)])  # later wins
    store.put_reports([])
    assert {k: r.seq for k, r in store.latest_reports().items()} == {"a": 2, "b": 7, "c": 1}


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


def test_timings_and_progress(store: Store) -> None:
    assert store.progress("j") == JobProgress()
    t = TimingsRecord(job_id="j", rank=1, plan_version=1, iteration=8, stages=(), unix_ms=7,
                      loss=0.25, eval_metric=-1.5)
    progress = JobProgress(loss=0.25, loss_step=8, loss_unix_ms=7, eval_metric=-1.5,
                           eval_step=8)
    store.put_timings(t, progress)
    assert store.latest_timings("j") == [t] and store.progress("j") == progress
    t2 = TimingsRecord(job_id="j", rank=1, plan_version=1, iteration=9, stages=())
    store.put_timings(t2)  # no progress: the stored one stays
    assert store.latest_timings("j") == [t2] and store.progress("j") == progress
    assert store.progress("other") == JobProgress()
    # a diverged run's NaN / inf round-trips
    store.put_timings(t2, JobProgress(loss=math.nan, loss_step=9, eval_metric=math.inf))
    got = store.progress("j")
    assert math.isnan(got.loss or 0.0) and got.eval_metric == math.inf and got.loss_step == 9


def test_measurements(store: Store) -> None:
    def measured(device: str, fwd: float, unix_ms: int) -> MeasurementRecord:
        return MeasurementRecord(job_id="j", device_id=device, rank=0, microbatch=4,
                                 dtype="bfloat16", layers=(LayerTime(layer=0, fwd_s=fwd,
                                                                     bwd_s=2 * fwd),),
                                 ref_tflops=50.0, unix_ms=unix_ms)

    assert store.measurements("j") == []
    store.put_measurement(measured("b:0", 0.2, 1))
    store.put_measurement(measured("a:0", 0.1, 2))
    store.put_measurement(measured("a:0", 0.3, 3))  # the latest per (job, device)
    assert store.measurements("j") == [measured("a:0", 0.3, 3), measured("b:0", 0.2, 1)]
    assert store.measurements("other") == []


def test_drains(store: Store) -> None:
    assert store.drains() == []
    b, a = DrainRecord(host="b", since_ms=5, reason="disk"), DrainRecord(host="a", since_ms=6)
    store.put_drain(b)
    store.put_drain(a)
    assert store.drains() == [a, b]  # by host
    store.put_drain(DrainRecord(host="b", since_ms=7))  # replaces
    store.delete_drain("a")
    store.delete_drain("never-drained")  # a no-op
    assert store.drains() == [DrainRecord(host="b", since_ms=7)]


def test_job_end_and_cost_fields_round_trip(store: Store) -> None:
    job = _job("j1").with_changes(state="failed", started_ms=5, ended_ms=9, reason="OOM")
    store.create_job(job)
    assert store.get_job("j1") == job and store.get_job("j1").ended  # type: ignore[union-attr]
    status = JobStatus(slot=2, costs={"price_per_hour": 2.0}, spent={"price_per_hour": 0.5},
                       updated_ms=8)
    store.record_slot("j1", status=status, controller_state={})
    assert store.job_status("j1")[0] == status


def _launch(job_id: str, launch_id: str, state: str = "ordered") -> LaunchRecord:
    return LaunchRecord(launch_id=launch_id, job_id=job_id, rdzv_endpoint="10.0.0.1:29400",
                        hosts=(HostLaunch(host="a", devices=("0", "1"), rdzv_host=True,
                                          state=state, pid=7),
                               HostLaunch(host="b", devices=("0",))), created_ms=3)


def test_launches(store: Store) -> None:
    assert store.launches() == [] and store.launches("j1") == []
    first, other = _launch("j1", "L1"), _launch("j2", "L2")
    store.put_launch(first)
    store.put_launch(other)
    assert store.launches() == [first, other] and store.launches("j2") == [other]
    done = first.with_host(HostLaunch(host="b", devices=("0",), state="exited", exit_code=-15,
                                      stopped=True, reason="x\ny", log_bytes=12))
    store.put_launch(done)  # replaced in place: creation order kept
    assert store.launches() == [done, other] and store.launches("j1")[0].hosts[1].exit_code == -15
    assert done.device_ids() == {"a:0", "a:1", "b:0"} and done.rdzv_port == 29400
    job = _job("j3").with_changes(entry={"module": "m", "args": ["--x"], "env": {"A": "1"}})
    store.create_job(job)
    assert store.get_job("j3") == job


# The schema of the daemon before schema versions (user_version 0), verbatim.
_UNVERSIONED_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, request_id TEXT NOT NULL,
  body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_owner_request ON jobs(owner, request_id);
CREATE TABLE IF NOT EXISTS job_status (
  job_id TEXT PRIMARY KEY, status TEXT NOT NULL, controller_state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS plans (
  job_id TEXT NOT NULL, version INTEGER NOT NULL, body TEXT NOT NULL,
  PRIMARY KEY (job_id, version));
CREATE TABLE IF NOT EXISTS agents (host TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reports (agent_id TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS timings (
  job_id TEXT NOT NULL, rank INTEGER NOT NULL, body TEXT NOT NULL,
  PRIMARY KEY (job_id, rank));
"""


def test_sqlite_migrates_an_unversioned_database(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    old = sqlite3.connect(path)
    old.executescript(_UNVERSIONED_SCHEMA)
    job, status = _job("j1"), JobStatus(slot=3, plan_version=1)
    agent = AgentRecord(host="a", probe_address="", devices=(
        DeviceInfo(index="0", name="x", kind="cpu", tflops=1.0, memory_gb=2.0),))
    # a timings body as the old daemon wrote it: no loss, no eval_metric
    old_timings = {"job_id": "j1", "rank": 0, "plan_version": 1, "iteration": 4, "unix_ms": 9,
                   "stages": [{"stage_index": 0, "device_id": "a:0", "fwd_s": 1.0,
                               "bwd_s": 2.0, "comm_s": 0.0, "samples_per_s": 3.0}]}
    # job and status bodies as the daemon wrote them before issue 16 (no end, no cost)
    old_job = {k: v for k, v in json.loads(job.to_json()).items()
               if k not in ("started_ms", "ended_ms", "reason")}
    old_status = {k: v for k, v in json.loads(status.to_json()).items()
                  if k not in ("spent", "updated_ms")}
    with old:
        old.execute("INSERT INTO jobs(job_id, owner, request_id, body) VALUES (?,?,?,?)",
                    ("j1", "alice", "", json.dumps(old_job)))
        old.execute("INSERT INTO job_status VALUES (?,?,?)",
                    ("j1", json.dumps(old_status), '{"x": 1}'))
        old.execute("INSERT INTO plans VALUES (?,?,?)", ("j1", 1, _plan("j1", 1).to_json()))
        old.execute("INSERT INTO agents VALUES (?,?)", ("a", agent.to_json()))
        old.execute("INSERT INTO reports VALUES (?,?)",
                    ("a", AgentReport(agent_id="a", seq=5, unix_ms=1).to_json()))
        old.execute("INSERT INTO timings VALUES (?,?,?)", ("j1", 0, json.dumps(old_timings)))
    old.close()

    s = SqliteStore(path)
    assert s.schema_version == SCHEMA_VERSION == 5
    # nothing stored before is lost
    assert s.get_job("j1") == job and s.job_status("j1") == (status, {"x": 1})
    assert s.plans("j1") == [_plan("j1", 1)] and s.agents() == [agent]
    assert s.latest_reports()["a"].seq == 5
    [t] = s.latest_timings("j1")
    assert (t.iteration, t.stages[0].fwd_s, t.loss, t.eval_metric) == (4, 1.0, None, None)
    assert s.progress("j1") == JobProgress()
    # a job and a slot status stored before issue 16 read back with its new fields empty
    assert (job.started_ms, job.ended_ms, job.reason, job.ended) == (0, 0, "", False)
    assert s.job_status("j1")[0].spent == {} and s.drains() == []
    # and the new tables work
    s.put_drain(DrainRecord(host="a", since_ms=1))
    progress = JobProgress(loss=0.5, loss_step=5)
    s.put_timings(TimingsRecord(job_id="j1", rank=0, plan_version=1, iteration=5, stages=(),
                                loss=0.5), progress)
    s.close()
    s = SqliteStore(path)  # opening a current database again changes nothing
    assert s.schema_version == SCHEMA_VERSION and s.progress("j1") == progress
    assert s.drains() == [DrainRecord(host="a", since_ms=1)]
    assert s.get_job("j1") == job and s.latest_timings("j1")[0].loss == 0.5
    s.close()


def test_sqlite_migrates_a_version_4_database(tmp_path: Path) -> None:
    """A daemon of schema 4 (before launches) left jobs, agents and drains: version 5
    keeps them all, reads their bodies with the new fields empty, and launches work."""
    path = tmp_path / "state.db"
    old = sqlite3.connect(path)
    for step in MIGRATIONS[:4]:  # released steps never change: this is schema 4
        for statement in step:
            old.execute(statement)
    old.execute("PRAGMA user_version=4")
    job = _job("j1").with_changes(state="succeeded", started_ms=2, ended_ms=5, reason="finished")
    old_job = {k: v for k, v in json.loads(job.to_json()).items() if k != "entry"}
    agent = AgentRecord(host="a", probe_address="a:7071", devices=(
        DeviceInfo(index="0", name="x", kind="cuda", tflops=100.0, memory_gb=80.0),))
    old_agent = {k: v for k, v in json.loads(agent.to_json()).items() if k != "launches"}
    with old:
        old.execute("INSERT INTO jobs(job_id, owner, request_id, body) VALUES (?,?,?,?)",
                    ("j1", "alice", "", json.dumps(old_job)))
        old.execute("INSERT INTO agents VALUES (?,?)", ("a", json.dumps(old_agent)))
        old.execute("INSERT INTO drains VALUES (?,?)",
                    ("a", DrainRecord(host="a", since_ms=4, reason="r").to_json()))
    old.close()
    s = SqliteStore(path)
    assert s.schema_version == SCHEMA_VERSION == 5
    assert s.get_job("j1") == job and job.entry == {}
    assert s.agents() == [agent] and not agent.launches
    assert s.drains() == [DrainRecord(host="a", since_ms=4, reason="r")]
    s.put_launch(_launch("j1", "L1"))
    s.close()
    s = SqliteStore(path)
    assert s.launches("j1") == [_launch("j1", "L1")] and s.get_job("j1") == job
    s.close()


def test_sqlite_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    SqliteStore(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        SqliteStore(path)
