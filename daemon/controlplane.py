"""The daemon's control plane: jobs (submit, view, cancel, finish, budgets), their
control loops, plan watchers and output streams, composed with the parts that hold
the rest: agent membership (:mod:`~hetpilot.daemon.membership`), the observed
cluster (:mod:`~hetpilot.daemon.cluster_view`), trainers' measurements
(:mod:`~hetpilot.daemon.trainers`), launches (:mod:`~hetpilot.daemon.launches`)
and the planning processes (:mod:`~hetpilot.daemon.planner_process`). The parts
never import this module; where they call back they name what they need as a
``Protocol``, which :class:`ControlPlane` satisfies. No protobuf here: the
servicers translate (:mod:`hetpilot.daemon.convert`) and map the errors of
:mod:`hetpilot.daemon.errors` to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import Any

from hetpilot.adapt.online import Adapter
from hetpilot.planner.controller import Controller
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.types import Cluster

from . import cluster_view
from .config import DaemonConfig
from .errors import FailedPrecondition, NotFound
from .job_model import MIN_SLOT_S, check_batch, parse_model, to_job
from .joblogs import HostReader, LineFilter
from .jobloop import JobLoop
from .launches import Launches
from .measured_fit import Measured
from .membership import Membership, short_list
from .metrics import Metrics
from .planner_process import PlannerProcess
from .records import (
    JOB_CANCELLED,
    JOB_FAILED,
    JOB_PENDING,
    JOB_RUNNING,
    JOB_SUCCEEDED,
    AgentRecord,
    AgentReport,
    DrainRecord,
    JobRecord,
    JobView,
    MeasurementRecord,
    PlanRecord,
    TimingsRecord,
)
from .store import Store
from .trainers import Trainers

log = logging.getLogger("hetpilot.daemon")

__all__ = ["LOGS_SETTLE_S", "ControlPlane"]

LOGS_SETTLE_S = 15.0
"""A followed job's output stream ends this long after the job ended even if a host's
launch never reported its exit (its agent is gone)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class ControlPlane:
    """Jobs and their loops, watchers and output, composed with membership, trainers,
    launches and the planning processes. Methods run on the event loop thread."""

    def __init__(self, store: Store, config: DaemonConfig, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 adapter: Adapter | None = None) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics or Metrics()
        # Random-forest slowdown estimator (hetpilot.adapt): fed by reports and
        # stage timings, read by the observed cluster; fits in its own thread.
        self.adapter = adapter if adapter is not None else Adapter()
        self.members = Membership(store, config, self.metrics, self, clock)
        self.trainers = Trainers(store, config, self.members, self.adapter)
        self._plan_events: dict[str, asyncio.Event] = {}
        self._loops: dict[str, JobLoop] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop_errors: dict[str, str] = {}
        self._stopping = False
        self._queues: dict[str, dict[str, float]] = {}
        self.planner = PlannerProcess(config.planner_memory_mb)
        # jobs with an entry point: their launches, orders to agents, output
        self.launches = Launches(self)

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        for rec in self.store.list_jobs():
            if not rec.ended:
                self._start_loop(rec.job_id)
        self._tasks.append(asyncio.create_task(self._sweep(), name="liveness-sweep"))

    def _start_loop(self, job_id: str) -> None:
        if job_id not in self._loops:
            loop = JobLoop(self, job_id)
            self._loops[job_id] = loop
            loop.start()
            self.metrics.jobs.set(len(self._loops))

    def end_streams(self) -> None:
        """End every plan stream (WatchPlans) at its next turn: the daemon is stopping."""
        self._stopping = True
        for ev in self._plan_events.values():
            ev.set()
        self.launches.logs.notify_all()  # log followers too (UNAVAILABLE: they resume)

    async def stop(self) -> None:
        self.end_streams()
        for t in self._tasks:
            t.cancel()
        for loop in list(self._loops.values()):
            await loop.stop()
        self._loops.clear()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for ev in self._plan_events.values():
            ev.set()  # wake watchers so they see the stop
        self.planner.close()  # a solve under way is abandoned, its process killed

    def loop_done(self, job_id: str, loop: JobLoop) -> None:
        if self._loops.get(job_id) is loop:
            del self._loops[job_id]
        self.trainers.forget(job_id)  # the store keeps the measurements
        self._loop_errors.pop(job_id, None)
        self.set_queues(job_id, {})
        self.metrics.jobs.set(len(self._loops))
        self.metrics.loops_failing.set(len(self._loop_errors))

    def loop_failed(self, job_id: str, message: str | None) -> None:
        """A job loop's slot failed (``message``) or it recovered (None): shown in the
        job's warnings until the next good slot."""
        if message is None:
            self._loop_errors.pop(job_id, None)
        else:
            self._loop_errors[job_id] = message
            self.metrics.loop_failures.inc()
        self.metrics.loops_failing.set(len(self._loop_errors))

    def set_queues(self, job_id: str, queues: Mapping[str, float]) -> None:
        """Export the largest virtual-queue backlog of each cost kind over the jobs
        (per-job labels would grow the metrics without bound)."""
        if queues:
            self._queues[job_id] = dict(queues)
        else:
            self._queues.pop(job_id, None)
        kinds = {k for q in self._queues.values() for k in q}
        for kind in kinds | self.metrics.queue_kinds:
            self.metrics.queue.labels(kind=kind).set(
                max((q.get(kind, 0.0) for q in self._queues.values()), default=0.0))
        self.metrics.queue_kinds |= kinds

    # -- jobs ---------------------------------------------------------------

    def submit(self, owner: str, spec: JobRecord) -> JobRecord:
        """Validate everything, then create the job: a refused job leaves nothing stored."""
        job = to_job(spec)  # validates batch, microbatch, schedules, budgets, V
        check_batch(spec.global_batch, spec.microbatch_size)
        if spec.slot_s and spec.slot_s < MIN_SLOT_S:
            raise ValidationError("slot_s", f"must be >= {MIN_SLOT_S} s (or 0: the daemon's "
                                  f"default), got {spec.slot_s:g}")
        if spec.model_json:
            Controller(parse_model(spec.model_json), job)  # the controller's own checks
        elif not spec.profile_on_attach:
            raise ValidationError("model_json", "is required unless profile_on_attach is set")
        rec = spec.with_changes(
            job_id=uuid.uuid4().hex[:12], owner=owner,
            state=JOB_RUNNING if spec.model_json else JOB_PENDING,
            slot_s=spec.slot_s or self.config.slot_s, created_ms=_now_ms())
        created = self.store.create_job(rec)
        if created is rec:  # not a retry of an earlier submit
            log.info("job %s submitted by %s: %r, batch %d / microbatch %d, budgets %s, "
                     "slot %g s%s", rec.job_id, owner, rec.name, rec.global_batch,
                     rec.microbatch_size, dict(rec.budgets) or "none", rec.slot_s,
                     f", allowed hosts {short_list(list(rec.allowed_hosts))}"
                     if rec.allowed_hosts else "")
            unknown = self._unknown_hosts(rec)
            if unknown:
                log.warning("job %s: %s", rec.job_id, unknown)
        if not created.ended:
            self._start_loop(created.job_id)
            self.launches.submitted(created)
        return created

    def _unknown_hosts(self, rec: JobRecord) -> str | None:
        """A warning naming the job's allowed hosts that no agent registered as, if any:
        such a name is most likely a typo, and a job allowed only unknown hosts never
        gets a plan. Computed when asked, so it goes once the host registers."""
        unknown = [h for h in rec.allowed_hosts if self.members.agent(h) is None]
        if not unknown:
            return None
        scope = ("none of them is known: the job gets no devices until one registers"
                 if len(unknown) == len(rec.allowed_hosts)
                 else "the job plans on the others")
        return (f"allowed_hosts: no agent has registered as {short_list(unknown)}; {scope} "
                f"(known hosts: {short_list(sorted(self.members.hosts())) or 'none yet'})")

    def _own(self, owner: str | None, job_id: str) -> JobRecord:
        if not job_id:
            raise ValidationError("job_id", "must not be empty")
        rec = self.store.get_job(job_id)
        if rec is None or (owner is not None and rec.owner != owner):
            raise NotFound(f"job {job_id[:64]!r} not found")
        return rec

    def _view(self, rec: JobRecord) -> JobView:
        status = self.store.job_status(rec.job_id)[0]
        error = self._loop_errors.get(rec.job_id)
        if error is not None:
            status = replace(status, warnings=(error, *status.warnings))
        unknown = None if rec.ended else self._unknown_hosts(rec)
        if unknown is not None:
            status = replace(status, warnings=(*status.warnings, unknown))
        waiting = self.launches.stopping(rec) if rec.ended else self.launches.waiting(rec.job_id)
        if waiting is not None:
            status = replace(status, warnings=(*status.warnings, waiting))
        return JobView(rec, status, self.store.progress(rec.job_id))

    def get(self, owner: str | None, job_id: str) -> JobView:
        return self._view(self._own(owner, job_id))

    def list_jobs(self, owner: str, include_cancelled: bool = False) -> list[JobView]:
        return [self._view(r) for r in self.store.list_jobs(owner)
                if include_cancelled or r.state != JOB_CANCELLED]

    async def cancel(self, owner: str, job_id: str) -> JobView:
        """Idempotent for a cancelled job. A failed job may be cancelled (then no trainer
        can attach to run it again); one that succeeded stays so."""
        rec = self._own(owner, job_id)
        if rec.state == JOB_SUCCEEDED:
            raise FailedPrecondition(f"job {job_id} has already succeeded: nothing to cancel")
        if rec.state != JOB_CANCELLED:
            rec = await self.end_job(rec, JOB_CANCELLED, "cancelled by the owner")
        return self._view(rec)

    async def finish(self, job_id: str, outcome: str, reason: str) -> JobRecord:
        """The trainer says the job ended (``outcome``: succeeded or failed). The same
        outcome again is a no-op (a retried call keeps the first reason); a cancelled
        job, or one that ended the other way, refuses."""
        rec = self._own(None, job_id)
        if rec.state == outcome:
            return rec
        if rec.state == JOB_CANCELLED:
            raise FailedPrecondition(f"job {job_id} is cancelled: it cannot be finished")
        if rec.ended:
            raise FailedPrecondition(f"job {job_id} has already ended ({rec.state})")
        if not reason:
            reason = "finished" if outcome == JOB_SUCCEEDED else "the trainer failed"
        return await self.end_job(rec, outcome, reason)

    async def end_job(self, rec: JobRecord, state: str, reason: str) -> JobRecord:
        """End ``rec`` (not ended yet; cancel, FinishJob, its launch's outcome): store
        the end, stop its control loop and end its plan streams. Jobs
        plan on the whole cluster without reserving devices from each other, so an
        ended job frees nothing in other jobs' planning: its load on the devices
        shows in the agents' next reports."""
        rec = rec.with_changes(state=state, ended_ms=_now_ms(), reason=reason)
        self.store.update_job(rec)
        log.info("job %s %s: %s", rec.job_id, state, reason)
        self.launches.job_ended(rec)  # running ranks stop at their agents' next reports
        loop = self._loops.pop(rec.job_id, None)
        if loop is not None:
            await loop.stop()
        self.metrics.jobs.set(len(self._loops))
        self.notify(rec.job_id)
        return rec

    def job_loop(self, job_id: str) -> JobLoop | None:
        """The job's control loop while it runs (None once it has ended)."""
        return self._loops.get(job_id)

    def update_budgets(self, owner: str, job_id: str, budgets: Mapping[str, float],
                       V: float | None) -> JobView:
        rec = self._own(owner, job_id)
        if rec.ended:
            raise FailedPrecondition(f"job {job_id} has ended ({rec.state})")
        new = rec.with_changes(budgets={**rec.budgets, **budgets},
                               V=rec.V if V is None else V)
        job = to_job(new)
        if new.model_json:
            Controller(parse_model(new.model_json), job)
        self.store.update_job(new)
        loop = self._loops.get(job_id)
        if loop is not None:
            loop.set_budgets(new.budgets, new.V)
        return self._view(new)

    def notify(self, job_id: str) -> None:
        ev = self._plan_events.pop(job_id, None)
        if ev is not None:
            ev.set()

    async def watch(self, owner: str | None, job_id: str,
                    after_version: int) -> AsyncIterator[PlanRecord]:
        """Stored versions after ``after_version``, then new ones, until the job ends."""
        self._own(owner, job_id)
        last = after_version
        while True:
            ev = self._plan_events.setdefault(job_id, asyncio.Event())
            for plan in self.store.plans(job_id, last):
                last = plan.version
                yield plan
            rec = self.store.get_job(job_id)
            if rec is None or rec.ended or self._stopping:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout=5.0)

    def job_ended(self, job_id: str) -> bool:
        """Whether the job has ended (or is not known)."""
        rec = self.store.get_job(job_id)
        return rec is None or rec.ended

    @property
    def stopping(self) -> bool:
        """The daemon is stopping (streams end at their next turn)."""
        return self._stopping

    async def stream_logs(self, owner: str | None, job_id: str, rank: int | None,
                          follow: bool, resume_from: Mapping[str, int] | None = None
                          ) -> AsyncIterator[tuple[str, bytes, int]]:
        """(host, whole lines, offset in the host's output after them) of a launched
        job's output: what is kept (each host in ``resume_from`` from that offset), then
        with ``follow`` what comes, until the job has ended and every host's output has
        arrived (or :data:`LOGS_SETTLE_S` after the end, for a host that never tells),
        or the daemon stops (:attr:`stopping`)."""
        rec = self._own(owner, job_id)
        if not rec.entry:
            raise FailedPrecondition(f"job {job_id} has no entry point (its ranks were not "
                                     "launched by the agents): their output is where they run")
        logs = self.launches.logs
        due = self.launches.logs_expire_ms(rec)
        if due is not None and _now_ms() >= due and not logs.job_dir(job_id).exists():
            raise FailedPrecondition(
                f"job {job_id}'s output was removed: it ended over "
                f"{self.config.log_retention_hours:g} h ago (daemon log_retention_hours)")
        starts = dict(resume_from or {})
        readers: dict[str, tuple[HostReader, LineFilter]] = {}
        while True:
            ev = logs.event(job_id)
            rec = self.store.get_job(job_id) or rec
            launch = self.launches.get(job_id)
            done = not follow or self._stopping or (rec.ended and (
                launch is None or self.launches.output_complete(launch)
                or _now_ms() - rec.ended_ms > LOGS_SETTLE_S * 1000))
            for host in [h.host for h in launch.hosts] if launch is not None else []:
                reader, lines = readers.setdefault(
                    host, (logs.reader(job_id, host, starts.get(host)), LineFilter(rank)))
                while data := await asyncio.to_thread(reader.read):
                    if out := lines.feed(data):
                        yield host, out, (reader.offset or 0) - lines.pending
                if done and not self._stopping and (out := lines.feed(b"", final=True)):
                    yield host, out, reader.offset or 0  # (stopping: resumed from here)
            if done:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout=1.0)

    # -- agents (self.members; the callbacks below are its MembershipListener) ---

    def is_up(self, host: str) -> bool:
        return self.members.is_up(host)

    def agent_table(self) -> list[tuple[AgentRecord, bool, AgentReport | None]]:
        return self.members.agent_table()

    def drained(self) -> Mapping[str, DrainRecord]:
        return self.members.drained()

    def host_up(self, host: str) -> None:
        self._wake_idle()

    def registered(self, host: str) -> None:
        self.launches.try_pending()

    def reported(self, report: AgentReport) -> None:
        self.adapter.note_report(report.agent_id, report.links)

    def host_drained(self, host: str) -> int:
        """Wake the loops whose current plan uses ``host``: their plans move off at once."""
        woken = 0
        for job_id, loop in list(self._loops.items()):
            if any(d.rpartition(":")[0] == host for d in self.store.job_status(job_id)[0].devices):
                loop.wake()
                woken += 1
        return woken

    def host_resumed(self, host: str) -> None:
        self._wake_idle()
        self.launches.try_pending()

    def _wake_idle(self) -> None:
        """Run a slot now in the loops that found no device last time: a job submitted
        before its agents registered gets its first plan when they come, not a slot later."""
        for loop in self._loops.values():
            if loop.no_devices:
                loop.wake()

    async def _sweep(self) -> None:
        period = max(0.05, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.members.sweep()
            try:  # running jobs with a part on a host that went down
                await self.launches.hosts_lost()
            except Exception:
                log.exception("ending jobs on lost hosts failed")
            try:  # jobs waiting for hosts to launch on (agents came up, hosts resumed)
                self.launches.try_pending()
            except Exception:  # the sweep must go on (a store fault is retried next time)
                log.exception("launching waiting jobs failed")
            try:  # ended jobs' output past log_retention_hours
                self.launches.expire_logs()
            except Exception:
                log.exception("removing expired job output failed")

    # -- the observed cluster (cluster_view) -------------------------------------

    def observed_cluster(self, allowed_hosts: tuple[str, ...] = (),
                         only: frozenset[str] | None = None) -> Cluster:
        return cluster_view.observed_cluster(self.members, self.adapter, self.config,
                                             allowed_hosts, only)

    def device_speed(self, device_id: str) -> float:
        return cluster_view.device_speed(self.members, self.adapter, device_id)

    def emulated_devices(self) -> frozenset[str]:
        return cluster_view.emulated_devices(self.members)

    # -- trainers -----------------------------------------------------------

    def job_fits(self) -> dict[str, Measured]:
        """The measured-speed fit each running job planned its last slot with."""
        return self.trainers.fits(self._loops)

    def running_jobs(self) -> list[str]:
        return list(self._loops)

    def attach(self, job_id: str, rank: int, device_id: str, model_json: str,
               measured: MeasurementRecord | None = None, *, tensor_parallel: bool = False
               ) -> tuple[PlanRecord | None, JobRecord]:
        """Attach a rank: the latest plan (None before the first) and the job. Everything is
        checked before anything is stored: a refused attach changes nothing.
        ``tensor_parallel``: whether the attaching trainer runs tensor-parallel stages; the
        job is planned with them from its next slot exactly while its trainer says so."""
        rec = self._own(None, job_id)
        if rec.state in (JOB_CANCELLED, JOB_SUCCEEDED):
            raise FailedPrecondition(f"job {job_id} is {rec.state}")
        new_model = None
        if model_json and not rec.model_json:
            if not rec.profile_on_attach:
                raise FailedPrecondition(f"job {job_id} already has a model profile")
            new_model = parse_model(model_json)
        if measured is not None:
            self.trainers.check_measurement(
                measured, new_model or (self.trainers.model(rec) if rec.model_json else None))
        changes = _attach_changes(rec, model_json if new_model is not None else "",
                                  tensor_parallel)
        if changes:
            revived = rec.state == JOB_FAILED
            rec = rec.with_changes(**changes)
            self.store.update_job(rec)
            if new_model is not None:
                self.trainers.set_model(job_id, new_model)
            if revived:
                log.info("job %s: a trainer attached again after it failed; running again",
                         job_id)
                self._start_loop(job_id)
            loop = self._loops.get(job_id)
            if loop is not None and (new_model is not None or "tensor_parallel" in changes):
                loop.wake()
        if measured is not None:
            self.trainers.add_measurement(job_id, device_id, measured)
        self.trainers.attached[(job_id, rank)] = device_id
        plans = self.store.plans(job_id, max(0, self.store.job_status(job_id)[0].plan_version - 1))
        return (plans[-1] if plans else None), rec

    async def planning_inputs(self, rec: JobRecord) -> tuple[Cluster, JobRecord]:
        """The cluster and job record one slot of ``rec`` plans with: the observed cluster,
        and when the job's trainer measured, its fitted speeds and model."""
        # live tables: on the loop; a launched job plans on the devices that have a rank
        cluster = self.observed_cluster(rec.allowed_hosts, self.launches.devices(rec))
        measured = await self.trainers.fit(rec)
        if measured is None:
            return cluster, rec
        return measured.apply(cluster), rec.with_changes(model_json=measured.model_json)

    def stage_timings(self, timings: TimingsRecord) -> None:
        """Keep a rank's stage timings and, when they carry a loss or an eval metric, the
        job's training progress (in the same transaction); then feed the estimator. An
        ended job refuses them."""
        rec = self._own(None, timings.job_id)
        if rec.ended:  # its progress (the final loss) is the record of how it ended
            raise FailedPrecondition(f"job {timings.job_id} has ended ({rec.state}): its "
                                     "stage timings are no longer taken")
        current = self.store.progress(timings.job_id)
        progress = current.updated(timings)  # `current` itself when nothing changed
        self.store.put_timings(timings, None if progress is current else progress)
        loop = self._loops.get(timings.job_id)
        if loop is not None:
            loop.note_iteration(timings.iteration)
        try:
            self.trainers.learn(rec, timings)
        except Exception:  # learning must never fail the trainer's report
            log.exception("estimator: timings not learnt")


def _attach_changes(rec: JobRecord, new_model_json: str, tensor_parallel: bool
                    ) -> dict[str, Any]:
    """What an attach changes in the job's record: a first model profile runs the job, a
    failed job runs again (a restarted trainer), the first attach starts its clock, and the
    trainer says whether it runs tensor-parallel stages."""
    changes: dict[str, Any] = {}
    if new_model_json:
        changes.update(model_json=new_model_json, state=JOB_RUNNING)
    if rec.state == JOB_FAILED:
        changes.update(state=JOB_RUNNING if rec.model_json or new_model_json else JOB_PENDING,
                       ended_ms=0, reason="")
    if not rec.started_ms:
        changes.update(started_ms=_now_ms())
    if tensor_parallel != rec.tensor_parallel:
        changes.update(tensor_parallel=tensor_parallel)
    return changes
