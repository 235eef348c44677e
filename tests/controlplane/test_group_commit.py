"""Group commit of agent reports (issue 37.9): concurrent reports share transactions,
and none returns (no ack is sent) before it is committed, on a real SQLite store and
a live daemon."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from hetpilot.daemon.errors import StorageFull
from hetpilot.daemon.group_commit import ReportCommitter
from hetpilot.daemon.records import AgentReport
from hetpilot.daemon.sqlite_store import SqliteStore
from hetpilot.v1 import agent_pb2_grpc

from .conftest import CLUSTER_MD, start_daemon
from .helpers import register_request, report

pytestmark = pytest.mark.timeout(60)


def _committed(path: Path) -> dict[str, int]:
    """The reports another connection sees: what is committed, not what is cached."""
    db = sqlite3.connect(path)
    try:
        return {agent: json.loads(body).get("seq", -1)
                for agent, body in db.execute("SELECT agent_id, body FROM reports")}
    finally:
        db.close()


class CountingStore(SqliteStore):
    """The real store, counting the reports of each batch it is given."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.batches: list[int] = []

    def put_reports(self, reports: Sequence[AgentReport]) -> None:
        self.batches.append(len(reports))
        super().put_reports(reports)


def test_concurrent_reports_share_transactions_and_each_is_committed_before_put_returns(
        tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = CountingStore(path)

    async def scenario() -> list[bool]:
        committer = ReportCommitter(store)
        seen: list[bool] = []

        async def agent(i: int) -> None:
            report = AgentReport(agent_id=f"h{i}", seq=7, unix_ms=i)
            await committer.put(report)
            # committed: another connection sees it
            seen.append(_committed(path).get(f"h{i}") == 7)

        await asyncio.gather(*(agent(i) for i in range(300)))
        await committer.close()
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) == 300 and all(seen)
    assert sum(store.batches) == 300 and len(store.batches) < 300  # shared transactions
    assert max(store.batches) > 1
    store.close()


class FullOnce(SqliteStore):
    """The real store, with its first batch refused as a full disk would."""

    refused = False

    def put_reports(self, reports: Sequence[AgentReport]) -> None:
        if not self.refused:
            self.refused = True
            raise StorageFull("state store full: database or disk is full")
        super().put_reports(reports)


def test_a_batch_that_fails_fails_each_of_its_callers_and_the_next_one_commits(
        tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = FullOnce(path)

    async def scenario() -> tuple[list[str], bool]:
        committer = ReportCommitter(store)
        outcomes: list[str] = []

        async def agent(i: int) -> None:
            try:
                await committer.put(AgentReport(agent_id=f"h{i}", seq=1, unix_ms=i))
            except StorageFull:
                outcomes.append(f"h{i} full")
            else:
                outcomes.append(f"h{i} ok")

        await asyncio.gather(*(agent(i) for i in range(5)))
        await committer.put(AgentReport(agent_id="later", seq=2, unix_ms=0))
        await committer.close()
        with pytest.raises(RuntimeError, match="closed"):
            await committer.put(AgentReport(agent_id="after", seq=3, unix_ms=0))
        return outcomes, "later" in _committed(path)

    outcomes, later = asyncio.run(scenario())
    # the first batch failed as a whole: each of its callers was told, none of it was
    # kept; a caller told ok is committed; the next put commits
    committed = _committed(path)
    assert len(outcomes) == 5 and any(o.endswith(" full") for o in outcomes)
    assert all((o.split()[0] in committed) == o.endswith(" ok") for o in outcomes)
    assert later
    store.close()


def test_a_caller_that_goes_away_does_not_take_its_report_out_of_the_batch(
        tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)

    async def scenario() -> None:
        committer = ReportCommitter(store)
        gone = asyncio.create_task(committer.put(AgentReport(agent_id="gone", seq=1, unix_ms=0)))
        await asyncio.sleep(0)  # queued: the writer has its batch
        gone.cancel()
        await committer.put(AgentReport(agent_id="stays", seq=2, unix_ms=0))
        with pytest.raises(asyncio.CancelledError):
            await gone
        await committer.close()

    asyncio.run(scenario())
    assert set(_committed(path)) == {"gone", "stays"}
    store.close()


def test_each_report_ack_of_a_live_daemon_comes_after_its_commit(tmp_path: Path) -> None:
    """40 agents report at once over their Report streams: every ack is sent only once
    its report is committed (another connection sees it when the ack arrives)."""
    d = start_daemon(tmp_path / "state")
    db_path = tmp_path / "state" / "state.db"

    async def scenario() -> list[tuple[str, int, int]]:
        seen: list[tuple[str, int, int]] = []
        async with grpc.aio.insecure_channel(d.address) as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)

            async def agent(i: int) -> None:
                host = f"h{i}"
                reg = (await stub.Register(register_request(host), metadata=CLUSTER_MD,
                                           timeout=30)).registration
                call = stub.Report(metadata=CLUSTER_MD)
                for seq in (1, 2, 3):
                    await call.write(report(host, seq, registration=reg))
                    ack = await call.read()
                    seen.append((host, ack.seq, _committed(db_path).get(host, 0)))
                await call.done_writing()

            await asyncio.gather(*(agent(i) for i in range(40)))
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        d.stop()
    assert len(seen) == 40 * 3
    late = [(host, acked, stored) for host, acked, stored in seen if stored < acked]
    assert not late, f"acked before committed: {late[:5]}"


def test_reports_that_come_within_the_commit_window_share_one_transaction(
        tmp_path: Path) -> None:
    """The first report after a quiet spell commits at once; the next ones, though they
    come in different turns of the event loop, wait out the window (here far longer
    than the test) and go in one transaction, committed by close at the latest."""
    path = tmp_path / "state.db"
    store = CountingStore(path)

    async def scenario() -> tuple[list[str], list[bool]]:
        committer = ReportCommitter(store, window_s=3600.0)
        await committer.put(AgentReport(agent_id="first", seq=1, unix_ms=0))
        before = sorted(_committed(path))
        later = [asyncio.create_task(committer.put(AgentReport(agent_id=f"h{i}", seq=2,
                                                                 unix_ms=i)))
                 for i in range(3)]
        for _ in range(5):  # turns of the loop: each report queued in one of its own
            await asyncio.sleep(0)
        waiting = [not t.done() for t in later]
        await committer.close()
        await asyncio.gather(*later)
        return before, waiting

    before, waiting = asyncio.run(scenario())
    assert before == ["first"]
    assert all(waiting)  # within the window: not committed, no ack
    assert store.batches == [1, 3]
    assert sorted(_committed(path)) == ["first", "h0", "h1", "h2"]
    store.close()


def test_a_full_batch_does_not_wait_for_the_commit_window(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = CountingStore(path)

    async def scenario() -> None:
        committer = ReportCommitter(store, max_batch=4, window_s=3600.0)
        await committer.put(AgentReport(agent_id="first", seq=1, unix_ms=0))
        # four reports fill a batch: they commit without close (the test's timeout
        # would end a wait for the window)
        await asyncio.gather(*(committer.put(AgentReport(agent_id=f"h{i}", seq=2, unix_ms=i))
                               for i in range(4)))
        assert store.batches == [1, 4]
        await committer.close()

    asyncio.run(scenario())
    store.close()
