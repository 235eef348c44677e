"""Streaming calls under client faults, on a real daemon (grpc.aio on an OS-chosen
port, SQLite in a temp dir): clients that go away while a large response is being
sent (a slow ``logs --follow`` that is cancelled, a killed trainer) end their call
quietly instead of an ERROR traceback per call in the daemon's log, and the
standard health service's Watch works through the daemon's interceptors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetpilot.v1 import agent_pb2, agent_pb2_grpc, job_pb2, job_pb2_grpc

from .conftest import CLUSTER_MD, OWNER_MD, RunningDaemon, start_daemon
from .helpers import register_request, report, submit_request

pytestmark = pytest.mark.timeout(90)
T = 10.0


@pytest.fixture
def d(tmp_path: Path) -> Iterator[RunningDaemon]:
    daemon = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0, rdzv_port_min=29831,
                          rdzv_port_max=29899)
    try:
        yield daemon
    finally:
        daemon.stop()


def _job_with_output(d: RunningDaemon, megabytes: int = 6) -> str:
    """A launched job (the test plays its agent) with ``megabytes`` MiB of output kept."""
    ch = d.channel()
    agents = agent_pb2_grpc.AgentServiceStub(ch)
    req = register_request("a", 1)
    req.launches = True
    registration = agents.Register(req, metadata=CLUSTER_MD, timeout=T).registration
    info = job_pb2_grpc.JobServiceStub(ch).SubmitJob(submit_request(entry=job_pb2.JobEntry(
        module="hetpilot", args=["train"], ranks_per_host=1, hosts=1)), metadata=OWNER_MD,
        timeout=T)
    line = b"[rank0]:" + b"x" * 1015 + b"\n"  # 1 KiB lines
    chunk = line * 1024  # 1 MiB
    for i in range(megabytes):
        rep = report("a", i + 1, 1, registration=registration)
        rep.launches.append(agent_pb2.LaunchStatus(
            launch_id=info.launch_id, job_id=info.job_id, pid=100,
            state=agent_pb2.LAUNCH_STATE_RUNNING))
        rep.logs.append(agent_pb2.LogChunk(launch_id=info.launch_id, offset=i * len(chunk),
                                           data=chunk))
        list(agents.Report(iter([rep]), metadata=CLUSTER_MD, timeout=T))
    return info.job_id


def test_clients_leaving_a_large_stream_end_it_without_an_error_logged(
        d: RunningDaemon, caplog: pytest.LogCaptureFixture) -> None:
    job_id = _job_with_output(d)
    caplog.set_level(logging.DEBUG, logger="grpc")

    async def slow_consumers() -> int:
        got = 0
        for _ in range(12):
            async with grpc.aio.insecure_channel(d.address) as ch:
                call = job_pb2_grpc.JobServiceStub(ch).StreamLogs(
                    job_pb2.StreamLogsRequest(job_id=job_id, follow=True), metadata=OWNER_MD)
                first = await call.read()  # then never read again: the daemon's send waits
                got += len(first.data)
                await asyncio.sleep(0.1)
                call.cancel()  # and the client goes away mid-send
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        return got

    assert asyncio.run(slow_consumers()) > 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors][:3]
    # the daemon is fine and the whole output is still there for a reader that reads
    data = b"".join(m.data for m in job_pb2_grpc.JobServiceStub(d.channel()).StreamLogs(
        job_pb2.StreamLogsRequest(job_id=job_id), metadata=OWNER_MD, timeout=30))
    assert len(data) == 6 * 1024 * 1024


def test_health_watch_answers_through_the_interceptors(d: RunningDaemon) -> None:
    stream = health_pb2_grpc.HealthStub(d.channel()).Watch(
        health_pb2.HealthCheckRequest(service=""), timeout=T)
    first = next(iter(stream))
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    stream.cancel()
