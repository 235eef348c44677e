"""The daemon's state behind one interface: :class:`Store`.

Two implementations pass the same contract test
(tests/controlplane/test_store_contract.py): :class:`MemoryStore` for unit
tests and :class:`SqliteStore` (WAL) for the daemon. A slot's status, the
controller's state (virtual queues included) and a new plan version are
written in one transaction, so kill -9 leaves either the slot before or the
slot after, never half of one; so are a trainer's stage timings and the job's
training progress they update.

The SQLite schema is versioned (``PRAGMA user_version``, :data:`SCHEMA_VERSION`):
opening a database runs the migrations it lacks in one transaction, and a
database written by a newer daemon is refused rather than half understood.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from .records import (
    AgentRecord,
    AgentReport,
    JobProgress,
    JobRecord,
    JobStatus,
    PlanRecord,
    TimingsRecord,
)

__all__ = ["SCHEMA_VERSION", "MemoryStore", "SchemaError", "SqliteStore", "Store"]


class Store(ABC):
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
)
SCHEMA_VERSION = len(_MIGRATIONS)
"""The schema version this code writes (``PRAGMA user_version``)."""


class SchemaError(RuntimeError):
    """The database was written by a newer daemon (a higher schema version)."""


class SqliteStore(Store):
    """SQLite in WAL mode with synchronous=NORMAL: a committed write survives the
    process being killed (it is in the WAL file); only a power loss may drop the
    last transactions. Safe to call from several threads (one lock)."""

    def __init__(self, path: str | Path) -> None:
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate(str(path))

    def _migrate(self, path: str) -> None:
        self._db.execute("BEGIN IMMEDIATE")  # one daemon migrates; a second waits, then sees it
        try:
            version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise SchemaError(
                    f"{path} has schema version {version}, newer than this daemon's "
                    f"{SCHEMA_VERSION}: run the daemon release that wrote it (or a newer one)")
            for step in _MIGRATIONS[version:]:
                for statement in step:
                    self._db.execute(statement)
            if version != SCHEMA_VERSION:
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION:d}")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            self._db.close()
            raise

    @property
    def schema_version(self) -> int:
        return int(self._one("PRAGMA user_version", ())[0])

    def _one(self, sql: str, args: tuple[Any, ...]) -> Any:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self._db.execute(sql, args)

    def create_job(self, job: JobRecord) -> JobRecord:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if job.request_id:
                    row = self._db.execute(
                        "SELECT body FROM jobs WHERE owner=? AND request_id=?",
                        (job.owner, job.request_id)).fetchone()
                    if row:
                        self._db.execute("COMMIT")
                        return JobRecord.from_json(row[0])
                self._db.execute(
                    "INSERT INTO jobs(job_id, owner, request_id, body) VALUES (?,?,?,?)",
                    (job.job_id, job.owner, job.request_id, job.to_json()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return job

    def get_job(self, job_id: str) -> JobRecord | None:
        row = self._one("SELECT body FROM jobs WHERE job_id=?", (job_id,))
        return JobRecord.from_json(row[0]) if row else None

    def list_jobs(self, owner: str | None = None) -> list[JobRecord]:
        if owner is None:
            rows = self._all("SELECT body FROM jobs ORDER BY seq")
        else:
            rows = self._all("SELECT body FROM jobs WHERE owner=? ORDER BY seq", (owner,))
        return [JobRecord.from_json(r[0]) for r in rows]

    def update_job(self, job: JobRecord) -> None:
        with self._lock:
            cur = self._db.execute("UPDATE jobs SET body=? WHERE job_id=?",
                                   (job.to_json(), job.job_id))
        if cur.rowcount != 1:
            raise KeyError(job.job_id)

    def record_slot(self, job_id: str, *, status: JobStatus, controller_state: dict[str, Any],
                    plan: PlanRecord | None = None) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO job_status(job_id, status, controller_state)"
                    " VALUES (?,?,?)", (job_id, status.to_json(), json.dumps(controller_state)))
                if plan is not None:
                    self._db.execute("INSERT INTO plans(job_id, version, body) VALUES (?,?,?)",
                                     (job_id, plan.version, plan.to_json()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def job_status(self, job_id: str) -> tuple[JobStatus, dict[str, Any] | None]:
        row = self._one("SELECT status, controller_state FROM job_status WHERE job_id=?",
                        (job_id,))
        if not row:
            return JobStatus(), None
        return JobStatus.from_json(row[0]), json.loads(row[1])

    def plans(self, job_id: str, after_version: int = 0) -> list[PlanRecord]:
        rows = self._all("SELECT body FROM plans WHERE job_id=? AND version>? ORDER BY version",
                         (job_id, after_version))
        return [PlanRecord.from_json(r[0]) for r in rows]

    def put_agent(self, agent: AgentRecord) -> None:
        self._write("INSERT OR REPLACE INTO agents(host, body) VALUES (?,?)",
                    (agent.host, agent.to_json()))

    def agents(self) -> list[AgentRecord]:
        return [AgentRecord.from_json(r[0]) for r in self._all("SELECT body FROM agents")]

    def put_report(self, report: AgentReport) -> None:
        self._write("INSERT OR REPLACE INTO reports(agent_id, body) VALUES (?,?)",
                    (report.agent_id, report.to_json()))

    def latest_reports(self) -> dict[str, AgentReport]:
        reports = (AgentReport.from_json(r[0]) for r in self._all("SELECT body FROM reports"))
        return {r.agent_id: r for r in reports}

    def put_timings(self, timings: TimingsRecord, progress: JobProgress | None = None) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO timings(job_id, rank, body) VALUES (?,?,?)",
                    (timings.job_id, timings.rank, timings.to_json()))
                if progress is not None:
                    self._db.execute("INSERT OR REPLACE INTO progress(job_id, body) VALUES (?,?)",
                                     (timings.job_id, progress.to_json()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def latest_timings(self, job_id: str) -> list[TimingsRecord]:
        rows = self._all("SELECT body FROM timings WHERE job_id=? ORDER BY rank", (job_id,))
        return [TimingsRecord.from_json(r[0]) for r in rows]

    def progress(self, job_id: str) -> JobProgress:
        row = self._one("SELECT body FROM progress WHERE job_id=?", (job_id,))
        return JobProgress.from_json(row[0]) if row else JobProgress()

    def close(self) -> None:
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
