"""A job's end against a real daemon: FinishJob (SUCCEEDED, FAILED with a reason),
what an ended job refuses, a failed job's trainer coming back, the cost so far,
allowed_hosts naming unknown hosts, and what the daemon logs at INFO."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hetpilot.v1 import (
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from hetpilot.channel import metadata

from .conftest import CLUSTER_MD, OWNER_MD, RunningDaemon, start_daemon
from .helpers import register_request, report, submit_request, wait_until

pytestmark = pytest.mark.timeout(90)
T = 5.0
SUCCEEDED, FAILED = trainer_pb2.JOB_OUTCOME_SUCCEEDED, trainer_pb2.JOB_OUTCOME_FAILED




def _refused(call: Callable[[], Any], code: grpc.StatusCode, text: str = "") -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert text in err.value.details()


class _Job:
    """One submitted job, its owner's and its trainer's stubs."""

    def __init__(self, daemon: RunningDaemon, **kw: Any) -> None:
        ch = daemon.channel()
        self.jobs = job_pb2_grpc.JobServiceStub(ch)
        self.trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
        self.info = self.jobs.SubmitJob(submit_request(**kw), metadata=OWNER_MD, timeout=T)
        self.id = self.info.job_id
        self.md = metadata(self.info.trainer_token)

    def get(self) -> job_pb2.JobInfo:
        return self.jobs.GetJob(job_pb2.GetJobRequest(job_id=self.id), metadata=OWNER_MD,
                                timeout=T)

    def finish(self, outcome: int, reason: str = "") -> trainer_pb2.FinishJobResponse:
        return self.trainer.FinishJob(trainer_pb2.FinishJobRequest(
            job_id=self.id, outcome=outcome, reason=reason),  # type: ignore[arg-type]
            metadata=self.md, timeout=T)

    def attach(self) -> trainer_pb2.AttachResponse:
        return self.trainer.Attach(trainer_pb2.AttachRequest(job_id=self.id, rank=0,
                                                             device_id="a:0"),
                                   metadata=self.md, timeout=T)


def _up(daemon: RunningDaemon) -> None:
    agents = agent_pb2_grpc.AgentServiceStub(daemon.channel())
    reg = agents.Register(register_request("a", 2, price=3.0), metadata=CLUSTER_MD, timeout=T)
    list(agents.Report(iter([report("a", 1, 2, registration=reg.registration)]),
                       metadata=CLUSTER_MD, timeout=T))


@pytest.fixture
def steady(tmp_path: Path) -> Iterator[RunningDaemon]:
    """A daemon whose agents stay up without heartbeats (so slots keep coming)."""
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        yield d
    finally:
        d.stop()


def test_finish_succeeded_and_failed(steady: RunningDaemon) -> None:
    daemon = steady
    _up(daemon)
    ok, bad = _Job(daemon, name="ok"), _Job(daemon, name="bad")
    for job in (ok, bad):
        wait_until("a plan", lambda j=job: j.get().plan_version >= 1)
    ok.attach()
    started = ok.get().started_unix_ms
    assert started > 0 and not bad.get().started_unix_ms
    # the cost counts from the first Attach: 2 devices at $3/h
    spent = wait_until("cost so far", lambda: ok.get().cost_so_far.get("price_per_hour"))
    assert 0 < spent < 6.0 * (time.time() * 1000 - started) / 3.6e6 * 1.5

    stream = ok.jobs.WatchPlans(job_pb2.WatchPlansRequest(job_id=ok.id), metadata=OWNER_MD,
                                timeout=30)
    assert ok.finish(SUCCEEDED).outcome == SUCCEEDED
    assert [pv.version for pv in stream]  # the plan stream ends with the job
    info = ok.get()
    assert info.state == job_pb2.JOB_STATE_SUCCEEDED and info.reason == "finished"
    assert info.ended_unix_ms >= info.started_unix_ms > 0
    assert ok.finish(SUCCEEDED).outcome == SUCCEEDED  # idempotent (a retried call)
    slot = info.slot
    time.sleep(1.0)  # the control loop stopped: no more slots
    assert ok.get().slot == slot

    reason = "RuntimeError: CUDA out of memory on rank 3"
    assert bad.finish(FAILED, reason).outcome == FAILED
    info = bad.get()
    assert info.state == job_pb2.JOB_STATE_FAILED and info.reason == reason
    assert bad.finish(FAILED, "another reason").outcome == FAILED  # the first reason stays
    assert bad.get().reason == reason
    # ended jobs are listed (only cancelled ones are left out by default)
    listed = ok.jobs.ListJobs(job_pb2.ListJobsRequest(), metadata=OWNER_MD, timeout=T)
    assert {j.job_id: j.state for j in listed.jobs} == {
        ok.id: job_pb2.JOB_STATE_SUCCEEDED, bad.id: job_pb2.JOB_STATE_FAILED}

    # what an ended job refuses
    _refused(lambda: ok.finish(FAILED, "late"), grpc.StatusCode.FAILED_PRECONDITION, "succeeded")
    _refused(ok.attach, grpc.StatusCode.FAILED_PRECONDITION, "succeeded")
    _refused(lambda: ok.jobs.UpdateBudgets(job_pb2.UpdateBudgetsRequest(job_id=ok.id, v=2.0),
                                           metadata=OWNER_MD, timeout=T),
             grpc.StatusCode.FAILED_PRECONDITION, "ended")
    _refused(lambda: ok.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=ok.id),
                                       metadata=OWNER_MD, timeout=T),
             grpc.StatusCode.FAILED_PRECONDITION, "succeeded")
    _refused(lambda: bad.finish(SUCCEEDED), grpc.StatusCode.FAILED_PRECONDITION, "failed")

    # a failed job's trainer attaching again (a torchrun restart) runs it again
    bad.attach()
    info = bad.get()
    assert info.state == job_pb2.JOB_STATE_RUNNING and not info.reason
    assert not info.ended_unix_ms
    slot = info.slot
    wait_until("slots again", lambda: bad.get().slot > slot)


def test_a_cancelled_job_cannot_be_finished(daemon: RunningDaemon) -> None:
    job = _Job(daemon)
    job.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=job.id), metadata=OWNER_MD, timeout=T)
    for outcome in (SUCCEEDED, FAILED):
        _refused(lambda o=outcome: job.finish(o), grpc.StatusCode.FAILED_PRECONDITION,
                 "cancelled")
    info = job.get()
    assert info.state == job_pb2.JOB_STATE_CANCELLED and info.ended_unix_ms > 0
    assert info.reason == "cancelled by the owner"


def test_finish_refuses_bad_requests_by_field(daemon: RunningDaemon) -> None:
    job, other = _Job(daemon), _Job(daemon)
    for req, field in (
            (trainer_pb2.FinishJobRequest(job_id=job.id), "outcome"),
            (trainer_pb2.FinishJobRequest(job_id=job.id, outcome=FAILED, reason="x" * 2001),
             "reason"),
            (trainer_pb2.FinishJobRequest(job_id="", outcome=FAILED), "job_id")):
        _refused(lambda r=req: job.trainer.FinishJob(r, metadata=job.md, timeout=T),
                 grpc.StatusCode.INVALID_ARGUMENT, field)
    # a trainer token finishes its own job only; an owner's token is no trainer's
    _refused(lambda: job.trainer.FinishJob(trainer_pb2.FinishJobRequest(
        job_id=other.id, outcome=SUCCEEDED), metadata=job.md, timeout=T),
        grpc.StatusCode.PERMISSION_DENIED)
    _refused(lambda: job.trainer.FinishJob(trainer_pb2.FinishJobRequest(
        job_id=job.id, outcome=SUCCEEDED), metadata=OWNER_MD, timeout=T),
        grpc.StatusCode.UNAUTHENTICATED)
    assert job.get().state == job_pb2.JOB_STATE_RUNNING


def test_allowed_hosts_naming_unknown_hosts_warn(daemon: RunningDaemon) -> None:
    _up(daemon)
    job = _Job(daemon, allowed_hosts=["a", "gpu-typo"])
    [warning] = [w for w in job.info.warnings if "allowed_hosts" in w]
    assert "gpu-typo" in warning and "'a'" not in warning and "plans on the others" in warning
    assert any("gpu-typo" in w for w in job.get().warnings)  # in the job's warnings too
    none = _Job(daemon, allowed_hosts=["x1", "x2"])
    [warning] = [w for w in none.info.warnings if "allowed_hosts" in w]
    assert "x1, x2" in warning and "none of them is known" in warning
    # it goes once an agent registers under the name
    agent_pb2_grpc.AgentServiceStub(daemon.channel()).Register(
        register_request("gpu-typo"), metadata=CLUSTER_MD, timeout=T)
    assert not any("allowed_hosts" in w for w in job.get().warnings)


def test_the_daemon_logs_what_happens(daemon: RunningDaemon,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hetpilot.daemon")
    _up(daemon)
    job = _Job(daemon, name="logged")
    wait_until("a plan", lambda: job.get().plan_version >= 1)
    cluster = cluster_pb2_grpc.ClusterServiceStub(daemon.channel())
    cluster.DrainHost(cluster_pb2.DrainHostRequest(host="a", reason="maintenance"),
                      metadata=CLUSTER_MD, timeout=T)
    cluster.ResumeHost(cluster_pb2.ResumeHostRequest(host="a"), metadata=CLUSTER_MD, timeout=T)
    job.finish(SUCCEEDED)
    other = _Job(daemon, name="cancelled")
    other.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=other.id), metadata=OWNER_MD, timeout=T)
    # the agent stops reporting: after the heartbeat timeout (1 s here) it has left
    wait_until("agent a left", lambda: "agent a left" in caplog.text, timeout=10)
    text = caplog.text
    for expected in (f"job {job.id} submitted by alice: 'logged'", "agent a joined: 2 device(s)",
                     f"job {job.id}: plan v1 (slot 0): predicted iteration",
                     "on 2 device(s)", "host a drained (maintenance)", "host a resumed",
                     f"job {job.id} succeeded: finished",
                     f"job {other.id} cancelled: cancelled by the owner"):
        assert expected in text, expected
    assert all(r.levelno == logging.INFO for r in caplog.records
               if "submitted" in r.getMessage() or "plan v1" in r.getMessage())


def test_a_job_waiting_for_devices_plans_when_an_agent_joins(daemon: RunningDaemon) -> None:
    job = _Job(daemon, slot_s=60.0)  # no agent yet: the first slot finds no device
    wait_until("the first slot", lambda: "no devices are up" in job.get().warnings)
    _up(daemon)  # not a minute later: at once
    wait_until("a plan", lambda: job.get().plan_version >= 1, timeout=15)
