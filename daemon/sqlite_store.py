"""The daemon's state in SQLite (WAL): :class:`SqliteStore`, the :class:`~.store.Store`
the daemon runs on. The file's checks and checkpoints are in :mod:`.sqlite_file`, the
schema and its migrations in :mod:`.sqlite_schema`."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from .errors import DamagedStore, StorageError, StorageFull, StorageUnavailable
from .records import (
    AgentRecord,
    AgentReport,
    DrainRecord,
    JobProgress,
    JobRecord,
    JobStatus,
    LaunchRecord,
    MeasurementRecord,
    PlanRecord,
    TimingsRecord,
)
from .sqlite_file import (
    CHECKPOINT_PAGES,
    RESTORE,
    DatabaseFile,
    faults_raised,
    one_line,
    primary_code,
    refuse_lost,
    storage_error,
)
from .sqlite_schema import MIGRATIONS, SCHEMA_VERSION, TABLES, SchemaError
from .store import Store

_T = TypeVar("_T")

__all__ = ["SqliteStore"]

log = logging.getLogger("hetpilot.daemon.store")


class SqliteStore(Store):
    """SQLite in WAL mode with synchronous=NORMAL: a committed write survives the
    process being killed (it is in the WAL file); only a power loss may drop the
    last transactions. Safe to call from several threads (one lock).

    Every write runs in :meth:`_transaction`; opening checks the file first (see
    :meth:`_open`). The store runs the WAL checkpoints itself and checks the file
    before each write (:class:`.DatabaseFile`)."""

    def __init__(self, path: str | Path, *, checkpoint_pages: int = CHECKPOINT_PAGES) -> None:
        """``checkpoint_pages``: checkpoint once the WAL holds this many pages (see
        :class:`.DatabaseFile`); tests make it small to checkpoint while a disk is full."""
        self.path = Path(path)
        self._checkpoint_pages = checkpoint_pages
        self._lock = threading.Lock()
        self._notify_lock = threading.RLock()  # a callback may write, which notifies again
        self._writable = self._notified = True
        try:
            self._db = self._open(self.path)
        except (StorageFull, StorageUnavailable) as exc:  # DamagedStore names the path
            raise type(exc)(f"{self.path}: {exc} (can the daemon's user write to "
                            f"{self.path.parent}?)") from exc
        self._file: DatabaseFile | None = None
        """The file's checks and checkpoints, from the end of opening on."""
        try:
            self._migrate()
            self._check_tables()
            with self._lock:
                self._file = DatabaseFile(self.path, self._checkpoint_pages)
                # one left unfinished at the last stop (a full disk) completes now, or
                # stays so until a commit (see Note [checkpoints on a full disk])
                self._file.checkpoint(self._db)
        except BaseException:
            self._db.close()
            raise

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        """Connect, refusing a damaged database; a missing file becomes a new one. A 0-byte
        file is refused too (SQLite would take it for a new database): this store writes
        its header on creation, so 0 bytes means the file was truncated or never written."""
        with faults_raised():
            refuse_lost(path)
            if path.exists() and path.stat().st_size == 0:
                raise DamagedStore(f"{path} is empty (0 bytes), not a database: remove it to "
                                   "start with a new state, or restore a backup")
            db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        try:
            with faults_raised():
                try:
                    db.execute("PRAGMA busy_timeout=5000")
                    # checked before anything writes to it (setting WAL on an old database does)
                    rows = db.execute("PRAGMA quick_check").fetchall()
                    if rows != [("ok",)]:
                        detail = one_line("; ".join(str(r[0]) for r in rows))
                        raise DamagedStore(f"{path} is damaged (quick_check: {detail}); {RESTORE}")
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute("PRAGMA synchronous=NORMAL")
                    db.execute("PRAGMA wal_autocheckpoint=0")  # the store's own: sqlite_file
                except sqlite3.DatabaseError as exc:
                    if primary_code(exc) not in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                        raise
                    raise DamagedStore(f"{path} is damaged ({one_line(str(exc))}); "
                                       f"{RESTORE}") from exc
        except BaseException:
            db.close()
            raise
        return db

    def _decode(self, parse: Callable[[Any], _T], body: Any, table: str) -> _T:
        """A row's body as its record; a body this daemon cannot read (not JSON, another
        shape: a hand-edited or damaged row that passes quick_check) is a DamagedStore
        naming the file and the table, one line, not a traceback."""
        try:
            return parse(body)
        except Exception as exc:
            raise DamagedStore(f"{self.path}: a row of table {table} cannot be read "
                               f"({type(exc).__name__}: {one_line(str(exc))[:200]}); "
                               f"{RESTORE}") from exc

    def _check_tables(self) -> None:
        """Every table the migrations create is there (one dropped by hand would make
        every call that reads it fail)."""
        have = {r[0] for r in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type='table'").fetchall()}
        missing = [t for t in TABLES if t not in have]
        if missing:
            raise DamagedStore(f"{self.path} has schema version {SCHEMA_VERSION} but no "
                               f"table {', '.join(missing)}; {RESTORE}")

    def _migrate(self) -> None:
        # BEGIN IMMEDIATE: one daemon migrates; a second waits, then sees it done
        with self._transaction() as db:
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise SchemaError(
                    f"{self.path} has schema version {version}, newer than this daemon's "
                    f"{SCHEMA_VERSION}: run the daemon release that wrote it (or a newer one)")
            for step in MIGRATIONS[version:]:
                for statement in step:
                    db.execute(statement)
            if version != SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION:d}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE, the body, COMMIT, under the store's lock: every write goes
        through here. On failure what SQLite has not rolled back itself (it does on
        SQLITE_FULL, SQLITE_IOERR, ...) is rolled back, and the original error is raised:
        a storage fault as StorageFull / StorageUnavailable (which clears ``writable``),
        anything else unchanged. A commit sets ``writable``, then checkpoints when one
        is due (:meth:`.DatabaseFile.committed`)."""
        try:
            with self._lock:
                lost = None if self._file is None else self._file.check()
                if lost is not None:
                    self._writable = False
                    raise StorageUnavailable(lost)
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException as exc:
                    self._rollback(exc)
                    fault = storage_error(exc)
                    if fault is None:
                        raise
                    self._writable = False
                    raise fault from exc
                self._writable = True
                if self._file is not None:  # a checkpoint when due; never fails the write
                    self._file.committed(self._db)
        finally:
            self._notify()

    def _rollback(self, error: BaseException) -> None:
        """Roll back if a transaction is still open; a failing rollback becomes a note on
        ``error`` rather than the error raised."""
        if not self._db.in_transaction:
            return
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            error.add_note(f"the rollback failed too: {exc}")

    def _notify(self) -> None:
        """Tell ``on_writable_change`` when ``writable`` differs from what it was last told.
        Serialised, so after writes on several threads flipped it, the last call made
        reports the current value."""
        with self._notify_lock:
            writable = self._writable
            if writable == self._notified:
                return
            self._notified = writable
            if self.on_writable_change is None:
                return
            try:
                self.on_writable_change(writable)
            except Exception:  # a committed write must not look failed because of it
                log.exception("on_writable_change(%s) failed", writable)

    @property
    def writable(self) -> bool:
        return self._writable

    def probe(self) -> bool:
        """Commit a tiny write (the schema version, rewritten with its own value; no table
        changes) and return whether it committed, updating ``writable``. It proves that a
        small commit works, not that a large one fits: the next write that fails for want
        of room clears ``writable`` again."""
        try:
            with self._transaction() as db:
                version = int(db.execute("PRAGMA user_version").fetchone()[0])
                db.execute(f"PRAGMA user_version={version:d}")
        except StorageError:
            return False
        return True

    @property
    def schema_version(self) -> int:
        return int(self._one("PRAGMA user_version", ())[0])

    def _one(self, sql: str, args: tuple[Any, ...]) -> Any:
        with self._lock, faults_raised():
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock, faults_raised():
            return self._db.execute(sql, args).fetchall()

    def create_job(self, job: JobRecord) -> JobRecord:
        with self._transaction() as db:
            if job.request_id:
                row = db.execute("SELECT body FROM jobs WHERE owner=? AND request_id=?",
                                 (job.owner, job.request_id)).fetchone()
                if row:
                    return self._decode(JobRecord.from_json, row[0], "jobs")
            db.execute("INSERT INTO jobs(job_id, owner, request_id, body) VALUES (?,?,?,?)",
                       (job.job_id, job.owner, job.request_id, job.to_json()))
        return job

    def get_job(self, job_id: str) -> JobRecord | None:
        row = self._one("SELECT body FROM jobs WHERE job_id=?", (job_id,))
        return self._decode(JobRecord.from_json, row[0], "jobs") if row else None

    def list_jobs(self, owner: str | None = None) -> list[JobRecord]:
        if owner is None:
            rows = self._all("SELECT body FROM jobs ORDER BY seq")
        else:
            rows = self._all("SELECT body FROM jobs WHERE owner=? ORDER BY seq", (owner,))
        return [self._decode(JobRecord.from_json, r[0], "jobs") for r in rows]

    def update_job(self, job: JobRecord) -> None:
        with self._transaction() as db:
            cur = db.execute("UPDATE jobs SET body=? WHERE job_id=?",
                             (job.to_json(), job.job_id))
            if cur.rowcount != 1:
                raise KeyError(job.job_id)

    def record_slot(self, job_id: str, *, status: JobStatus, controller_state: dict[str, Any],
                    plan: PlanRecord | None = None) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO job_status(job_id, status, controller_state)"
                       " VALUES (?,?,?)", (job_id, status.to_json(), json.dumps(controller_state)))
            if plan is not None:
                db.execute("INSERT INTO plans(job_id, version, body) VALUES (?,?,?)",
                           (job_id, plan.version, plan.to_json()))

    def job_status(self, job_id: str) -> tuple[JobStatus, dict[str, Any] | None]:
        row = self._one("SELECT status, controller_state FROM job_status WHERE job_id=?",
                        (job_id,))
        if not row:
            return JobStatus(), None
        return self._decode(JobStatus.from_json, row[0], "job_status"), self._decode(json.loads, row[1], "job_status")

    def plans(self, job_id: str, after_version: int = 0) -> list[PlanRecord]:
        rows = self._all("SELECT body FROM plans WHERE job_id=? AND version>? ORDER BY version",
                         (job_id, after_version))
        return [self._decode(PlanRecord.from_json, r[0], "plans") for r in rows]

    def put_agent(self, agent: AgentRecord) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO agents(host, body) VALUES (?,?)",
                       (agent.host, agent.to_json()))

    def agents(self) -> list[AgentRecord]:
        return [self._decode(AgentRecord.from_json, r[0], "agents") for r in self._all("SELECT body FROM agents")]

    def put_report(self, report: AgentReport) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO reports(agent_id, body) VALUES (?,?)",
                       (report.agent_id, report.to_json()))

    def put_reports(self, reports: Sequence[AgentReport]) -> None:
        with self._transaction() as db:
            db.executemany("INSERT OR REPLACE INTO reports(agent_id, body) VALUES (?,?)",
                           [(r.agent_id, r.to_json()) for r in reports])

    def latest_reports(self) -> dict[str, AgentReport]:
        reports = (self._decode(AgentReport.from_json, r[0], "reports") for r in self._all("SELECT body FROM reports"))
        return {r.agent_id: r for r in reports}

    def put_timings(self, timings: TimingsRecord, progress: JobProgress | None = None) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO timings(job_id, rank, body) VALUES (?,?,?)",
                       (timings.job_id, timings.rank, timings.to_json()))
            if progress is not None:
                db.execute("INSERT OR REPLACE INTO progress(job_id, body) VALUES (?,?)",
                           (timings.job_id, progress.to_json()))

    def latest_timings(self, job_id: str) -> list[TimingsRecord]:
        rows = self._all("SELECT body FROM timings WHERE job_id=? ORDER BY rank", (job_id,))
        return [self._decode(TimingsRecord.from_json, r[0], "timings") for r in rows]

    def progress(self, job_id: str) -> JobProgress:
        row = self._one("SELECT body FROM progress WHERE job_id=?", (job_id,))
        return self._decode(JobProgress.from_json, row[0], "progress") if row else JobProgress()

    def put_measurement(self, measurement: MeasurementRecord) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO measurements(job_id, device_id, body) "
                       "VALUES (?,?,?)",
                       (measurement.job_id, measurement.device_id, measurement.to_json()))

    def measurements(self, job_id: str) -> list[MeasurementRecord]:
        rows = self._all("SELECT body FROM measurements WHERE job_id=? ORDER BY device_id",
                         (job_id,))
        return [self._decode(MeasurementRecord.from_json, r[0], "measurements") for r in rows]

    def put_drain(self, drain: DrainRecord) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO drains(host, body) VALUES (?,?)",
                       (drain.host, drain.to_json()))

    def delete_drain(self, host: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM drains WHERE host=?", (host,))

    def drains(self) -> list[DrainRecord]:
        return [self._decode(DrainRecord.from_json, r[0], "drains")
                for r in self._all("SELECT body FROM drains ORDER BY host")]

    def put_launch(self, launch: LaunchRecord) -> None:
        with self._transaction() as db:
            cur = db.execute("UPDATE launches SET body=? WHERE launch_id=?",
                             (launch.to_json(), launch.launch_id))
            if cur.rowcount == 0:
                db.execute("INSERT INTO launches(launch_id, job_id, body) VALUES (?,?,?)",
                           (launch.launch_id, launch.job_id, launch.to_json()))

    def launches(self, job_id: str | None = None) -> list[LaunchRecord]:
        if job_id is None:
            rows = self._all("SELECT body FROM launches ORDER BY seq")
        else:
            rows = self._all("SELECT body FROM launches WHERE job_id=? ORDER BY seq", (job_id,))
        return [self._decode(LaunchRecord.from_json, r[0], "launches") for r in rows]


    def close(self) -> None:
        """Checkpoint and close; a checkpoint the disk has no room for is left to the next
        start (the WAL keeps it), and a lost file is left as it is (see
        :mod:`.sqlite_file`)."""
        with self._lock:
            if self._file is None:
                self._db.close()
            else:
                self._file.close(self._db)
