"""Hostile values the fault and fuzz campaign found (issue 13.2, 13.3): each is
refused with INVALID_ARGUMENT naming the field, nothing is stored, and the
owner's later calls still work."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import grpc
import pytest
from hetpilot.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
)

from hetpilot.channel import metadata

from .conftest import CLUSTER_MD, OWNER_MD, RunningDaemon
from .helpers import model_json, register_request, submit_request

pytestmark = pytest.mark.timeout(120)
T = 10.0


def _model(**changes: object) -> str:
    data = json.loads(model_json())
    data.update(changes)
    return json.dumps(data)


def _refused(call: grpc.UnaryUnaryMultiCallable, request: object, md: object) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(request, metadata=md, timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, err.value)
    details = err.value.details() or ""
    assert len(details) < 1200
    return details


def test_hostile_job_values_are_refused_by_name_and_store_nothing(daemon: RunningDaemon) -> None:
    jobs = job_pb2_grpc.JobServiceStub(daemon.channel())
    layer = json.loads(model_json())["layers"][0]
    deep = "[" * 999 + "]" * 999
    cases = {
        "surrogate": submit_request(  # the JSON escape of a lone UTF-16 surrogate
            model_json=model_json().replace('"bert-base"', '"\\ud800"')),
        "model_json.layers[0].fwd_gflop": submit_request(model_json=_model(
            layers=[{**layer, "fwd_gflop": 10**400}])),
        "nested too deeply": submit_request(model_json='{"name": "x", "layers": ' + deep + "}"),
        "model_json.layers": submit_request(model_json=_model(layers=[layer] * 5000)),
        "global_batch": submit_request(global_batch=2**32 - 1, microbatch_size=1),
        "slot_s": submit_request(slot_s=1e-9),
    }
    for field, request in cases.items():
        assert field in _refused(jobs.SubmitJob, request, OWNER_MD)
    listed = jobs.ListJobs(job_pb2.ListJobsRequest(include_cancelled=True), metadata=OWNER_MD,
                           timeout=T)
    assert list(listed.jobs) == []  # nothing was created, and listing still works


def test_hostile_ids_and_versions(daemon: RunningDaemon) -> None:
    ch = daemon.channel()
    jobs = job_pb2_grpc.JobServiceStub(ch)
    agents = agent_pb2_grpc.AgentServiceStub(ch)
    assert "job_id" in _refused(jobs.GetJob, job_pb2.GetJobRequest(job_id="j" * 1_000_000),
                                OWNER_MD)
    assert "host" in _refused(agents.Register, register_request("h1\n"), CLUSTER_MD)
    # host "a" with device "b:0" would be device id "a:b:0", which is host "a:b"'s device 0
    colliding = register_request("a")
    colliding.devices[0].index = "b:0"
    assert "devices[0].index: must not contain ':'" in _refused(agents.Register, colliding,
                                                                CLUSTER_MD)
    job = jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=T)
    for version in (2**63, 2**64 - 1):
        stream = jobs.WatchPlans(job_pb2.WatchPlansRequest(job_id=job.job_id,
                                                           after_version=version),
                                 metadata=OWNER_MD, timeout=T)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stream))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "after_version" in (err.value.details() or "")


def test_undecodable_payloads_are_invalid_and_logged_once(
        daemon: RunningDaemon, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    ch = daemon.channel()
    raw = ch.unary_unary("/hetpilot.v1.JobService/SubmitJob")  # bytes in, bytes out
    for _ in range(20):
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\x0f\x01garbage", metadata=OWNER_MD, timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad_utf8 = job_pb2.GetJobRequest(job_id="x").SerializeToString().replace(b"x", b"\xed")
    with pytest.raises(grpc.RpcError) as err:
        ch.unary_unary("/hetpilot.v1.JobService/GetJob")(bad_utf8, metadata=OWNER_MD, timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert not [r for r in caplog.records if "Traceback" in r.getMessage() or r.exc_info]


def test_refused_report_streams_answer_unauthenticated_not_internal(
        daemon: RunningDaemon) -> None:
    from .conftest import OTHER_MD
    from .helpers import report

    agents = agent_pb2_grpc.AgentServiceStub(daemon.channel())
    codes = []

    def reports(i: int) -> Iterator[agent_pb2.AgentReport]:
        yield report("h", i)
        time.sleep(0.02)  # the stream stays open, as an agent's does

    for i in range(100):  # grpc's core answered INTERNAL to about 1 in 4 before
        with pytest.raises(grpc.RpcError) as err:
            list(agents.Report(reports(i), metadata=OTHER_MD, timeout=T))
        codes.append(err.value.code())
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}


def test_timings_with_versions_past_int64_are_invalid(daemon: RunningDaemon) -> None:
    from hetpilot.v1 import trainer_pb2, trainer_pb2_grpc

    ch = daemon.channel()
    job = job_pb2_grpc.JobServiceStub(ch).SubmitJob(submit_request(), metadata=OWNER_MD,
                                                     timeout=T)
    trainer = trainer_pb2_grpc.TrainerServiceStub(ch)
    for field in ("plan_version", "iteration"):
        request = trainer_pb2.StageTimingsReport(job_id=job.job_id, rank=0, **{field: 2**63})
        assert field in _refused(trainer.ReportStageTimings, request,
                                 metadata(job.trainer_token))


def test_a_second_machine_under_a_live_hosts_name_is_refused(daemon: RunningDaemon) -> None:
    # a cloned VM or a mistyped --host: its reports would stand for the first agent's,
    # and the first's running launches, missing from them, would count as exited
    ch = daemon.channel()
    agents = agent_pb2_grpc.AgentServiceStub(ch)
    agents.Register(register_request("gpu1", probe="10.0.0.1:7071"), metadata=CLUSTER_MD,
                    timeout=T)
    with pytest.raises(grpc.RpcError) as err:
        agents.Register(register_request("gpu1", probe="10.0.0.2:7071"), metadata=CLUSTER_MD,
                        timeout=T)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details() or ""
    assert "'gpu1'" in details and "10.0.0.1:7071" in details and "10.0.0.2:7071" in details
    nodes = cluster_pb2_grpc.ClusterServiceStub(ch).ListNodes(cluster_pb2.ListNodesRequest(),
                                                             metadata=CLUSTER_MD, timeout=T)
    assert [(n.host, n.probe_address) for n in nodes.nodes] == [("gpu1", "10.0.0.1:7071")]
    # the same machine's agent restarting registers again
    agents.Register(register_request("gpu1", probe="10.0.0.1:7071"), metadata=CLUSTER_MD,
                    timeout=T)
