"""The daemon's side of launching, with agents played by the test over gRPC:
which hosts a job is launched on, start orders repeated until the agent
reports the launch and never after (idempotent), stop orders, how exits end
the job (all 0: SUCCEEDED without any FinishJob; non-zero: FAILED with the
reason), output kept once per offset and streamed by rank."""

from __future__ import annotations

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

from .conftest import CLUSTER_MD, OTHER_MD, OWNER_MD, RunningDaemon, start_daemon
from .helpers import register_request, report, submit_request, wait_until

pytestmark = pytest.mark.timeout(60)
T = 5.0
RUNNING, EXITED = agent_pb2.LAUNCH_STATE_RUNNING, agent_pb2.LAUNCH_STATE_EXITED


@pytest.fixture
def d(tmp_path) -> Iterator[RunningDaemon]:  # type: ignore[no-untyped-def]
    daemon = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0, rdzv_port_min=29731,
                          rdzv_port_max=29799)
    try:
        yield daemon
    finally:
        daemon.stop()


class Agents:
    """Agents the test speaks for: each report is one short Report stream."""

    def __init__(self, d: RunningDaemon) -> None:
        ch = d.channel()
        self.stub = agent_pb2_grpc.AgentServiceStub(ch)
        self.jobs = job_pb2_grpc.JobServiceStub(ch)
        self.seq = 0
        self.registrations: dict[str, str] = {}

    def register(self, host: str, n: int = 2, launches: bool = True) -> None:
        req = register_request(host, n)
        req.launches = launches
        self.registrations[host] = self.stub.Register(req, metadata=CLUSTER_MD,
                                                      timeout=T).registration

    def report(self, host: str, *launches: agent_pb2.LaunchStatus,
               logs: tuple[agent_pb2.LogChunk, ...] = ()) -> agent_pb2.ReportAck:
        self.seq += 1
        req = report(host, self.seq, 2, registration=self.registrations.get(host, ""))
        req.launches.extend(launches)
        req.logs.extend(logs)
        [ack] = list(self.stub.Report(iter([req]), metadata=CLUSTER_MD, timeout=T))
        return ack

    def job(self, job_id: str) -> job_pb2.JobInfo:
        return self.jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD,
                                timeout=T)


def _entry(**kw: object) -> job_pb2.JobEntry:
    args: dict[str, object] = dict(module="hetpilot", args=["train", "--epochs", "1"],
                                   ranks_per_host=1, hosts=2, env={"A": "1"})
    args.update(kw)
    return job_pb2.JobEntry(**args)  # type: ignore[arg-type]


def _running(launch_id: str, job_id: str, pid: int = 100, **kw: object) -> agent_pb2.LaunchStatus:
    return agent_pb2.LaunchStatus(launch_id=launch_id, job_id=job_id, state=RUNNING, pid=pid,
                                  **kw)  # type: ignore[arg-type]


def _exited(launch_id: str, job_id: str, code: int, **kw: object) -> agent_pb2.LaunchStatus:
    return agent_pb2.LaunchStatus(launch_id=launch_id, job_id=job_id, state=EXITED,
                                  exit_code=code, pid=100, **kw)  # type: ignore[arg-type]


def _launched(a: Agents, **entry: object) -> tuple[str, str]:
    """Agents a and b, a job launched on both: (job id, launch id)."""
    a.register("a")
    a.register("b")
    info = a.jobs.SubmitJob(submit_request(entry=_entry(**entry)), metadata=OWNER_MD,
                            timeout=T)
    assert info.launch_id and [h.host for h in info.launch] == ["a", "b"]
    return info.job_id, info.launch_id


def test_start_orders_repeat_until_reported_then_never(d: RunningDaemon) -> None:
    a = Agents(d)
    job_id, launch_id = _launched(a)
    info = a.job(job_id)
    assert info.rdzv_endpoint.endswith(":29731") and info.launch[0].rdzv_host
    assert [list(h.devices) for h in info.launch] == [["a:0"], ["b:0"]]
    [order] = a.report("a").start
    assert (order.launch_id, order.job_id, order.nnodes, list(order.devices)) == (
        launch_id, job_id, 2, ["0"])
    assert order.rdzv_host and order.rdzv_endpoint == info.rdzv_endpoint
    assert order.module == "hetpilot" and list(order.args) == ["train", "--epochs", "1"]
    assert dict(order.env) == {"A": "1"} and order.max_restarts == 0
    assert order.trainer_token == info.trainer_token  # the ranks' own token, for this job
    # not reported yet (the ack was lost, the agent restarted): ordered again, the same
    assert list(a.report("a").start) == [order]
    # b waits until the store's host (a) runs: its port may still change until then
    assert not a.report("b").start
    # reported: never ordered again, whatever its state
    assert not a.report("a", _running(launch_id, job_id)).start
    assert not a.report("a", _running(launch_id, job_id)).start
    [order_b] = a.report("b").start
    assert not order_b.rdzv_host and order_b.rdzv_endpoint == order.rdzv_endpoint
    assert not a.report("b", _running(launch_id, job_id)).stop
    info = a.job(job_id)
    assert [h.state for h in info.launch] == [job_pb2.HOST_LAUNCH_STATE_RUNNING] * 2
    assert info.launch[0].pid == 100
    # the job plans on the launched devices only (each agent has two)
    info = wait_until("a plan", lambda: (j := a.job(job_id)).plan_version >= 1 and j)
    assert set(info.devices) <= {"a:0", "b:0"}


def test_every_host_exiting_zero_succeeds_without_finishjob(d: RunningDaemon) -> None:
    a = Agents(d)
    job_id, launch_id = _launched(a)
    a.report("a", _running(launch_id, job_id))
    a.report("b", _running(launch_id, job_id))
    a.report("a", _exited(launch_id, job_id, 0))
    assert a.job(job_id).state == job_pb2.JOB_STATE_RUNNING  # b still runs
    a.report("b", _exited(launch_id, job_id, 0))
    info = a.job(job_id)
    assert info.state == job_pb2.JOB_STATE_SUCCEEDED
    assert info.reason == "every rank exited with 0 (2 host(s))"
    assert [h.exit_code for h in info.launch] == [0, 0]


def test_a_host_dying_beyond_its_budget_fails_the_job_and_stops_the_rest(
        d: RunningDaemon) -> None:
    a = Agents(d)
    job_id, launch_id = _launched(a, restart_budget=2)
    a.report("a", _running(launch_id, job_id))
    a.report("b", _running(launch_id, job_id))
    ack = a.report("a", _exited(launch_id, job_id, 1, reason="[rank0]:RuntimeError: boom"))
    assert not ack.stop
    info = a.job(job_id)
    assert info.state == job_pb2.JOB_STATE_FAILED
    assert info.reason.startswith("host a: torchrun exited with code 1 (restart budget 2 "
                                  "spent)") and "boom" in info.reason
    # b still runs: stopped at its next report, and only until it says it is stopping
    assert list(a.report("b", _running(launch_id, job_id)).stop) == [launch_id]
    assert not a.report("b", _running(launch_id, job_id, stopped=True)).stop
    a.report("b", _exited(launch_id, job_id, -15, stopped=True))
    info = a.job(job_id)
    assert info.state == job_pb2.JOB_STATE_FAILED and info.launch[1].stopped


def test_cancel_stops_ranks_and_unknown_launches_are_stopped(d: RunningDaemon) -> None:
    a = Agents(d)
    job_id, launch_id = _launched(a)
    a.report("a", _running(launch_id, job_id))
    a.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)
    assert list(a.report("a", _running(launch_id, job_id)).stop) == [launch_id]
    # b was ordered but never said it started: it is not started any more
    ack = a.report("b")
    assert not ack.start and not ack.stop
    info = a.job(job_id)
    assert info.state == job_pb2.JOB_STATE_CANCELLED and info.launch[1].stopped
    assert list(a.report("a", _running("feedbeef0001", "nojob")).stop) == ["feedbeef0001"]


def test_launch_waits_for_enough_hosts_that_can(d: RunningDaemon) -> None:
    a = Agents(d)
    a.register("a")
    a.register("b", launches=False)  # --no-launch: never chosen
    a.register("c", n=1)  # too few devices for ranks_per_host = 2
    a.register("d")
    cluster = cluster_pb2_grpc.ClusterServiceStub(d.channel())
    cluster.DrainHost(cluster_pb2.DrainHostRequest(host="d"), metadata=CLUSTER_MD, timeout=T)
    info = a.jobs.SubmitJob(submit_request(entry=_entry(hosts=2, ranks_per_host=2)),
                            metadata=OWNER_MD, timeout=T)
    assert not info.launch and any("waiting for 2 host(s)" in w and "1 can now" in w
                                   for w in info.warnings), info.warnings
    a.register("e")
    info = wait_until("the launch", lambda: (j := a.job(info.job_id)).launch and j)
    assert [(h.host, list(h.devices)) for h in info.launch] == [
        ("a", ["a:0", "a:1"]), ("e", ["e:0", "e:1"])]
    assert not any("waiting" in w for w in info.warnings)


def test_output_is_kept_once_and_streamed_by_rank(d: RunningDaemon) -> None:
    a = Agents(d)
    job_id, launch_id = _launched(a)
    first = b"[rank0]:step 1\n[rank1]:step 1\ntorchrun says"
    more = b" hello\n[rank0]:done\n"

    def chunk(offset: int, data: bytes) -> agent_pb2.LogChunk:
        return agent_pb2.LogChunk(launch_id=launch_id, offset=offset, data=data)

    a.report("a", _running(launch_id, job_id), logs=(chunk(0, first),))
    a.report("a", _running(launch_id, job_id), logs=(chunk(0, first),))  # resent: kept once
    a.report("a", _running(launch_id, job_id),
             logs=(chunk(len(first) - 5, first[-5:] + more),))  # overlapping
    a.report("b", _running(launch_id, job_id), logs=(chunk(0, b"[rank1]:on b\n"),))

    def logs(**kw: object) -> list[tuple[str, bytes]]:
        req = job_pb2.StreamLogsRequest(job_id=job_id, **kw)  # type: ignore[arg-type]
        return [(m.host, m.data) for m in a.jobs.StreamLogs(req, metadata=OWNER_MD, timeout=T)]

    assert b"".join(data for host, data in logs() if host == "a") == first + more
    assert logs(rank=0) == [("a", b"[rank0]:step 1\n[rank0]:done\n")]
    assert logs(rank=1) == [("a", b"[rank1]:step 1\n"), ("b", b"[rank1]:on b\n")]
    # --follow: until the job has ended and every host's output has arrived
    follow = a.jobs.StreamLogs(job_pb2.StreamLogsRequest(job_id=job_id, rank=1, follow=True),
                               metadata=OWNER_MD, timeout=20)
    # each message says where in its host's output it ends (past lines skipped for rank)
    assert next(follow) == job_pb2.LogLines(host="a", data=b"[rank1]:step 1\n",
                                            end_offset=len(first + more))
    assert next(follow) == job_pb2.LogLines(host="b", data=b"[rank1]:on b\n", end_offset=13)
    tail = b"[rank1]:bye\n"
    a.report("b", _exited(launch_id, job_id, 0, log_bytes=13 + len(tail)))  # output not in yet
    a.report("a", _exited(launch_id, job_id, 0, log_bytes=len(first + more)))
    assert a.job(job_id).state == job_pb2.JOB_STATE_SUCCEEDED
    a.report("b", _exited(launch_id, job_id, 0, log_bytes=13 + len(tail)),
             logs=(chunk(13, tail),))
    assert list(follow) == [job_pb2.LogLines(host="b", data=tail, end_offset=13 + len(tail))]
    # resumed from offsets (a reconnect): each host from where it was left, others whole
    req = job_pb2.StreamLogsRequest(job_id=job_id, resume_from={"a": 15})
    got = [(m.host, m.data) for m in a.jobs.StreamLogs(req, metadata=OWNER_MD, timeout=T)]
    assert got == [("a", (first + more)[15:]), ("b", b"[rank1]:on b\n" + tail)]
    req = job_pb2.StreamLogsRequest(job_id=job_id, resume_from={"a": 63, "b": 13})
    got = [(m.host, m.data) for m in a.jobs.StreamLogs(req, metadata=OWNER_MD, timeout=T)]
    assert got == [("b", tail)]
    for bad, field in (({"no host": 1}, "resume_from (a host)"),
                       ({"a": 2**63}, "resume_from.a")):
        with pytest.raises(grpc.RpcError) as err:
            list(a.jobs.StreamLogs(job_pb2.StreamLogsRequest(job_id=job_id, resume_from=bad),
                                   metadata=OWNER_MD, timeout=T))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()
    # another owner's job is not found; a job without an entry point has no output here
    with pytest.raises(grpc.RpcError) as err:
        list(a.jobs.StreamLogs(job_pb2.StreamLogsRequest(job_id=job_id), metadata=OTHER_MD,
                               timeout=T))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:  # no token: refused in the stream's shape
        list(a.jobs.StreamLogs(job_pb2.StreamLogsRequest(job_id=job_id), timeout=T))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    plain = a.jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=T).job_id
    with pytest.raises(grpc.RpcError) as err:
        list(a.jobs.StreamLogs(job_pb2.StreamLogsRequest(job_id=plain), metadata=OWNER_MD,
                               timeout=T))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no entry point" in err.value.details()


def test_bad_entries_and_reports_are_refused_by_field(d: RunningDaemon) -> None:
    a = Agents(d)
    a.register("a")
    for entry, field in ((_entry(module=""), "entry"),
                         (_entry(command=["x"]), "entry"),
                         (_entry(module="not a module"), "entry.module"),
                         (_entry(module="", command=["--nproc-per-node=3", "echo"]),
                          "entry.command[0]"),
                         (_entry(env={"HETPILOT_JOB_ID": "x"}), "entry.env.HETPILOT_JOB_ID"),
                         (_entry(workdir="rel/dir"), "entry.workdir"),
                         (_entry(ranks_per_host=65), "entry.ranks_per_host")):
        with pytest.raises(grpc.RpcError) as err:
            a.jobs.SubmitJob(submit_request(entry=entry), metadata=OWNER_MD, timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()
    for st, field in ((agent_pb2.LaunchStatus(launch_id="", job_id="j", state=RUNNING),
                       "launches[0].launch_id"),
                      (agent_pb2.LaunchStatus(launch_id="l", job_id="j", state=0),
                       "launches[0].state")):
        with pytest.raises(grpc.RpcError) as err:
            a.report("a", st)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        a.report("a", logs=(agent_pb2.LogChunk(launch_id="l", data=b"x" * (3 << 20)),))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _busy(launch_id: str, job_id: str, port: int) -> agent_pb2.LaunchStatus:
    return _exited(launch_id, job_id, 127, rdzv_port_busy=port,
                   reason=f"rendezvous port {port} is in use on a")


def test_a_busy_rendezvous_port_moves_the_launch_then_fails_it(d: RunningDaemon) -> None:
    """The store's host (a) finds the port in use: the daemon orders the launch again
    with the next port, b only once a runs; a refusal of an old port changes nothing;
    after RDZV_TRIES busy ports the job fails naming them."""
    a = Agents(d)
    job_id, launch_id = _launched(a)
    [order] = a.report("a").start
    assert order.rdzv_endpoint.endswith(":29731")
    [order] = a.report("a", _busy(launch_id, job_id, 29731)).start  # in the same ack
    assert order.launch_id == launch_id and order.rdzv_endpoint.endswith(":29732")
    assert a.job(job_id).rdzv_endpoint.endswith(":29732")
    # the refusal again (its ack was lost): old news, the order stays at 29732
    [order] = a.report("a", _busy(launch_id, job_id, 29731)).start
    assert order.rdzv_endpoint.endswith(":29732")
    assert not a.report("b").start  # not before a runs
    assert not a.report("a", _running(launch_id, job_id)).start
    [order_b] = a.report("b").start
    assert order_b.rdzv_endpoint.endswith(":29732")
    assert a.job(job_id).state == job_pb2.JOB_STATE_RUNNING
    # a running launch's port no longer moves
    a.report("a", _busy(launch_id, job_id, 29732))
    assert a.job(job_id).rdzv_endpoint.endswith(":29732")

    # a second job whose store's host finds every port it tries in use
    info = a.jobs.SubmitJob(submit_request(entry=_entry()), metadata=OWNER_MD, timeout=T)
    job2, launch2 = info.job_id, info.launch_id
    ports = []
    for _ in range(5):  # RDZV_TRIES
        port = int(a.job(job2).rdzv_endpoint.rpartition(":")[2])
        assert port != 29732  # held by the first launch
        ports.append(port)
        a.report("a", _running(launch_id, job_id), _busy(launch2, job2, port))
    info = a.job(job2)
    assert info.state == job_pb2.JOB_STATE_FAILED, info.reason
    assert info.reason.startswith(f"host a: could not start: rendezvous port {ports[-1]} is "
                                  "in use on a (tried " + ", ".join(map(str, ports)))
    assert len(set(ports)) == 5 and info.launch[1].stopped  # b was never ordered
    assert not a.report("b", _running(launch_id, job_id)).start


def test_no_port_left_fails_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0, rdzv_port_min=29800,
                     rdzv_port_max=29800)
    try:
        a = Agents(d)
        a.register("a")
        info = a.jobs.SubmitJob(submit_request(entry=_entry(hosts=1)), metadata=OWNER_MD,
                                timeout=T)
        job_id, launch_id = info.job_id, info.launch_id
        a.report("a", _busy(launch_id, job_id, 29800))
        info = a.job(job_id)
        assert info.state == job_pb2.JOB_STATE_FAILED
        assert "rendezvous port 29800 is in use on a (tried 29800 of 29800-29800" in info.reason
        with pytest.raises(grpc.RpcError) as err:  # a port that is no port
            a.report("a", _busy(launch_id, job_id, 70000))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("launches[0].rdzv_port_busy")
    finally:
        d.stop()
