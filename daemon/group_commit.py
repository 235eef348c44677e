"""Group commit of agent reports: one transaction per batch, each report durable
before its caller goes on.

Reports handed to :meth:`ReportCommitter.put` queue up until the writer task's
next turn of the event loop, which commits all of them with
:meth:`~.store.Store.put_reports`: there is no timer, an idle daemon commits a
report at once and a busy one the dozens that arrived in one turn. ``put``
returns once its report's batch has committed, and raises that batch's error (a
:class:`~.errors.StorageError` when the disk is full) otherwise: an ack sent after
``put`` is as durable as one sent after ``put_report``.

Note [the commit on the event loop]: the batch is committed on the loop thread, as
a single report's was. Handing it to a worker thread took the commit off the loop
but cost more CPU in all, a thread hand-off per batch, and at 1 Hz per agent the
batches are small (bench/RESULTS-controlplane.md).
"""

from __future__ import annotations

import asyncio
import contextlib

from .records import AgentReport
from .store import Store

__all__ = ["ReportCommitter"]


class ReportCommitter:
    """Batches :meth:`put` calls into :meth:`Store.put_reports` transactions (module
    docstring). Use from one event loop; :meth:`close` commits what is queued."""

    def __init__(self, store: Store, max_batch: int = 512) -> None:
        self.store = store
        self.max_batch = max_batch
        self._queue: list[tuple[AgentReport, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
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
        if self._writer is None:
            self._writer = asyncio.create_task(self._write(), name="report-commits")
        await done  # a caller cancelled meanwhile cancels this, not its report's commit

    async def _write(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
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
            if self._closed:
                return

    async def close(self) -> None:
        """Commit what is queued, then stop the writer."""
        self._closed = True
        self._wake.set()
        if self._writer is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
