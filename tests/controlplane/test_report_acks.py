"""Cumulative report acks (issue 37.9): a report that says ``ack_later`` is committed
and covered by a later ack, never acked before its commit; older agents get an ack per
report; a daemon that stops ends report streams at once (UNAVAILABLE, after a last
ack covering what it took), and the agent says so in one line and reconnects."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hetpilot.agents.agent import ACK_EVERY, Agent, may_ack_later
from hetpilot.agents.config import AgentConfig, EmulatedDevice
from hetpilot.daemon.config import DaemonConfig
from hetpilot.daemon.errors import StorageFull
from hetpilot.daemon.membership import Membership
from hetpilot.daemon.metrics import Metrics
from hetpilot.daemon.records import AgentRecord, AgentReport
from hetpilot.v1 import agent_pb2, agent_pb2_grpc

from hetpilot.channel import Endpoint, open_sync

from .conftest import CLUSTER_MD, CLUSTER_TOKEN, RunningDaemon, start_daemon
from .helpers import host_secret, register_request, report, wait_until
from .test_group_commit import FullOnce
from .test_membership import _Events

pytestmark = pytest.mark.timeout(120)


def _stored_seq(d: RunningDaemon, host: str) -> int:
    """The seq of ``host``'s report as committed in the daemon's store (read from the
    file, as a restarted daemon would)."""
    db = sqlite3.connect(f"file:{d.state_dir / 'state.db'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT body FROM reports WHERE agent_id = ?", (host,)).fetchone()
    finally:
        db.close()
    return int(json.loads(row[0])["seq"]) if row else 0


class _Stream:
    """A Report stream written and read from the test's thread."""

    def __init__(self, d: RunningDaemon, host: str) -> None:
        self.channel = open_sync(Endpoint(address=d.address))
        stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        self.registration = stub.Register(register_request(host), metadata=CLUSTER_MD,
                                          timeout=10).registration
        self.host = host
        self._out: list[agent_pb2.AgentReport | None] = []
        self._ready = threading.Condition()
        self.acks = stub.Report(self._requests(), metadata=CLUSTER_MD, timeout=60)

    def _requests(self) -> Iterator[agent_pb2.AgentReport]:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._out)
                item = self._out.pop(0)
            if item is None:
                return
            yield item

    def send(self, seq: int, ack_later: bool) -> None:
        r = report(self.host, seq, registration=self.registration)
        r.ack_later = ack_later
        with self._ready:
            self._out.append(r)
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._out.append(None)
            self._ready.notify()


def test_reports_said_ack_later_are_covered_by_the_next_ack_after_a_commit(
        daemon: RunningDaemon) -> None:
    """An ack covering reports said ack_later comes after the host's latest report is
    committed: the store (one report per host) holds what committing each would."""
    s = _Stream(daemon, "h1")
    s.send(1, ack_later=False)
    assert next(s.acks).seq == 1  # the first carries the peers anyway
    assert _stored_seq(daemon, "h1") == 1
    for seq in (2, 3, 4):
        s.send(seq, ack_later=True)
    s.send(5, ack_later=False)
    ack = next(s.acks)  # the next message on the stream covers 2..5
    assert ack.seq == 5 and _stored_seq(daemon, "h1") == 5
    s.send(6, ack_later=True)
    s.send(7, ack_later=True)
    s.close()  # the agent ends the stream: a last ack covers 6 and 7, stored first
    assert [a.seq for a in s.acks] == [7]
    assert _stored_seq(daemon, "h1") == 7
    s.channel.close()


def test_an_older_agent_gets_an_ack_per_report(daemon: RunningDaemon) -> None:
    s = _Stream(daemon, "h1")
    for seq in (1, 2, 3):
        s.send(seq, ack_later=False)
        assert next(s.acks).seq == seq
        assert _stored_seq(daemon, "h1") == seq  # committed before its ack
    s.close()
    assert list(s.acks) == []
    s.channel.close()


def test_a_report_said_ack_later_is_acked_when_its_peers_change(
        daemon: RunningDaemon) -> None:
    first = _Stream(daemon, "h1")
    first.send(1, ack_later=False)
    assert next(first.acks).seq == 1
    ch = open_sync(Endpoint(address=daemon.address))
    agent_pb2_grpc.AgentServiceStub(ch).Register(
        register_request("h2", probe="127.0.0.1:9"), metadata=CLUSTER_MD, timeout=10)
    first.send(2, ack_later=True)  # a new host is up: h1's peers changed
    ack = next(first.acks)
    assert ack.seq == 2 and [p.host for p in ack.peers] == ["h2"]
    first.close()
    assert list(first.acks) == []
    first.channel.close()
    ch.close()


def test_an_ack_waits_for_the_commit_of_the_host_s_latest_report(tmp_path: Path) -> None:
    """Reports said ack_later go to the tables at once and to the store with the host's
    next commit; a commit that fails (a full disk) raises, so no ack covers them."""
    store = FullOnce(tmp_path / "state.db")
    members = Membership(store, DaemonConfig(state_dir=str(tmp_path)), Metrics(), _Events())
    a = AgentRecord(host="a", probe_address="", devices=())
    registration = members.register(a, secret=host_secret("a"))[1]

    async def scenario() -> None:
        members.report_taken(AgentReport(agent_id="a", seq=2, unix_ms=0), registration)
        taken = members.latest_report("a")
        assert taken is not None and taken.seq == 2  # planning sees it at once
        with pytest.raises(StorageFull):  # the handler sends no ack
            await members.commit_latest("a")
        members.report_taken(AgentReport(agent_id="a", seq=3, unix_ms=0), registration)
        await members.commit_latest("a")
        await members.commits.close()

    asyncio.run(scenario())
    assert store.latest_reports()["a"].seq == 3
    store.close()


def test_which_reports_may_wait_for_a_later_ack() -> None:
    idle: tuple[list[tuple[str, bool]], list[tuple[str, int, bytes]],
                list[tuple[str, int]]] = ([("L1", True)], [], [])
    assert may_ack_later(idle, since_ack=1, covered=3)
    assert not may_ack_later(idle, since_ack=1, covered=0)  # the stream's first report
    assert not may_ack_later(idle, since_ack=ACK_EVERY, covered=3)  # every ACK_EVERY-th
    assert not may_ack_later(([], [("L1", 0, b"out")], []), since_ack=1, covered=3)
    assert not may_ack_later(([("L1", False)], [], []), since_ack=1, covered=3)  # an exit
    assert not may_ack_later(([], [], [("L1", 29500)]), since_ack=1, covered=3)  # a refusal


def test_a_stopping_daemon_ends_report_streams_after_a_last_ack(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "state", grace_s=60.0)  # the streams must not wait for it
    s = _Stream(d, "h1")
    s.send(1, ack_later=False)
    assert next(s.acks).seq == 1
    stopped = threading.Thread(target=d.stop)
    stopped.start()
    # report on, each pair an ack_later one and one that waits for its ack, until the
    # stream ends: the daemon took nothing that no ack covers
    last, seq = 1, 1
    with pytest.raises(grpc.RpcError) as ended:
        while seq < 100_000:
            s.send(seq + 1, ack_later=True)
            s.send(seq + 2, ack_later=False)
            seq += 2
            last = next(s.acks).seq
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
    assert "the daemon is stopping" in ended.value.details()
    stopped.join(timeout=30)  # the stop's grace (60 s) is not waited out
    assert not stopped.is_alive()
    assert _stored_seq(d, "h1") == last
    s.channel.close()


def test_an_agent_says_in_one_line_that_the_daemon_stopped_and_reconnects(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = start_daemon(tmp_path / "state", grace_s=60.0)
    config = AgentConfig(host="h1", daemon=d.address, token=CLUSTER_TOKEN,
                         probe_listen="127.0.0.1:0", launch=False,
                         state_dir=str(tmp_path / "agent"), max_backoff_s=0.5,
                         emulate=(EmulatedDevice(tflops=10.0, memory_gb=16.0),))
    agent = Agent(config)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    runner = threading.Thread(target=loop.run_until_complete, args=(agent.run(stop),))
    caplog.set_level(logging.INFO, logger="hetpilot.agent")
    runner.start()
    try:
        # idle reports say ack_later; cumulative acks still cover every one of them
        wait_until("reports covered", lambda: agent.reports_acked >= ACK_EVERY + 2)
        d.stop()  # within its 20 s: the agent's stream does not hold it for the grace
        warning = wait_until("the agent's warning", lambda: [
            r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING])[0]
        assert "UNAVAILABLE (the daemon is stopping" in warning, warning
        assert "retrying in" in warning
        # the same state and port: the host's secret holds, the agent finds it
        d2 = start_daemon(tmp_path / "state", listen=d.address)
        wait_until("the agent registered again", lambda: agent.connections >= 2)
        assert "InvalidStateError" not in caplog.text
        d2.stop()
    finally:
        loop.call_soon_threadsafe(stop.set)
        runner.join(timeout=30)
        loop.close()


class _BreakingDaemon(agent_pb2_grpc.AgentServiceServicer):
    """A daemon whose first report stream acks the reports that ask and breaks at the
    first that says ack_later, before any ack covers it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bool]] = []  # (stream, seq, ack_later)
        self.acks: list[int] = []  # what stream 1 acked
        self.second = asyncio.Event()
        self.streams = 0

    async def Register(self, request: agent_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> agent_pb2.RegisterResponse:
        return agent_pb2.RegisterResponse(agent_id=request.host, report_interval_s=0.05,
                                          heartbeat_timeout_s=5.0,
                                          registration=f"r{self.streams + 1}")

    async def Report(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        self.streams += 1
        stream = self.streams
        async for r in request_iterator:
            self.seen.append((stream, r.seq, r.ack_later))
            if stream > 1:
                self.second.set()
            if r.ack_later:
                if stream == 1:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "gone")
                continue
            if stream == 1:
                self.acks.append(r.seq)
            yield agent_pb2.ReportAck(seq=r.seq)


def test_a_report_no_ack_covered_is_not_counted_and_the_agent_reconnects(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = _BreakingDaemon()
    caplog.set_level(logging.INFO, logger="hetpilot.agent")

    async def scenario() -> tuple[int, int]:
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        agent = Agent(AgentConfig(host="h1", daemon=f"127.0.0.1:{port}", token=CLUSTER_TOKEN,
                                  probe_listen="127.0.0.1:0", launch=False,
                                  state_dir=str(tmp_path / "agent"), max_backoff_s=0.5,
                                  emulate=(EmulatedDevice(tflops=10.0, memory_gb=16.0),)))
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        try:
            await asyncio.wait_for(fake.second.wait(), 60)
            return agent.reports_acked, agent.connections
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
            await server.stop(None)

    acked, connections = asyncio.run(scenario())
    first = [(seq, later) for stream, seq, later in fake.seen if stream == 1]
    second = [(seq, later) for stream, seq, later in fake.seen if stream == 2]
    assert first[0] == (1, False) and first[-1][1] is True  # it broke at an ack_later one
    # the agent counts what an ack covered, not the report the stream broke at
    assert acked == len(fake.acks) == len(first) - 1
    # it registered again; the new stream's first report asks, and seqs go on
    assert connections == 2 and second[0] == (first[-1][0] + 1, False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "UNAVAILABLE" in warnings[0], warnings  # not at the stop
