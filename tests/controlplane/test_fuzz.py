"""Hostile requests: hypothesis builds arbitrary request messages (NaN, empty
ids, unknown enum values, huge repeated fields) and the daemon must answer
each with OK or a client-error status, and stay up."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetpilot.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetpilot.channel import metadata

from .conftest import CLUSTER_MD, OWNER_MD, RunningDaemon, start_daemon

pytestmark = pytest.mark.timeout(120)
FZ_SECRET = "fuzz-host-secret-fz"
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED}

floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
text = st.one_of(st.just(""), st.text(max_size=20), st.sampled_from(["a", "a:0", "x" * 300]))
enum = st.integers(min_value=-5, max_value=10)

device_info = st.builds(agent_pb2.DeviceInfo, index=text, name=text, kind=enum, tflops=floats,
                        memory_gb=floats, price_per_hour=floats, power_watts=floats,
                        emulated=st.booleans())
register = st.builds(agent_pb2.RegisterRequest, host=text, probe_address=text,
                     host_secret=text | st.just("s" * 300), devices=st.lists(device_info, max_size=3) | st.just(
                         [agent_pb2.DeviceInfo(index="0", tflops=1, memory_gb=1)] * 70))
launch_status = st.builds(agent_pb2.LaunchStatus, launch_id=text, job_id=text, state=enum,
                          exit_code=st.integers(-2**31, 2**31 - 1), reason=text | st.just(
                              "r" * 2500), pid=st.integers(0, 2**32 - 1), stopped=st.booleans(),
                          log_bytes=st.integers(0, 2**64 - 1))
log_chunk = st.builds(agent_pb2.LogChunk, launch_id=text, offset=st.integers(0, 2**64 - 1),
                      data=st.binary(max_size=64) | st.just(b"\xff" * 60_000))
report = st.builds(agent_pb2.AgentReport, agent_id=st.sampled_from(["fz", "", "nobody"]),
                   seq=st.integers(0, 2**64 - 1),
                   devices=st.lists(st.builds(agent_pb2.DeviceReport, index=text, tflops=floats,
                                              utilization=floats, colocated_load=floats),
                                    max_size=3),
                   links=st.lists(st.builds(agent_pb2.LinkReport, peer_host=text, gbps=floats,
                                            rtt_us=floats), max_size=3)
                   | st.just([agent_pb2.LinkReport(peer_host="b", gbps=1)] * 2000),
                   launches=st.lists(launch_status, max_size=3),
                   logs=st.lists(log_chunk, max_size=3))
entry = st.builds(job_pb2.JobEntry, module=text | st.just("pkg.train"),
                  command=st.lists(text, max_size=3), args=st.lists(text, max_size=3)
                  | st.just(["x"] * 300), ranks_per_host=st.integers(0, 2**32 - 1),
                  hosts=st.integers(0, 2**32 - 1), restart_budget=st.integers(0, 2**32 - 1),
                  env=st.dictionaries(text, text, max_size=3), workdir=text | st.just("/w"))
submit = st.builds(job_pb2.SubmitJobRequest, name=text,
                   model_json=st.sampled_from(["", "{", "[]", '{"layers": []}', "NaN"]),
                   profile_on_attach=st.booleans(), global_batch=st.integers(0, 2**32 - 1),
                   microbatch_size=st.integers(0, 2**32 - 1),
                   schedules=st.lists(text, max_size=4),
                   budgets=st.dictionaries(st.sampled_from(["price_per_hour", "gold", ""]),
                                           floats, max_size=2),
                   v=floats, slot_s=floats, allowed_hosts=st.lists(text, max_size=3),
                   request_id=text, entry=st.none() | entry)
update = st.builds(job_pb2.UpdateBudgetsRequest, job_id=text,
                   budgets=st.dictionaries(st.sampled_from(["price_per_hour", "x"]), floats,
                                           max_size=2))
timings = st.builds(trainer_pb2.StageTimingsReport, job_id=text, rank=st.integers(0, 2**32 - 1),
                    stages=st.lists(st.builds(trainer_pb2.StageTiming, device_id=text,
                                              fwd_s=floats, samples_per_s=floats), max_size=3))


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory: pytest.TempPathFactory) -> RunningDaemon:
    d = start_daemon(tmp_path_factory.mktemp("fuzz"), max_message_bytes=64 * 1024)
    yield d  # type: ignore[misc]
    d.stop()


def _code(fn, req, md) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        fn(req, metadata=md, timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined,no-any-return]


SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(req=register)
def test_register(fuzz_daemon: RunningDaemon, req: agent_pb2.RegisterRequest) -> None:
    stub = agent_pb2_grpc.AgentServiceStub(fuzz_daemon.channel())
    assert _code(stub.Register, req, CLUSTER_MD) in ALLOWED


@SETTINGS
@given(reqs=st.lists(report, min_size=1, max_size=3))
def test_report_stream(fuzz_daemon: RunningDaemon, reqs: list[agent_pb2.AgentReport]) -> None:
    stub = agent_pb2_grpc.AgentServiceStub(fuzz_daemon.channel())
    registration = stub.Register(agent_pb2.RegisterRequest(host="fz", host_secret=FZ_SECRET, devices=[
        agent_pb2.DeviceInfo(index="0", kind=1, tflops=1, memory_gb=1)]), metadata=CLUSTER_MD,
        timeout=5).registration
    for req in reqs[:-1]:  # past the registration check, into the report's handling
        req.registration = registration
    try:
        list(stub.Report(iter(reqs), metadata=CLUSTER_MD, timeout=5))
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, exc  # type: ignore[attr-defined]


@SETTINGS
@given(req=submit)
def test_submit(fuzz_daemon: RunningDaemon, req: job_pb2.SubmitJobRequest) -> None:
    stub = job_pb2_grpc.JobServiceStub(fuzz_daemon.channel())
    assert _code(stub.SubmitJob, req, OWNER_MD) in ALLOWED


@SETTINGS
@given(req=update, treq=timings)
def test_update_and_timings(fuzz_daemon: RunningDaemon, req: job_pb2.UpdateBudgetsRequest,
                            treq: trainer_pb2.StageTimingsReport) -> None:
    ch = fuzz_daemon.channel()
    assert _code(job_pb2_grpc.JobServiceStub(ch).UpdateBudgets, req, OWNER_MD) in ALLOWED
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    token = job_pb2_grpc.JobServiceStub(ch).SubmitJob(  # a real job's trainer token
        job_pb2.SubmitJobRequest(profile_on_attach=True, global_batch=8, microbatch_size=1,
                                 request_id="fuzz-trainer"), metadata=OWNER_MD).trainer_token
    assert _code(trainer.ReportStageTimings, treq, metadata(token)) in ALLOWED


drain = st.builds(cluster_pb2.DrainHostRequest, host=text | st.just("fz"),
                  reason=text | st.just("r" * 600))
finish = st.builds(trainer_pb2.FinishJobRequest, job_id=text, outcome=enum,
                   reason=text | st.just("r" * 2500))


@SETTINGS
@given(req=drain, freq=finish, links=st.booleans())
def test_cluster_and_finish(fuzz_daemon: RunningDaemon, req: cluster_pb2.DrainHostRequest,
                            freq: trainer_pb2.FinishJobRequest, links: bool) -> None:
    ch = fuzz_daemon.channel()
    cluster = cluster_pb2_grpc.ClusterServiceStub(ch)
    assert _code(cluster.DrainHost, req, CLUSTER_MD) in ALLOWED
    assert _code(cluster.ResumeHost, cluster_pb2.ResumeHostRequest(host=req.host),
                 CLUSTER_MD) in ALLOWED
    assert _code(cluster.ForgetHost, cluster_pb2.ForgetHostRequest(host=req.host),
                 CLUSTER_MD) in ALLOWED
    assert _code(cluster.ListNodes, cluster_pb2.ListNodesRequest(links=links), OWNER_MD) == \
        grpc.StatusCode.OK
    token = job_pb2_grpc.JobServiceStub(ch).SubmitJob(
        job_pb2.SubmitJobRequest(profile_on_attach=True, global_batch=8, microbatch_size=1,
                                 request_id="fuzz-finish"), metadata=OWNER_MD).trainer_token
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    assert _code(trainer.FinishJob, freq, metadata(token)) in ALLOWED


logs = st.builds(job_pb2.StreamLogsRequest, job_id=text | st.just("fuzzjob"),
                 rank=st.none() | st.integers(0, 2**32 - 1), follow=st.just(False))


@SETTINGS
@given(req=logs)
def test_stream_logs(fuzz_daemon: RunningDaemon, req: job_pb2.StreamLogsRequest) -> None:
    jobs = job_pb2_grpc.JobServiceStub(fuzz_daemon.channel())
    launched = jobs.SubmitJob(job_pb2.SubmitJobRequest(  # a job with an entry point
        profile_on_attach=True, global_batch=8, microbatch_size=1, request_id="fuzz-logs",
        entry=job_pb2.JobEntry(module="m")), metadata=OWNER_MD)
    if req.job_id == "fuzzjob":
        req.job_id = launched.job_id
    try:
        list(jobs.StreamLogs(req, metadata=OWNER_MD, timeout=5))
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, exc  # type: ignore[attr-defined]


attach = st.builds(trainer_pb2.AttachRequest, job_id=st.just("fuzzjob") | text,
                   rank=st.integers(0, 2**32 - 1), world_size=st.integers(0, 2**32 - 1),
                   device_id=text, model_json=st.just("") | text,
                   layer_times=st.lists(st.builds(trainer_pb2.LayerTiming,
                                                  layer=st.integers(0, 2**32 - 1),
                                                  fwd_s=floats, bwd_s=floats), max_size=3),
                   measured_microbatch=st.integers(0, 2**32 - 1), measured_dtype=text,
                   link_times=st.lists(st.builds(trainer_pb2.LinkTiming, peer_device_id=text,
                                                 latency_s=floats, gbps=floats), max_size=3)
                   | st.just([trainer_pb2.LinkTiming(peer_device_id="a:1", gbps=1)] * 1100))


@SETTINGS
@given(req=attach)
def test_attach(fuzz_daemon: RunningDaemon, req: trainer_pb2.AttachRequest) -> None:
    ch = fuzz_daemon.channel()
    token = job_pb2_grpc.JobServiceStub(ch).SubmitJob(
        job_pb2.SubmitJobRequest(profile_on_attach=True, global_batch=8, microbatch_size=1,
                                 request_id="fuzz-attach"), metadata=OWNER_MD)
    if req.job_id == "fuzzjob":
        req.job_id = token.job_id
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    assert _code(trainer.Attach, req, metadata(token.trainer_token)) in ALLOWED


def test_still_serving_after_fuzz(fuzz_daemon: RunningDaemon) -> None:
    ch = fuzz_daemon.channel()
    oversized = job_pb2.SubmitJobRequest(model_json="x" * 100_000)
    assert _code(job_pb2_grpc.JobServiceStub(ch).SubmitJob, oversized, OWNER_MD) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    health = health_pb2_grpc.HealthStub(ch)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
