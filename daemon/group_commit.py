"""Group commit of agent reports: one transaction per batch, each report durable
before its caller goes on.

Reports handed to :meth:`ReportCommitter.put` queue up until the writer task
commits all of them with :meth:`~.store.Store.put_reports`. An idle daemon commits
a report at once; after a commit, the next one waits until ``window_s`` has passed
since (or until ``max_batch`` reports are queued), so a busy daemon commits the
reports of a few milliseconds together (Note [the commit window]). ``put`` returns
once its report's batch has committed, and raises that batch's error (a
:class:`~.errors.StorageError` when the disk is full) otherwise: an ack sent after
``put`` is as durable as one sent after ``put_report``.

Note [the commit on the event loop]: the batch is committed on the loop thread, as
a single report's was. Handing it to a worker thread took the commit off the loop
but cost more CPU in all, a thread hand-off per batch, and at 1 Hz per agent the
batches are small (bench/RESULTS-controlplane.md).

Note [the commit window]: at 1 Hz per agent a turn of the event loop holds one or
two reports, so committing once per turn cost a transaction (BEGIN, COMMIT, the
file check, about 30 us) per one or two reports. Waiting ``window_s`` (2 ms) after a
commit lets 2000 agents' reports gather four or so to a transaction; the wait adds
at most ``window_s`` to an ack, and none to the first report after a quiet spell.
"""

from __future__ import annotations

import asyncio
import contextlib

from .records import AgentReport
from .store import Store

__all__ = ["ReportCommitter"]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ReportCommitter:
    """Batches :meth:`put` calls into :meth:`Store.put_reports` transactions (module
    docstring). Use from one event loop; :meth:`close` commits what is queued."""

    def __init__(self, store: Store, max_batch: int = 512, window_s: float = 0.002) -> None:
        self.store = store
        self.max_batch = max_batch
        self.window_s = window_s
        self._queue: list[tuple[AgentReport, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._pause: asyncio.Future[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0
        """Transactions committed or tried so far (for tests and metrics)."""

    async def put(self, report: AgentReport) -> None:
        """Return once ``report`` is committed; raise its batch's error otherwise."""
        if self._closed:
            raise RuntimeError("the report committer is closed")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((report, done))
        self._wake.set()
        if self._pause is not None and len(self._queue) >= self.max_batch:
            _wake(self._pause)  # a full batch does not wait for the window
        if self._writer is None:
            self._writer = asyncio.create_task(self._write(), name="report-commits")
        await done  # a caller cancelled meanwhile cancels this, not its report's commit

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        last = float("-inf")  # when the last batch was committed (loop time)
        while True:
            await self._wake.wait()
            self._wake.clear()
            wait = last + self.window_s - loop.time()
            if wait > 0 and not self._closed and len(self._queue) < self.max_batch:
                await self._paused(loop, wait)  # Note [the commit window]
            while self._queue:
                batch = self._queue[:self.max_batch]
                del self._queue[:len(batch)]
                self.batches += 1
                try:
                    self.store.put_reports([r for r, _ in batch])  # Note [the commit ...]
                except Exception as exc:
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                else:
                    for _, done in batch:
                        if not done.done():
                            done.set_result(None)
            last = loop.time()
            if self._closed:
                return

    async def _paused(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        """Sleep ``seconds``, or less when a full batch queues up or :meth:`close` comes."""
        self._pause = loop.create_future()
        timer = loop.call_later(seconds, _wake, self._pause)
        try:
            await self._pause
        finally:
            timer.cancel()
            self._pause = None

    async def close(self) -> None:
        """Commit what is queued, then stop the writer."""
        self._closed = True
        self._wake.set()
        if self._pause is not None:
            _wake(self._pause)
        if self._writer is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
