"""The daemon's state behind one interface: :class:`Store`.

Two implementations pass the same contract test
(tests/controlplane/test_store_contract.py): :class:`MemoryStore` for unit
tests and :class:`SqliteStore` (WAL) for the daemon. A slot's status, the
controller's state (virtual queues included) and a new plan version are
written in one transaction, so kill -9 leaves either the slot before or the
slot after, never half of one; so are a trainer's stage timings and the job's
training progress they update. The layer times each device measured for a job
are kept too (the latest per job and device), so a restarted daemon plans with
them at once, and so are the drained hosts, so a restart keeps them drained,
and each job's launch (hosts, rendezvous, each host's state), so a restart
neither launches a job twice nor forgets what runs.

The SQLite schema is versioned (``PRAGMA user_version``, :data:`SCHEMA_VERSION`):
opening a database runs the migrations it lacks in one transaction, and a
database written by a newer daemon is refused rather than half understood.

Under storage faults the store promises: a write that fails commits nothing of
itself and raises :class:`~.errors.StorageFull` (disk or quota full) or
:class:`~.errors.StorageUnavailable` (I/O error, damaged page, locked, read-only),
never a secondary error such as a failed rollback; reads raise
``StorageUnavailable``. ``writable`` is False from a failed write until the next
write or :meth:`Store.probe` that commits. Opening a database that is empty,
not a database, or fails ``PRAGMA quick_check`` raises :class:`~.errors.DamagedStore`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
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

_T = TypeVar("_T")

__all__ = ["SCHEMA_VERSION", "MemoryStore", "SchemaError", "SqliteStore", "Store"]


class Store(ABC):
    """The daemon's state. Under storage faults (see the module docstring) a write
    commits all of itself or nothing, and the fault is raised as a StorageError."""

    #: Called with the new value of :attr:`writable` each time it flips: in order, one
    #: call at a time, on a thread that wrote. Read ``writable`` for the value now.
    on_writable_change: Callable[[bool], None] | None = None

    @property
    def writable(self) -> bool:
        """False from a write that failed for want of storage until one commits again."""
        return True

    def probe(self) -> bool:
        """Try a tiny real write; update and return :attr:`writable`."""
        return True

    @abstractmethod
    def create_job(self, job: JobRecord) -> JobRecord:
        """Insert; when (owner, request_id) exists with a non-empty request_id, return that job."""

    @abstractmethod
    def get_job(self, job_id: str) -> JobRecord | None: ...

    @abstractmethod
    def list_jobs(self, owner: str | None = None) -> list[JobRecord]:
        """In creation order; every owner's when ``owner`` is None."""

    @abstractmethod
    def update_job(self, job: JobRecord) -> None:
        """Replace the job's record (state, budgets, V, model)."""

    @abstractmethod
    def record_slot(self, job_id: str, *, status: JobStatus, controller_state: dict[str, Any],
                    plan: PlanRecord | None = None) -> None:
        """Atomically: the slot's status, the controller's state, and a new plan version."""

    @abstractmethod
    def job_status(self, job_id: str) -> tuple[JobStatus, dict[str, Any] | None]:
        """(status, controller state or None) of the last recorded slot."""

    @abstractmethod
    def plans(self, job_id: str, after_version: int = 0) -> list[PlanRecord]:
        """Plan versions greater than ``after_version``, in order."""

    @abstractmethod
    def put_agent(self, agent: AgentRecord) -> None: ...

    @abstractmethod
    def agents(self) -> list[AgentRecord]: ...

    @abstractmethod
    def put_report(self, report: AgentReport) -> None:
        """Keep the latest report of each agent."""

    @abstractmethod
    def latest_reports(self) -> dict[str, AgentReport]: ...

    @abstractmethod
    def put_timings(self, timings: TimingsRecord, progress: JobProgress | None = None) -> None:
        """Keep the latest stage timings of each (job, rank); atomically with them, when
        given, replace the job's training progress."""

    @abstractmethod
    def latest_timings(self, job_id: str) -> list[TimingsRecord]: ...

    @abstractmethod
    def progress(self, job_id: str) -> JobProgress:
        """The job's training progress; an empty one before the first."""

    @abstractmethod
    def put_measurement(self, measurement: MeasurementRecord) -> None:
        """Keep the latest measurement of each (job, device)."""

    @abstractmethod
    def measurements(self, job_id: str) -> list[MeasurementRecord]:
        """The job's measurements, by device id."""

    @abstractmethod
    def put_drain(self, drain: DrainRecord) -> None:
        """Mark the host drained (replacing an earlier record of it)."""

    @abstractmethod
    def delete_drain(self, host: str) -> None:
        """Resume the host; nothing happens when it was not drained."""

    @abstractmethod
    def drains(self) -> list[DrainRecord]:
        """Every drained host, by host name."""

    @abstractmethod
    def put_launch(self, launch: LaunchRecord) -> None:
        """Insert or replace the launch (by launch id)."""

    @abstractmethod
    def launches(self, job_id: str | None = None) -> list[LaunchRecord]:
        """The launches of ``job_id`` (every job's when None), in creation order."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release; the memory store has nothing to do."""


class MemoryStore(Store):
    def __init__(self) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._status: dict[str, tuple[JobStatus, dict[str, Any] | None]] = {}
        self._plans: dict[str, list[PlanRecord]] = {}
        self._agents: dict[str, AgentRecord] = {}
        self._reports: dict[str, AgentReport] = {}
        self._timings: dict[tuple[str, int], TimingsRecord] = {}
        self._progress: dict[str, JobProgress] = {}
        self._measurements: dict[tuple[str, str], MeasurementRecord] = {}
        self._drains: dict[str, DrainRecord] = {}
        self._launches: dict[str, LaunchRecord] = {}

    def create_job(self, job: JobRecord) -> JobRecord:
        if job.request_id:
            for existing in self._jobs.values():
                if existing.owner == job.owner and existing.request_id == job.request_id:
                    return existing
        if job.job_id in self._jobs:
            raise KeyError(f"job {job.job_id} exists")
        self._jobs[job.job_id] = job
        return job

    def get_job(self, job_id: str) -> JobRecord | None:
        return self._jobs.get(job_id)

    def list_jobs(self, owner: str | None = None) -> list[JobRecord]:
        return [j for j in self._jobs.values() if owner is None or j.owner == owner]

    def update_job(self, job: JobRecord) -> None:
        if job.job_id not in self._jobs:
            raise KeyError(job.job_id)
        self._jobs[job.job_id] = job

    def record_slot(self, job_id: str, *, status: JobStatus, controller_state: dict[str, Any],
                    plan: PlanRecord | None = None) -> None:
        state = json.loads(json.dumps(controller_state))  # same isolation as SQLite
        self._status[job_id] = (status, state)
        if plan is not None:
            self._plans.setdefault(job_id, []).append(plan)

    def job_status(self, job_id: str) -> tuple[JobStatus, dict[str, Any] | None]:
        return self._status.get(job_id, (JobStatus(), None))

    def plans(self, job_id: str, after_version: int = 0) -> list[PlanRecord]:
        return [p for p in self._plans.get(job_id, []) if p.version > after_version]

    def put_agent(self, agent: AgentRecord) -> None:
        self._agents[agent.host] = agent

    def agents(self) -> list[AgentRecord]:
        return list(self._agents.values())

    def put_report(self, report: AgentReport) -> None:
        self._reports[report.agent_id] = report

    def latest_reports(self) -> dict[str, AgentReport]:
        return dict(self._reports)

    def put_timings(self, timings: TimingsRecord, progress: JobProgress | None = None) -> None:
        self._timings[(timings.job_id, timings.rank)] = timings
        if progress is not None:
            self._progress[timings.job_id] = progress

    def latest_timings(self, job_id: str) -> list[TimingsRecord]:
        return sorted((t for (j, _), t in self._timings.items() if j == job_id),
                      key=lambda t: t.rank)

    def progress(self, job_id: str) -> JobProgress:
        return self._progress.get(job_id, JobProgress())

    def put_measurement(self, measurement: MeasurementRecord) -> None:
        self._measurements[(measurement.job_id, measurement.device_id)] = measurement

    def measurements(self, job_id: str) -> list[MeasurementRecord]:
        return sorted((m for (j, _), m in self._measurements.items() if j == job_id),
                      key=lambda m: m.device_id)

    def put_drain(self, drain: DrainRecord) -> None:
        self._drains[drain.host] = drain

    def delete_drain(self, host: str) -> None:
        self._drains.pop(host, None)

    def drains(self) -> list[DrainRecord]:
        return [self._drains[h] for h in sorted(self._drains)]

    def put_launch(self, launch: LaunchRecord) -> None:
        self._launches[launch.launch_id] = launch

    def launches(self, job_id: str | None = None) -> list[LaunchRecord]:
        return [la for la in self._launches.values() if job_id is None or la.job_id == job_id]


#: ``_MIGRATIONS[v]`` takes a database from schema version v to v + 1. Only ever
#: append: a released step never changes, because databases out there ran it.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 0 -> 1: the original tables. Databases from before versioning have them and
    # user_version 0; IF NOT EXISTS leaves their rows alone.
    ("""CREATE TABLE IF NOT EXISTS jobs (
          seq INTEGER PRIMARY KEY AUTOINCREMENT,
          job_id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, request_id TEXT NOT NULL,
          body TEXT NOT NULL)""",
     "CREATE INDEX IF NOT EXISTS jobs_owner_request ON jobs(owner, request_id)",
     """CREATE TABLE IF NOT EXISTS job_status (
          job_id TEXT PRIMARY KEY, status TEXT NOT NULL, controller_state TEXT NOT NULL)""",
     """CREATE TABLE IF NOT EXISTS plans (
          job_id TEXT NOT NULL, version INTEGER NOT NULL, body TEXT NOT NULL,
          PRIMARY KEY (job_id, version))""",
     "CREATE TABLE IF NOT EXISTS agents (host TEXT PRIMARY KEY, body TEXT NOT NULL)",
     "CREATE TABLE IF NOT EXISTS reports (agent_id TEXT PRIMARY KEY, body TEXT NOT NULL)",
     """CREATE TABLE IF NOT EXISTS timings (
          job_id TEXT NOT NULL, rank INTEGER NOT NULL, body TEXT NOT NULL,
          PRIMARY KEY (job_id, rank))"""),
    # 1 -> 2: each job's training progress (latest loss and eval metric). Stored
    # timings need no change: their JSON bodies gained optional keys, and the old
    # bodies read back with loss and eval_metric None.
    ("CREATE TABLE IF NOT EXISTS progress (job_id TEXT PRIMARY KEY, body TEXT NOT NULL)",),
    # 2 -> 3: layer times each device measured on a job (issue 14). Stored jobs,
    # agents and reports need no change: their JSON bodies gained keys with
    # defaults (slot_iterations 0, probe_dtype / probe_shape "").
    ("""CREATE TABLE IF NOT EXISTS measurements (
          job_id TEXT NOT NULL, device_id TEXT NOT NULL, body TEXT NOT NULL,
          PRIMARY KEY (job_id, device_id))""",),
    # 3 -> 4: drained hosts (issue 16). Stored jobs and slot statuses need no change:
    # their JSON bodies gained keys with defaults (started_ms, ended_ms, reason; spent,
    # updated_ms), and the new states ("succeeded", "failed") are only ever written.
    ("CREATE TABLE IF NOT EXISTS drains (host TEXT PRIMARY KEY, body TEXT NOT NULL)",),
    # 4 -> 5: launches of jobs with an entry point (issue 16, launch). Stored jobs need
    # no change: their JSON bodies gained `entry` (empty: no entry point), and agents
    # `launches` (false until the agent registers again).
    ("""CREATE TABLE IF NOT EXISTS launches (
          seq INTEGER PRIMARY KEY AUTOINCREMENT,
          launch_id TEXT UNIQUE NOT NULL, job_id TEXT NOT NULL, body TEXT NOT NULL)""",
     "CREATE INDEX IF NOT EXISTS launches_job ON launches(job_id)"),
)
SCHEMA_VERSION = len(_MIGRATIONS)
_TABLES = tuple(m[1] for step in _MIGRATIONS for statement in step
                if (m := re.match(r"\s*CREATE TABLE IF NOT EXISTS (\w+)", statement)))
"""The tables the migrations create, which an open store must have."""
"""The schema version this code writes (``PRAGMA user_version``)."""

#: Primary SQLite result codes that mean the storage failed rather than the statement
#: (a constraint, an SQL error): these become StorageFull / StorageUnavailable.
_FAULT_CODES = frozenset({
    sqlite3.SQLITE_PERM, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_NOMEM,
    sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_NOTADB})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_RESTORE = "move it aside and restore a backup, or start with an empty state dir"

log = logging.getLogger("hetpilot.daemon.store")


def _primary_code(exc: sqlite3.Error) -> int | None:
    """SQLite's primary result code (the low byte of an extended one: SQLITE_IOERR for
    SQLITE_IOERR_WRITE); None for errors of the sqlite3 module itself (a closed database)."""
    code = exc.sqlite_errorcode
    return None if code is None else code & 0xFF


def _storage_error(exc: BaseException) -> StorageError | None:
    """``exc`` as a StorageError, chained by the caller; None when it is no storage fault
    (a bug, a constraint violation, a missing job): that propagates unchanged."""
    if isinstance(exc, OSError):
        full = exc.errno in _FULL_ERRNOS
    elif isinstance(exc, sqlite3.Error):
        code = _primary_code(exc)
        if code not in _FAULT_CODES:
            return None
        full = code == sqlite3.SQLITE_FULL
    else:
        return None
    if full:
        return StorageFull(f"state store full: {exc}")
    return StorageUnavailable(f"state store unavailable: {exc}")


@contextmanager
def _faults_raised() -> Iterator[None]:
    """Re-raise a storage fault as StorageFull / StorageUnavailable, anything else as it is."""
    try:
        yield
    except (sqlite3.Error, OSError) as exc:
        fault = _storage_error(exc)
        if fault is None:
            raise
        raise fault from exc


_SQLITE_HEADER = b"SQLite format 3\x00"


def _short_of_header(header: bytes, size: int) -> bool:
    """Whether a file of ``size`` bytes is shorter than the database its 100-byte header
    describes (page size, bytes 16-17, times the page count, bytes 28-31; the count is
    valid when the change counter, bytes 24-27, equals bytes 92-95). A checkpoint writes
    page 1 with the count of the pages it leaves in the file, and SQLite itself takes a
    file shorter than its count for a damaged one: so this is a truncation that kept
    the header."""
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    return header[24:28] == header[92:96] and size < page_size * pages


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class SchemaError(RuntimeError):
    """The database was written by a newer daemon (a higher schema version)."""


class SqliteStore(Store):
    """SQLite in WAL mode with synchronous=NORMAL: a committed write survives the
    process being killed (it is in the WAL file); only a power loss may drop the
    last transactions. Safe to call from several threads (one lock).

    Every write runs in :meth:`_transaction`; opening checks the file first (see
    :meth:`_open`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._notify_lock = threading.RLock()  # a callback may write, which notifies again
        self._writable = self._notified = True
        try:
            self._db = self._open(self.path)
        except (StorageFull, StorageUnavailable) as exc:  # DamagedStore names the path
            raise type(exc)(f"{self.path}: {exc} (can the daemon's user write to "
                            f"{self.path.parent}?)") from exc
        self._file: int | None = None
        """A descriptor of the database file as opened, for :meth:`_check_file`."""
        self._file_lost: str | None = None
        """Set once the database file was found deleted, replaced, truncated or overwritten."""
        try:
            self._migrate()
            self._check_tables()
            self._file = os.open(self.path, os.O_RDONLY)
        except BaseException:
            self._db.close()
            raise
        self._identity = _identity(os.fstat(self._file))
        self._wal = self.path.with_name(self.path.name + "-wal")
        self._wal_identity = _identity(os.stat(self._wal)) if self._wal.exists() else None

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        """Connect, refusing a damaged database; a missing file becomes a new one. A 0-byte
        file is refused too (SQLite would take it for a new database): this store writes
        its header on creation, so 0 bytes means the file was truncated or never written."""
        with _faults_raised():
            if path.exists() and path.stat().st_size == 0:
                raise DamagedStore(f"{path} is empty (0 bytes), not a database: remove it to "
                                   "start with a new state, or restore a backup")
            db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        try:
            with _faults_raised():
                try:
                    db.execute("PRAGMA busy_timeout=5000")
                    # checked before anything writes to it (setting WAL on an old database does)
                    rows = db.execute("PRAGMA quick_check").fetchall()
                    if rows != [("ok",)]:
                        detail = _one_line("; ".join(str(r[0]) for r in rows))
                        raise DamagedStore(f"{path} is damaged (quick_check: {detail}); {_RESTORE}")
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute("PRAGMA synchronous=NORMAL")
                except sqlite3.DatabaseError as exc:
                    if _primary_code(exc) not in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                        raise
                    raise DamagedStore(f"{path} is damaged ({_one_line(str(exc))}); "
                                       f"{_RESTORE}") from exc
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
                               f"({type(exc).__name__}: {_one_line(str(exc))[:200]}); "
                               f"{_RESTORE}") from exc

    def _check_tables(self) -> None:
        """Every table the migrations create is there (one dropped by hand would make
        every call that reads it fail)."""
        have = {r[0] for r in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type='table'").fetchall()}
        missing = [t for t in _TABLES if t not in have]
        if missing:
            raise DamagedStore(f"{self.path} has schema version {SCHEMA_VERSION} but no "
                               f"table {', '.join(missing)}; {_RESTORE}")

    def _migrate(self) -> None:
        # BEGIN IMMEDIATE: one daemon migrates; a second waits, then sees it done
        with self._transaction() as db:
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise SchemaError(
                    f"{self.path} has schema version {version}, newer than this daemon's "
                    f"{SCHEMA_VERSION}: run the daemon release that wrote it (or a newer one)")
            for step in _MIGRATIONS[version:]:
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
        anything else unchanged. A commit sets ``writable``."""
        try:
            with self._lock:
                lost = self._check_file()
                if lost is not None:
                    self._writable = False
                    raise StorageUnavailable(lost)
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException as exc:
                    self._rollback(exc)
                    fault = _storage_error(exc)
                    if fault is None:
                        raise
                    self._writable = False
                    raise fault from exc
                self._writable = True
        finally:
            self._notify()

    def _check_file(self) -> str | None:
        """Why the database file can no longer take writes, or None: it was deleted or
        replaced (another file at its path), truncated (shorter than its header says) or
        overwritten (no SQLite header) while the daemon ran. SQLite would go on answering
        from its cache and WAL and acknowledge writes that are lost, and its checkpoint
        would write pages into whatever is there now; so every write checks first (one
        stat and a 100-byte read), and once it fails the store stays refusing until a
        restart, which checks the file as at any start."""
        if self._file_lost is None and self._file is not None:
            problem = None
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                problem = "was deleted"
            else:
                if _identity(now) != self._identity:
                    problem = "was replaced by another file"
                else:
                    header = os.pread(self._file, 100, 0)
                    if header[:16] != _SQLITE_HEADER:
                        problem = ("was truncated" if now.st_size < 16 else
                                   "was overwritten (no SQLite header)")
                    elif len(header) < 100 or _short_of_header(header, now.st_size):
                        problem = "was truncated"
            if problem is not None:
                self._file_lost = (f"{self.path} {problem} while the daemon ran; what it "
                                   "held is only in memory now and writes are refused. "
                                   f"Stop the daemon, then {_RESTORE}")
                log.error("%s", self._file_lost)
        return self._file_lost

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
        with self._lock, _faults_raised():
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock, _faults_raised():
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
        with self._lock:
            lost = self._check_file()
            try:
                # no checkpoint into a file that is not ours any more (see _check_file)
                if lost is None:
                    with _faults_raised():
                        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                if lost is None:
                    self._db.close()
                else:
                    self._abandon()
                if self._file is not None:
                    os.close(self._file)
                    self._file = None

    def _abandon(self) -> None:
        """Leave the connection to a lost file open for good and move its WAL aside.
        Closing it would not do: SQLite's close checkpoints the WAL into the database
        file through the descriptor it holds, writing pages into a file truncated or
        overwritten in place (a backup copied there included); the process's exit
        releases the descriptor without that. The WAL, which holds the last writes,
        goes to ``state.db-wal.lost``: left next to the path, the next start would read
        it as the WAL of whatever file is there now."""
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._db))  # never deallocated: closed
        try:
            if (self._wal_identity is None or not self._wal.exists()
                    or _identity(os.stat(self._wal)) != self._wal_identity):
                return  # deleted with the database, or not ours
            aside = self._wal.with_name(self._wal.name + ".lost")
            os.replace(self._wal, aside)
            log.warning("%s moved to %s: the WAL of the lost database file, kept for "
                        "inspection; the next start does not read it", self._wal, aside)
        except OSError as exc:
            log.warning("%s: not moved aside (%s); move or delete it before the next start "
                        "(it would be read as the WAL of the file at %s)", self._wal, exc,
                        self.path)
