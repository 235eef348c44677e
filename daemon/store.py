"""The daemon's state behind one interface: :class:`Store`.

Two implementations pass the same contract test
(tests/controlplane/test_store_contract.py): :class:`MemoryStore` for unit
tests and :class:`~.sqlite_store.SqliteStore` (WAL) for the daemon. A slot's status, the
controller's state (virtual queues included) and a new plan version are
written in one transaction, so kill -9 leaves either the slot before or the
slot after, never half of one; so are a trainer's stage timings and the job's
training progress they update. The layer times each device measured for a job
are kept too (the latest per job and device), so a restarted daemon plans with
them at once, and so are the drained hosts, so a restart keeps them drained,
and each job's launch (hosts, rendezvous, each host's state), so a restart
neither launches a job twice nor forgets what runs.

The SQLite schema is versioned (``PRAGMA user_version``, see :mod:`.sqlite_schema`):
opening a database runs the migrations it lacks in one transaction, and a
database written by a newer daemon is refused rather than half understood.

Under storage faults the store promises: a write that fails commits nothing of
itself and raises :class:`~.errors.StorageFull` (disk or quota full) or
:class:`~.errors.StorageUnavailable` (I/O error, damaged page, locked, read-only),
never a secondary error such as a failed rollback; reads raise
``StorageUnavailable``. ``writable`` is False from a failed write until the next
write or :meth:`Store.probe` that commits. Opening a database that is empty,
not a database, or fails ``PRAGMA quick_check`` raises :class:`~.errors.DamagedStore`.
A full disk loses nothing acknowledged, and writes resume once there is room again,
without a restart (see :mod:`.sqlite_file`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

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

__all__ = ["MemoryStore", "Store"]


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
    def put_reports(self, reports: Sequence[AgentReport]) -> None:
        """:meth:`put_report` of each, in one transaction (a group commit): all are kept
        or none; later ones win over earlier ones of the same agent."""

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

    def put_reports(self, reports: Sequence[AgentReport]) -> None:
        for report in reports:
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
