"""A launch ends with its host (issue 37.3, the daemon's side), with agents played
by the test over gRPC: a running job whose host goes silent past the heartbeat
timeout ends FAILED naming the host; its ranks there get the stop order when the
agent comes back; a cancel while the host is down says it waits for that host and
is carried out when it returns; an operator who forgets the host gives its part up."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hetpilot.v1 import cluster_pb2, cluster_pb2_grpc, job_pb2

from .conftest import CLUSTER_MD, OWNER_MD, RunningDaemon, start_daemon
from .helpers import submit_request, wait_until
from .test_launch_orders import Agents, T, _entry, _exited, _running

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def d(tmp_path) -> Iterator[RunningDaemon]:  # type: ignore[no-untyped-def]
    daemon = start_daemon(tmp_path / "state", heartbeat_timeout_s=1.0, rdzv_port_min=29861,
                          rdzv_port_max=29880)
    try:
        yield daemon
    finally:
        daemon.stop()


def _running_on_a(a: Agents) -> tuple[str, str]:
    """A one-host job launched on host a, which reports it running: (job id, launch id)."""
    a.register("a")
    info = a.jobs.SubmitJob(_submit(), metadata=OWNER_MD, timeout=T)
    assert [h.host for h in info.launch] == ["a"]
    [order] = a.report("a").start
    a.report("a", _running(order.launch_id, info.job_id))
    assert a.job(info.job_id).state == job_pb2.JOB_STATE_RUNNING
    return info.job_id, order.launch_id


def _submit() -> job_pb2.SubmitJobRequest:
    return submit_request(entry=_entry(hosts=1))


def _warning(info: job_pb2.JobInfo, head: str) -> str:
    return next((w for w in info.warnings if w.startswith(head)), "")


def test_a_running_job_whose_host_goes_down_fails_naming_it(d: RunningDaemon) -> None:
    a = Agents(d)
    job_id, launch_id = _running_on_a(a)
    # host a goes silent (its agent was killed): down after the heartbeat timeout
    info = wait_until("the job to end", lambda: (j := a.job(job_id)).state
                      != job_pb2.JOB_STATE_RUNNING and j)
    assert info.state == job_pb2.JOB_STATE_FAILED, info
    assert info.reason.startswith("host a lost: its agent was silent for over 1 s"), info.reason
    assert launch_id in info.reason and "not launched again" in info.reason
    # its part is as a last said (its ranks may still run there); the view says so
    assert info.launch[0].state == job_pb2.HOST_LAUNCH_STATE_RUNNING
    assert "stopping: waiting for host a (down" in _warning(info, "stopping:")
    # the agent comes back (with its secret) and still runs the launch: stopped at once
    a.register("a")
    assert list(a.report("a", _running(launch_id, job_id)).stop) == [launch_id]
    a.report("a", _exited(launch_id, job_id, -15, stopped=True))
    info = a.job(job_id)
    assert info.state == job_pb2.JOB_STATE_FAILED and info.reason.startswith("host a lost")
    assert info.launch[0].state == job_pb2.HOST_LAUNCH_STATE_EXITED and info.launch[0].stopped
    assert not _warning(info, "stopping:")


def test_a_cancel_while_the_host_is_down_waits_for_it_and_is_carried_out(
        d: RunningDaemon) -> None:
    a = Agents(d)
    job_id, launch_id = _running_on_a(a)
    # a goes silent; the owner cancels (before or after the daemon notices)
    a.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)
    info = wait_until("the job to say it waits for host a",
                      lambda: _warning(j := a.job(job_id), "cancelling: waiting for host a")
                      and j)
    assert info.state == job_pb2.JOB_STATE_CANCELLED
    assert "(down: its ranks are stopped when its agent comes back" in info.warnings[-1]
    # back: the stop order was kept for it
    a.register("a")
    assert list(a.report("a", _running(launch_id, job_id)).stop) == [launch_id]
    a.report("a", _exited(launch_id, job_id, -15, stopped=True))
    info = a.job(job_id)
    assert info.state == job_pb2.JOB_STATE_CANCELLED and info.launch[0].stopped
    assert not _warning(info, "cancelling:")


def test_forgetting_a_lost_host_gives_its_part_up(d: RunningDaemon) -> None:
    a = Agents(d)
    job_id, _ = _running_on_a(a)
    wait_until("the job to fail", lambda: a.job(job_id).state == job_pb2.JOB_STATE_FAILED)
    cluster_pb2_grpc.ClusterServiceStub(d.channel()).ForgetHost(
        cluster_pb2.ForgetHostRequest(host="a"), metadata=CLUSTER_MD, timeout=T)
    info = a.job(job_id)
    part = info.launch[0]
    assert part.state == job_pb2.HOST_LAUNCH_STATE_EXITED and part.exit_code == 255
    assert "forgotten by an operator" in part.reason
    assert not _warning(info, "stopping:") and info.reason.startswith("host a lost")


def test_after_a_daemon_restart_a_host_has_the_restart_grace_to_come_back(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Both hosts ran the job when the daemon stopped; after its start b comes back and
    a never does: the job fails naming a alone, and not before the restart grace."""
    state, ports = tmp_path / "state", dict(rdzv_port_min=29881, rdzv_port_max=29890)
    first = start_daemon(state, heartbeat_timeout_s=600.0, **ports)
    try:
        a = Agents(first)
        a.register("a")
        a.register("b")
        info = a.jobs.SubmitJob(submit_request(entry=_entry()), metadata=OWNER_MD, timeout=T)
        job_id, launch_id = info.job_id, info.launch_id
        a.report("a", _running(launch_id, job_id))
        a.report("b", _running(launch_id, job_id))
        assert a.job(job_id).state == job_pb2.JOB_STATE_RUNNING
    finally:
        first.stop()
    started = time.time()
    second = start_daemon(state, heartbeat_timeout_s=1.0, restart_grace_s=3.0, **ports)
    try:
        b = Agents(second)
        b.register("b")

        def ended() -> job_pb2.JobInfo | None:
            b.report("b", _running(launch_id, job_id))  # b reports all along
            j = b.job(job_id)
            return j if j.state != job_pb2.JOB_STATE_RUNNING else None

        info = wait_until("the job to end", ended)
        assert info.state == job_pb2.JOB_STATE_FAILED
        assert info.reason.startswith("host a lost"), info.reason
        assert info.ended_unix_ms >= (started + 3.0) * 1000  # a had its grace
        assert list(b.report("b", _running(launch_id, job_id)).stop) == [launch_id]
    finally:
        second.stop()
