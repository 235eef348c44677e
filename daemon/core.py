"""The daemon's handlers: explicit state (a Store, the live agent table, the
job loops) and the operations the servicers call. No protobuf here: the
servicers translate (:mod:`hetpilot.daemon.convert`) and map the errors of
:mod:`hetpilot.daemon.errors` to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import Any

from hetpilot.adapt.online import Adapter
from hetpilot.planner.controller import Controller
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import job_from_dict, model_from_dict, plan_from_dict
from hetpilot.planner.types import Cluster, Device, Job, Link, Model, Network

from .config import DaemonConfig
from .errors import FailedPrecondition, NotFound
from .joblogs import HostReader, LineFilter
from .launches import Launches
from .measured import Measured, fit_job
from .metrics import Metrics
from .planning import PlannerProcess
from .records import (
    JOB_CANCELLED,
    JOB_FAILED,
    JOB_PENDING,
    JOB_RUNNING,
    JOB_SUCCEEDED,
    AgentRecord,
    AgentReport,
    DeviceInfo,
    DeviceReport,
    DrainRecord,
    JobRecord,
    JobView,
    LinkTime,
    MeasurementRecord,
    PlanRecord,
    TimingsRecord,
)
from .store import Store

log = logging.getLogger("hetpilot.daemon")

__all__ = ["LOGS_SETTLE_S", "MAX_LAYERS", "MAX_MICROBATCHES", "MIN_SLOT_S", "PEERS_PER_AGENT",
           "ControlPlane", "check_batch", "parse_model", "to_job"]

#: Each agent probes this many peers (its successors in host order), so probe
#: traffic grows linearly with the cluster; unmeasured pairs take the defaults.
PEERS_PER_AGENT = 4
MIN_SLOT_S = 0.05
"""Shortest controller slot a job may ask for (a shorter one only burns the planner)."""


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


MAX_LAYERS = 1024
"""Layers of a job's model: planning costs O(L^2) memory and time per device kind
(a 1024-layer model takes about 25 s and 600 MB on its first slot); group finer
operators into layers beyond that."""
LOGS_SETTLE_S = 15.0
"""A followed job's output stream ends this long after the job ended even if a host's
launch never reported its exit (its agent is gone)."""
MAX_MICROBATCHES = 16384
"""Microbatches per iteration (global_batch / microbatch_size): the reference model
simulates each one on each stage."""


def parse_model(text: str, path: str = "model_json") -> Model:
    """A spec v1 model from JSON, refusing by field what the planner cannot hold."""
    try:
        data = json.loads(text, parse_constant=_reject_constant)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # lone surrogates ("\ud800")
    except RecursionError:
        raise ValidationError(path, "is nested too deeply") from None
    except UnicodeEncodeError:
        raise ValidationError(path, "holds a lone UTF-16 surrogate escape, not valid "
                                    "Unicode") from None
    except ValueError as exc:
        raise ValidationError(path, f"is not valid JSON: {exc}") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if isinstance(layers, list) and len(layers) > MAX_LAYERS:
        raise ValidationError(f"{path}.layers", f"at most {MAX_LAYERS} layers, got {len(layers)} "
                              "(group finer operators into layers)")
    return model_from_dict(data, path)


def check_batch(global_batch: int, microbatch_size: int) -> None:
    microbatches = -(-global_batch // microbatch_size)
    if microbatches > MAX_MICROBATCHES:
        raise ValidationError("global_batch", f"asks for {microbatches} microbatches per "
                              f"iteration (global_batch / microbatch_size); at most "
                              f"{MAX_MICROBATCHES}: raise microbatch_size")


def _machine(probe_address: str) -> str:
    """The host part of a probe address (``10.0.0.1:7071`` -> ``10.0.0.1``)."""
    return probe_address.rpartition(":")[0] if ":" in probe_address else probe_address


def _now_ms() -> int:
    return int(time.time() * 1000)


def _names(items: list[str], limit: int = 8) -> str:
    """Up to ``limit`` names, then how many more (a warning must stay one short line)."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def to_job(rec: JobRecord) -> Job:
    return job_from_dict({"global_batch": rec.global_batch,
                          "microbatch_size": rec.microbatch_size,
                          "schedule": list(rec.schedules) or "any",
                          "budgets": dict(rec.budgets),
                          **({"V": rec.V} if rec.V else {})})  # 0: no V given, the default


class ControlPlane:
    """Jobs, agents and trainers. Methods run on the event loop thread."""

    def __init__(self, store: Store, config: DaemonConfig, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 adapter: Adapter | None = None) -> None:
        self.store = store
        # Random-forest slowdown estimator (hetpilot.adapt): fed by reports and
        # stage timings, read by observed_cluster; fits in its own thread.
        self.adapter = adapter if adapter is not None else Adapter()
        self._models: dict[str, Model] = {}
        self.config = config
        self.metrics = metrics or Metrics()
        self.clock = clock
        self._agents: dict[str, AgentRecord] = {a.host: a for a in store.agents()}
        self._reports: dict[str, AgentReport] = store.latest_reports()
        now = clock()
        # After a restart every known agent gets restart_grace_s (at least one
        # heartbeat timeout) to come back before it counts as down.
        extra = max(0.0, config.restart_grace_s - config.heartbeat_timeout_s)
        self._last_seen: dict[str, float] = dict.fromkeys(self._agents, now + extra)
        self._up: frozenset[str] = frozenset(self._agents)
        # for `hetpilot nodes`: drained hosts (persisted), when each host entered its
        # state (wall clock; the daemon's start for those it knew) and was last heard of
        self._drained: dict[str, DrainRecord] = {d.host: d for d in store.drains()}
        self.started_ms = _now_ms()
        self._since: dict[str, int] = dict.fromkeys(self._agents, self.started_ms)
        self._heard_ms: dict[str, int] = {}
        # each host's latest registration (RegisterResponse.registration; lost on a
        # restart, when every agent's stream breaks and it registers again) and the
        # report streams open under each registration
        self._registration: dict[str, str] = {}
        self._streams: dict[tuple[str, str], int] = {}
        self.membership_epoch = 0
        self._peers_cache: dict[str, tuple[tuple[str, str], ...]] = {}
        self._ring: tuple[list[str], dict[str, int]] | None = None
        self._plan_events: dict[str, asyncio.Event] = {}
        self._loops: dict[str, Any] = {}
        self._attached: dict[tuple[str, int], str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop_errors: dict[str, str] = {}
        self._stopping = False
        self._queues: dict[str, dict[str, float]] = {}
        # layer times measured by the trainers, by job and device (loaded lazily), a
        # counter bumped by each new one, and each job's last fit with its key
        self._measurements: dict[str, dict[str, MeasurementRecord]] = {}
        self._measure_epoch: dict[str, int] = {}
        self._fits: dict[str, tuple[tuple[int, int], Measured | None]] = {}
        self.planner = PlannerProcess(config.planner_memory_mb)
        self.metrics.agents_up.set(len(self._up))
        # jobs with an entry point: their launches, orders to agents, output
        self.launches = Launches(self)

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        from .control import JobLoop

        for rec in self.store.list_jobs():
            if not rec.ended:
                self._start_loop(rec.job_id, JobLoop)
        self._tasks.append(asyncio.create_task(self._sweep(), name="liveness-sweep"))

    def _start_loop(self, job_id: str, loop_cls: Any = None) -> None:
        if loop_cls is None:
            from .control import JobLoop as loop_cls
        if job_id not in self._loops:
            loop = loop_cls(self, job_id)
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

    def loop_done(self, job_id: str, loop: Any) -> None:
        if self._loops.get(job_id) is loop:
            del self._loops[job_id]
        for cache in (self._measurements, self._measure_epoch, self._fits, self._models):
            cache.pop(job_id, None)  # the store keeps the measurements
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
                     f", allowed hosts {_names(list(rec.allowed_hosts))}"
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
        unknown = [h for h in rec.allowed_hosts if h not in self._agents]
        if not unknown:
            return None
        scope = ("none of them is known: the job gets no devices until one registers"
                 if len(unknown) == len(rec.allowed_hosts)
                 else "the job plans on the others")
        return (f"allowed_hosts: no agent has registered as {_names(unknown)}; {scope} "
                f"(known hosts: {_names(sorted(self._agents)) or 'none yet'})")

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
        waiting = None if rec.ended else self.launches.waiting(rec.job_id)
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

    def job_loop(self, job_id: str) -> Any:
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

    # -- agents -------------------------------------------------------------

    def register(self, agent: AgentRecord, previous: str = ""
                 ) -> tuple[tuple[tuple[str, str], ...], str]:
        """Register ``agent``: its peers and its new registration. ``previous`` is the
        registration this agent process was given last (RegisterRequest.registration)."""
        known = self._agents.get(agent.host)
        if (known is not None and agent.host in self._up
                and _machine(known.probe_address) != _machine(agent.probe_address)):
            # another machine under a name in use (a cloned VM, a mistyped --host): its
            # reports would stand for the first's, and the launches they do not list
            # would count as exited. An agent restarted on the same machine keeps its
            # probe address's host (its port may change); one that moved to another
            # address is taken once the first is down.
            heard = (_now_ms() - self._heard_ms.get(agent.host, _now_ms())) / 1000
            raise FailedPrecondition(
                f"host {agent.host!r} is registered by a live agent with probe address "
                f"{known.probe_address or '(none)'} (heard {heard:.1f} s ago), not "
                f"{agent.probe_address or '(none)'}: give this agent another --host, or stop "
                f"the other (it is down {self.config.heartbeat_timeout_s:g} s after its "
                "last report)")
        current = self._registration.get(agent.host, "")
        if current and previous != current and self._streams.get((agent.host, current)):
            heard = (_now_ms() - self._heard_ms.get(agent.host, 0)) / 1000
            if heard < self.config.heartbeat_timeout_s:
                # a second agent process under the same name on the same machine
                # (another user's, another state directory): both would report the
                # host, take its launch orders and count each other's launches as ended
                raise FailedPrecondition(
                    f"host {agent.host!r} has a connected agent (its report stream is open, "
                    f"heard {heard:.1f} s ago): a second agent under the same name? Stop "
                    "one, or give it another --host; a restarted agent is taken once the "
                    f"old one's stream closes or {self.config.heartbeat_timeout_s:g} s "
                    "after its last report")
        agent = AgentRecord(host=agent.host, probe_address=agent.probe_address,
                            devices=agent.devices, registered_ms=int(time.time() * 1000),
                            launches=agent.launches)
        self.store.put_agent(agent)
        # a re-register of the same host, address and devices changes no one's peers
        changed = known is None or replace(known, registered_ms=0) != replace(
            agent, registered_ms=0)
        self._agents[agent.host] = agent
        if known is None:
            self._since[agent.host] = _now_ms()
            log.info("agent %s joined: %d device(s) (%s)%s", agent.host, len(agent.devices),
                     ", ".join(sorted({d.kind for d in agent.devices})),
                     f", probe server {agent.probe_address}" if agent.probe_address else "")
        elif changed:
            log.info("agent %s registered again with other devices or probe address "
                     "(%d device(s))", agent.host, len(agent.devices))
        self._seen(agent.host, joined=known is None)
        if changed:
            self._membership_changed()
        self.launches.try_pending()
        registration = self._registration[agent.host] = uuid.uuid4().hex
        return self.peers(agent.host), registration

    def _seen(self, host: str, joined: bool = False) -> None:
        self._last_seen[host] = self.clock()
        self._heard_ms[host] = _now_ms()
        if host not in self._up:
            self._up = self._up | {host}
            if not joined:  # a new host's join is logged by register
                log.info("agent %s is back up", host)
            self._since[host] = _now_ms()
            self._membership_changed()
            self._wake_idle()

    def _registered(self, host: str, registration: str) -> AgentRecord:
        """The agent record of ``host``, if ``registration`` is its latest."""
        agent = self._agents.get(host)
        if agent is None:
            raise NotFound(f"agent {host!r} is not registered")
        current = self._registration.get(host)
        if registration != current:
            why = ("carries no registration (RegisterResponse.registration)" if not registration
                   else "is under a registration the daemon does not know (it restarted)"
                   if current is None else "is under an older registration: another Register "
                   "of the host came since (a second agent under the same name?)")
            raise FailedPrecondition(f"this message for host {host!r} {why}: register again")
        return agent

    def stream_opened(self, host: str, registration: str) -> None:
        """A report stream began reporting ``host`` under ``registration``."""
        key = (host, registration)
        self._streams[key] = self._streams.get(key, 0) + 1

    def stream_closed(self, host: str, registration: str) -> None:
        key = (host, registration)
        left = self._streams.get(key, 0) - 1
        if left > 0:
            self._streams[key] = left
        else:
            self._streams.pop(key, None)

    def report(self, report: AgentReport, registration: str) -> tuple[tuple[str, str], ...]:
        agent = self._registered(report.agent_id, registration)
        known = {d.index for d in agent.devices}
        for d in report.devices:
            if d.index not in known:
                raise ValidationError("devices.index", f"device {d.index!r} was not registered")
        self.store.put_report(report)
        self._reports[report.agent_id] = report
        self.adapter.note_report(report.agent_id, report.links)
        self._seen(report.agent_id)
        self.metrics.reports.inc()
        return self.peers(report.agent_id)

    def heartbeat(self, agent_id: str, registration: str) -> tuple[tuple[str, str], ...]:
        self._registered(agent_id, registration)
        self._seen(agent_id)
        return self.peers(agent_id)

    def is_up(self, host: str) -> bool:
        return host in self._up

    def _membership_changed(self) -> None:
        self.membership_epoch += 1
        self._peers_cache.clear()
        self._ring = None
        self.metrics.agents_up.set(len(self._up))

    def peers(self, host: str) -> tuple[tuple[str, str], ...]:
        """The next PEERS_PER_AGENT up hosts after ``host`` in host order (a ring, built
        once per membership change: 2000 agents re-registering must not sort 2000 times)."""
        cached = self._peers_cache.get(host)
        if cached is None:
            if self._ring is None:
                ring = sorted(h for h in self._up if self._agents[h].probe_address)
                self._ring = (ring, {h: i for i, h in enumerate(ring)})
            ring, index = self._ring
            i = index.get(host)
            if i is not None:
                others = [ring[(i + k) % len(ring)]
                          for k in range(1, min(len(ring), PEERS_PER_AGENT + 1))]
            else:
                others = ring[:PEERS_PER_AGENT]
            cached = tuple((h, self._agents[h].probe_address) for h in others)
            self._peers_cache[host] = cached
        return cached

    def sweep(self) -> bool:
        """Mark agents silent past the heartbeat timeout down; True when any changed."""
        cutoff = self.clock() - self.config.heartbeat_timeout_s
        up = frozenset(h for h in self._up if self._last_seen.get(h, 0.0) >= cutoff)
        if up != self._up:
            for host in sorted(self._up - up):
                self._since[host] = _now_ms()
                log.info("agent %s left: silent for over %g s (heartbeat timeout); its "
                         "devices leave the next plans", host, self.config.heartbeat_timeout_s)
            self._up = up
            self._membership_changed()
            return True
        return False

    async def _sweep(self) -> None:
        period = max(0.05, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep()
            try:  # jobs waiting for hosts to launch on (agents came up, hosts resumed)
                self.launches.try_pending()
            except Exception:  # the sweep must go on (a store fault is retried next time)
                log.exception("launching waiting jobs failed")
            try:  # ended jobs' output past log_retention_hours
                self.launches.expire_logs()
            except Exception:
                log.exception("removing expired job output failed")

    def agent_table(self) -> list[tuple[AgentRecord, bool, AgentReport | None]]:
        return [(a, a.host in self._up, self._reports.get(a.host)) for a in self._agents.values()]

    # -- drain ----------------------------------------------------------------

    def _known(self, host: str) -> str:
        if host not in self._agents:
            raise NotFound(f"host {host[:64]!r} is not a registered agent (known: "
                           f"{_names(sorted(self._agents)) or 'none'})")
        return host

    def drained(self) -> Mapping[str, DrainRecord]:
        return self._drained

    def drain(self, host: str, reason: str = "") -> DrainRecord:
        """Leave ``host`` out of planning from each job's next slot on; the loops whose
        current plan uses it are woken, so their plans move off at once. Persisted."""
        found = self._drained.get(self._known(host))
        if found is not None:
            return found
        rec = DrainRecord(host=host, since_ms=_now_ms(), reason=reason)
        self.store.put_drain(rec)
        self._drained[host] = rec
        woken = self._wake_jobs_on(host)
        log.info("host %s drained%s: jobs plan without it from their next slot (%d job(s) "
                 "use it now)", host, f" ({reason})" if reason else "", woken)
        return rec

    def resume(self, host: str) -> None:
        """Plan on ``host`` again from each job's next slot."""
        if self._drained.get(self._known(host)) is None:
            return
        self.store.delete_drain(host)
        del self._drained[host]
        self._since[host] = _now_ms()
        log.info("host %s resumed: jobs may plan on it again from their next slot", host)
        self._wake_idle()
        self.launches.try_pending()

    def _wake_idle(self) -> None:
        """Run a slot now in the loops that found no device last time: a job submitted
        before its agents registered gets its first plan when they come, not a slot later."""
        for loop in self._loops.values():
            if getattr(loop, "no_devices", False):
                loop.wake()

    def _wake_jobs_on(self, host: str) -> int:
        woken = 0
        for job_id, loop in list(self._loops.items()):
            if any(d.rpartition(":")[0] == host for d in self.store.job_status(job_id)[0].devices):
                loop.wake()
                woken += 1
        return woken

    def host_times(self, host: str) -> tuple[int, int]:
        """(since when the host is in its state, when it was last heard of; 0: not since
        the daemon started), wall-clock ms."""
        drain = self._drained.get(host)
        since = drain.since_ms if drain is not None else self._since.get(host, self.started_ms)
        return since, self._heard_ms.get(host, 0)

    def job_fits(self) -> dict[str, Measured]:
        """The measured-speed fit each running job planned its last slot with."""
        return {job_id: fit for job_id, (_, fit) in self._fits.items()
                if fit is not None and job_id in self._loops}

    def running_jobs(self) -> list[str]:
        return list(self._loops)

    def emulated_devices(self) -> frozenset[str]:
        return frozenset(f"{a.host}:{d.index}" for a in self._agents.values()
                         for d in a.devices if d.emulated)

    def observed_cluster(self, allowed_hosts: tuple[str, ...] = (),
                         only: frozenset[str] | None = None) -> Cluster:
        """The cluster as the latest reports show it: devices of up agents only, drained
        hosts left out; only the devices in ``only`` when given (a launched job's)."""
        allowed = set(allowed_hosts)
        devices: list[Device] = []
        for host in sorted(self._up):
            if (allowed and host not in allowed) or host in self._drained:
                continue
            agent = self._agents[host]
            report = self._reports.get(host)
            measured = {d.index: d for d in report.devices} if report else {}
            for d in agent.devices:
                if only is not None and f"{host}:{d.index}" not in only:
                    continue
                tflops = self._speed(host, d, measured.get(d.index))
                if tflops <= 0 or d.memory_gb <= 0:
                    continue
                devices.append(Device(id=f"{host}:{d.index}", host=host, tflops=tflops,
                                      memory_gb=d.memory_gb, price_per_hour=d.price_per_hour,
                                      power_watts=d.power_watts))
        hosts = {d.host for d in devices}
        links: list[Link] = []
        for host in sorted(hosts):
            report = self._reports.get(host)
            for link in report.links if report else ():
                if link.peer_host in hosts and link.peer_host != host and link.gbps > 0:
                    links.append(Link(a=host, b=link.peer_host, gbps=link.gbps,
                                      latency_us=link.rtt_us / 2))
        network = Network(intra_host_gbps=self.config.intra_host_gbps,
                          inter_host_gbps=self.config.inter_host_gbps,
                          latency_us=self.config.latency_us, host_links=tuple(links))
        return Cluster(devices=tuple(devices), network=network)

    def _speed(self, host: str, d: DeviceInfo, m: DeviceReport | None) -> float:
        """The TFLOP/s the agents' view gives a device now: the latest probe (or the
        registered speed), over the estimator's predicted slowdown when it has one, else
        times ``1 - colocated_load``; emulated devices as reported."""
        tflops = m.tflops if m is not None and m.tflops > 0 else d.tflops
        predicted = None
        if m is not None and not d.emulated:  # plan with predicted speeds
            predicted = self.adapter.predict_tflops(
                f"{host}:{d.index}", self.adapter.interference(host, m, d.tflops), d.tflops)
        if predicted is not None:
            return predicted
        if m is not None and 0 < m.colocated_load < 1 and not d.emulated:
            tflops *= 1.0 - m.colocated_load
        return tflops

    def device_speed(self, device_id: str) -> float:
        """What :meth:`observed_cluster` would give ``device_id`` now; 0 when no registered
        agent has it."""
        host, _, index = device_id.rpartition(":")
        agent = self._agents.get(host)
        info = next((d for d in agent.devices if d.index == index), None) if agent else None
        if info is None:
            return 0.0
        report = self._reports.get(host)
        m = next((d for d in report.devices if d.index == index), None) if report else None
        return max(0.0, self._speed(host, info, m))

    # -- trainers -----------------------------------------------------------

    def attach(self, job_id: str, rank: int, device_id: str, model_json: str,
               measured: MeasurementRecord | None = None) -> tuple[PlanRecord | None, JobRecord]:
        """Attach a rank: the latest plan (None before the first) and the job. Everything is
        checked before anything is stored: a refused attach changes nothing."""
        rec = self._own(None, job_id)
        if rec.state in (JOB_CANCELLED, JOB_SUCCEEDED):
            raise FailedPrecondition(f"job {job_id} is {rec.state}")
        new_model = None
        if model_json and not rec.model_json:
            if not rec.profile_on_attach:
                raise FailedPrecondition(f"job {job_id} already has a model profile")
            new_model = parse_model(model_json)
        model = new_model or (self._model(rec) if rec.model_json else None)
        if measured is not None and model is not None:
            for i, t in enumerate(measured.layers):
                if t.layer >= model.num_layers:
                    raise ValidationError(f"layer_times[{i}].layer",
                                          f"must be < {model.num_layers} (the model's layers), "
                                          f"got {t.layer}")
        elif measured is not None:  # no model yet: the fit ignores layers beyond it
            for i, t in enumerate(measured.layers):
                if t.layer >= MAX_LAYERS:
                    raise ValidationError(f"layer_times[{i}].layer",
                                          f"must be < {MAX_LAYERS}, got {t.layer}")
        changes: dict[str, Any] = {}
        if new_model is not None:
            changes.update(model_json=model_json, state=JOB_RUNNING)
        if rec.state == JOB_FAILED:  # a restarted trainer: the job runs again
            changes.update(state=JOB_RUNNING if rec.model_json or new_model else JOB_PENDING,
                           ended_ms=0, reason="")
        if not rec.started_ms:
            changes.update(started_ms=_now_ms())
        if changes:
            revived = rec.state == JOB_FAILED
            rec = rec.with_changes(**changes)
            self.store.update_job(rec)
            if new_model is not None:
                self._models[job_id] = new_model
            if revived:
                log.info("job %s: a trainer attached again after it failed; running again",
                         job_id)
                self._start_loop(job_id)
            loop = self._loops.get(job_id)
            if loop is not None and new_model is not None:
                loop.wake()
        if measured is not None:
            before = self._job_measurements(job_id).get(device_id)  # loaded before the new one
            links = (self._link_refs(device_id, measured.links) if measured.links
                     else before.links if before is not None else ())  # none sent: keep
            measured = replace(measured, ref_tflops=self.device_speed(device_id), links=links)
            self.store.put_measurement(measured)
            self._measurements[job_id][device_id] = measured
            self._measure_epoch[job_id] = self._measure_epoch.get(job_id, 0) + 1
        self._attached[(job_id, rank)] = device_id
        plans = self.store.plans(job_id, max(0, self.store.job_status(job_id)[0].plan_version - 1))
        return (plans[-1] if plans else None), rec

    def _link_refs(self, device_id: str, links: tuple[LinkTime, ...]) -> tuple[LinkTime, ...]:
        """``links`` with the latency and bandwidth each pair has in the observed cluster
        now (0 where a device is unknown), for :meth:`Measured.apply`."""
        if not links:
            return links
        cluster = self.observed_cluster()
        out = []
        for lt in links:
            if device_id in cluster.by_id and lt.peer in cluster.by_id:
                gbps, lat = cluster.link(device_id, lt.peer)
                lt = replace(lt, ref_latency_s=lat, ref_gbps=gbps)
            out.append(lt)
        return tuple(out)

    def _model(self, rec: JobRecord) -> Model:
        """The job's profiled model, parsed once."""
        model = self._models.get(rec.job_id)
        if model is None:
            model = self._models[rec.job_id] = parse_model(rec.model_json)
        return model

    def _job_measurements(self, job_id: str) -> dict[str, MeasurementRecord]:
        """The job's measurements by device, read from the store on first use."""
        found = self._measurements.get(job_id)
        if found is None:
            found = self._measurements[job_id] = {
                m.device_id: m for m in self.store.measurements(job_id)}
        return found

    async def measured(self, rec: JobRecord) -> Measured | None:
        """The fit of the job's measurements (:mod:`hetpilot.daemon.measured`), redone
        in a worker thread only when a measurement or the model changed since the last."""
        if not rec.model_json:
            return None
        records = self._measurements.get(rec.job_id)
        if records is None:
            loaded = await asyncio.to_thread(self.store.measurements, rec.job_id)
            records = self._measurements.setdefault(rec.job_id,
                                                    {m.device_id: m for m in loaded})
        if not records:
            return None
        key = (self._measure_epoch.get(rec.job_id, 0), len(rec.model_json))
        cached = self._fits.get(rec.job_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        model = self._model(rec)
        result = await asyncio.to_thread(fit_job, model, list(records.values()))
        self._fits[rec.job_id] = (key, result)
        if result is not None:
            log.info("job %s: planning with speeds measured on %d device(s) (%s, fit "
                     "error %.1f%%): %s", rec.job_id, len(result.fit.tflops), result.dtype,
                     100 * result.fit.rms_log_error,
                     ", ".join(f"{d} {t:.3g} TF" for d, t in sorted(result.fit.tflops.items())))
        return result

    async def planning_inputs(self, rec: JobRecord) -> tuple[Cluster, JobRecord]:
        """The cluster and job record one slot of ``rec`` plans with: the observed cluster,
        and when the job's trainer measured, its fitted speeds and model."""
        # live tables: on the loop; a launched job plans on the devices that have a rank
        cluster = self.observed_cluster(rec.allowed_hosts, self.launches.devices(rec))
        measured = await self.measured(rec)
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
            self._learn(rec, timings)
        except Exception:  # learning must never fail the trainer's report
            logging.getLogger("hetpilot.daemon").exception("estimator: timings not learnt")

    def _learn(self, rec: JobRecord, timings: TimingsRecord) -> None:
        """Stage timings -> slowdown samples for the estimator (hetpilot.adapt.online).

        With measured layer times the stage's work is the fitted GFLOP, not the
        profile's: the estimator's calibration (the quietest ratio of measured to
        predicted time on a device) then holds across stages, so a re-cut does not
        look like a slowdown, and its predicted slowdown scales the measured speed
        (see :mod:`hetpilot.daemon.measured`) instead of fighting it."""
        if not rec.model_json:
            return
        fitted = self._fits.get(rec.job_id)
        model = fitted[1].model if fitted is not None and fitted[1] is not None \
            else self._model(rec)
        found = [p for p in self.store.plans(rec.job_id, max(0, timings.plan_version - 1))
                 if p.version == timings.plan_version]
        if not found:
            return
        plan = plan_from_dict(found[0].plan)
        where = {s.device: (g, s) for g in plan.groups for s in g.stages}
        for st in timings.stages:
            host, _, index = st.device_id.rpartition(":")
            agent, report = self._agents.get(host), self._reports.get(host)
            if agent is None or report is None or st.device_id not in where:
                continue
            info = next((d for d in agent.devices if d.index == index), None)
            dev = next((d for d in report.devices if d.index == index), None)
            if info is None or dev is None or info.emulated:
                continue
            group, stage = where[st.device_id]
            a, b = stage.layers
            self.adapter.learn(st.device_id, self.adapter.interference(host, dev, info.tflops),
                               model.layers[a:b], plan.microbatch_size, group.samples,
                               st.fwd_s + st.bwd_s, info.tflops)
