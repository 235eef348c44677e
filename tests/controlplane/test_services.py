"""JobService, AgentService and TrainerService against a real in-process daemon."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetpilot.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from hetpilot.channel import metadata

from .conftest import CLUSTER_MD, OTHER_MD, OWNER_MD, RunningDaemon
from .helpers import register_request, report, submit_request

pytestmark = pytest.mark.timeout(60)
T = 5.0  # deadline of every call


def _wait_version(jobs: job_pb2_grpc.JobServiceStub, job_id: str, at_least: int = 1,
                  timeout: float = 20.0) -> job_pb2.JobInfo:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)
        if info.plan_version >= at_least:
            return info
        time.sleep(0.1)
    raise AssertionError(f"no plan version {at_least}: {info}")


def test_job_lifecycle_with_agents(daemon: RunningDaemon) -> None:
    ch = daemon.channel()
    agents = agent_pb2_grpc.AgentServiceStub(ch)
    jobs = job_pb2_grpc.JobServiceStub(ch)
    regs = {}
    for host in ("a", "b"):
        resp = agents.Register(register_request(host, 2), metadata=CLUSTER_MD, timeout=T)
        assert resp.heartbeat_timeout_s == daemon.config.heartbeat_timeout_s
        regs[host] = resp.registration
    acks = list(agents.Report(iter([report("a", 1, 2, registration=regs["a"]),
                                    report("b", 1, 2, registration=regs["b"])]),
                              metadata=CLUSTER_MD, timeout=T))
    assert [a.seq for a in acks] == [1, 1]
    info = jobs.SubmitJob(submit_request(request_id="r1"), metadata=OWNER_MD, timeout=T)
    assert info.owner == "alice" and info.state == job_pb2.JOB_STATE_RUNNING
    again = jobs.SubmitJob(submit_request(request_id="r1"), metadata=OWNER_MD, timeout=T)
    assert again.job_id == info.job_id  # idempotent submit
    info = _wait_version(jobs, info.job_id)
    assert info.devices and set(info.emulated_devices) == set(info.devices)
    assert info.iteration_s > 0
    stream = jobs.WatchPlans(job_pb2.WatchPlansRequest(job_id=info.job_id), metadata=OWNER_MD,
                             timeout=T)
    first = next(stream)
    stream.cancel()
    assert first.version == 1 and json.loads(first.plan_json)["groups"]
    # budgets and V
    info = jobs.UpdateBudgets(job_pb2.UpdateBudgetsRequest(
        job_id=info.job_id, budgets={"price_per_hour": 2.0}, v=5.0), metadata=OWNER_MD, timeout=T)
    assert info.budgets["price_per_hour"] == 2.0 and info.v == 5.0
    with pytest.raises(grpc.RpcError) as err:  # below MIN_BUDGET: refused, nothing changed
        jobs.UpdateBudgets(job_pb2.UpdateBudgetsRequest(
            job_id=info.job_id, budgets={"power_watts": 1e-300}), metadata=OWNER_MD, timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "budgets.power_watts" in (err.value.details() or "")
    kept = jobs.GetJob(job_pb2.GetJobRequest(job_id=info.job_id), metadata=OWNER_MD, timeout=T)
    assert dict(kept.budgets) == {"price_per_hour": 2.0}
    listed = jobs.ListJobs(job_pb2.ListJobsRequest(), metadata=OWNER_MD, timeout=T)
    assert [j.job_id for j in listed.jobs] == [info.job_id]
    assert not jobs.ListJobs(job_pb2.ListJobsRequest(), metadata=OTHER_MD, timeout=T).jobs
    # trainer
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    trainer_md = metadata(info.trainer_token)
    att = trainer.Attach(trainer_pb2.AttachRequest(job_id=info.job_id, rank=0, device_id="a:0"),
                         metadata=trainer_md, timeout=T)
    assert att.plan.version >= 1
    trainer.ReportStageTimings(trainer_pb2.StageTimingsReport(
        job_id=info.job_id, rank=0, plan_version=1, iteration=3,
        stages=[trainer_pb2.StageTiming(stage_index=0, device_id="a:0", fwd_s=0.1, bwd_s=0.2,
                                        comm_s=0.01, samples_per_s=100.0)]),
        metadata=trainer_md, timeout=T)
    cancelled = jobs.CancelJob(job_pb2.CancelJobRequest(job_id=info.job_id), metadata=OWNER_MD,
                               timeout=T)
    assert cancelled.state == job_pb2.JOB_STATE_CANCELLED
    # a watcher of a cancelled job gets the stored versions and the stream ends
    versions = list(jobs.WatchPlans(job_pb2.WatchPlansRequest(job_id=info.job_id),
                                    metadata=OWNER_MD, timeout=T))
    assert versions and versions[0].version == 1
    with urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=T) as resp:
        text = resp.read().decode()
    assert "hetpilot_reports_received_total 2.0" in text
    assert "hetpilot_slot_solve_seconds_count" in text


def test_auth(daemon: RunningDaemon) -> None:
    ch = daemon.channel()
    jobs = job_pb2_grpc.JobServiceStub(ch)
    agents = agent_pb2_grpc.AgentServiceStub(ch)
    for md in ((), (("authorization", "Bearer wrong-token"),), CLUSTER_MD):
        with pytest.raises(grpc.RpcError) as err:
            jobs.ListJobs(job_pb2.ListJobsRequest(), metadata=md, timeout=T)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        agents.Register(register_request("x"), metadata=OWNER_MD, timeout=T)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        list(jobs.WatchPlans(job_pb2.WatchPlansRequest(job_id="x"), timeout=T))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    info = jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=T)
    for call, req in ((jobs.GetJob, job_pb2.GetJobRequest(job_id=info.job_id)),
                      (jobs.CancelJob, job_pb2.CancelJobRequest(job_id=info.job_id)),
                      (jobs.UpdateBudgets, job_pb2.UpdateBudgetsRequest(job_id=info.job_id))):
        with pytest.raises(grpc.RpcError) as err:
            call(req, metadata=OTHER_MD, timeout=T)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # trainer tokens are scoped to their job (issue 13.6): the cluster token, an owner's
    # token and a forged one are refused; job A's token is refused on job B
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    other = jobs.SubmitJob(submit_request(), metadata=OTHER_MD, timeout=T)
    attach = trainer_pb2.AttachRequest(job_id=other.job_id, rank=0, device_id="a:0")
    forged = info.trainer_token.replace(info.job_id, other.job_id)
    for md in (CLUSTER_MD, OWNER_MD, metadata(forged)):
        with pytest.raises(grpc.RpcError) as err:
            trainer.Attach(attach, metadata=md, timeout=T)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for call, req in ((trainer.Attach, attach),
                      (trainer.ReportStageTimings, trainer_pb2.StageTimingsReport(
                          job_id=other.job_id, rank=0))):
        with pytest.raises(grpc.RpcError) as err:
            call(req, metadata=metadata(info.trainer_token), timeout=T)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        next(iter(trainer.WatchPlans(trainer_pb2.TrainerWatchRequest(job_id=other.job_id),
                                     metadata=metadata(info.trainer_token), timeout=T)))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert trainer.Attach(attach, metadata=metadata(other.trainer_token), timeout=T)
    with pytest.raises(grpc.RpcError) as err:  # a trainer token is no agent's
        agents.Heartbeat(agent_pb2.HeartbeatRequest(agent_id="x"),
                         metadata=metadata(info.trainer_token), timeout=T)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # health stays open for probes
    health = health_pb2_grpc.HealthStub(ch)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=T).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_bad_requests(daemon: RunningDaemon) -> None:
    ch = daemon.channel()
    jobs = job_pb2_grpc.JobServiceStub(ch)
    agents = agent_pb2_grpc.AgentServiceStub(ch)
    cases = [
        (jobs.GetJob, job_pb2.GetJobRequest(job_id=""), OWNER_MD),
        (jobs.SubmitJob, submit_request(global_batch=10, microbatch_size=4), OWNER_MD),
        (jobs.SubmitJob, submit_request(model_json="{"), OWNER_MD),
        (jobs.SubmitJob, submit_request(budgets={"gold": 1.0}), OWNER_MD),
        (jobs.SubmitJob, submit_request(budgets={"power_watts": 1e-300}), OWNER_MD),
        (jobs.SubmitJob, submit_request(v=float("nan")), OWNER_MD),
        (agents.Register, register_request("a", tflops=float("nan")), CLUSTER_MD),
        (agents.Register, register_request("bad host"), CLUSTER_MD),
    ]
    for call, req, md in cases:
        with pytest.raises(grpc.RpcError) as err:
            call(req, metadata=md, timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
    with pytest.raises(grpc.RpcError) as err:
        agents.Register(register_request("a", n=65), metadata=CLUSTER_MD, timeout=T)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as err:
        jobs.SubmitJob(submit_request(model_json="x" * (5 * 1024 * 1024)), metadata=OWNER_MD,
                       timeout=T)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # a report from an agent that never registered
    with pytest.raises(grpc.RpcError) as err:
        list(agents.Report(iter([report("ghost", 1)]), metadata=CLUSTER_MD, timeout=T))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
