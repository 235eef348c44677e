"""Launching jobs that have an entry point (``[entry]`` in the job file): which
hosts run the ranks, the orders agents get, what their reports say happened,
and how a launch ends the job.

Choosing hosts. A job with an entry point is launched once, as soon as enough
hosts can take it: up, not drained, allowed by ``allowed_hosts``, with an
agent that launches (``RegisterRequest.launches``) and at least
``ranks_per_host`` devices; ``hosts = N`` waits for N of them and takes the
first N by name, no ``hosts`` takes every such host once there is one. Each
host runs ``ranks_per_host`` ranks (else one per device) on its first devices,
and the job then plans on exactly those devices (:meth:`Launches.devices`), so
every plan names only devices that have a rank. The first host runs the c10d
rendezvous store, at its agent's advertised address (the host part of its probe
address, else its name) and the lowest port of ``[rdzv_port_min,
rdzv_port_max]`` that no running launch holds. A launch is never re-made: a
failed job stays failed (re-submit it).

Rendezvous port. Only the store's host can tell whether the port is free there,
so its agent tries to bind it before it starts torchrun; if it is in use, the
agent starts nothing and says so (``LaunchStatus.rdzv_port_busy``), and the
daemon moves the launch to the next free port and orders it again, up to
:data:`RDZV_TRIES` ports; then the job FAILS with a reason naming the ports. The
other hosts get their start orders only once the store's host reports the launch
running, so none of them ever starts with a port that is then changed.

Orders (the channel). Orders ride on the existing daemon-to-agent direction of
``AgentService.Report``: each ``ReportAck`` carries ``start`` orders (this
host's part of a launch it has not reported yet) and ``stop`` ids (launches it
reports running whose job has ended). Level-triggered, so nothing is lost to a
broken stream or a restart on either side: a start order is repeated until the
agent reports the launch, a stop order while it reports it running, and the
agent starts each launch id at most once in its life (it keeps the ids in its
state dir), so a repeated order starts nothing twice. Reports are the agent's
heartbeat, so orders reach it within one ``report_interval_s``.

How a launch ends the job (unless the trainer ended it first with FinishJob):

* every host's torchrun exited with 0: SUCCEEDED ("every rank exited with 0");
* a host's torchrun exited non-zero (its ranks died beyond ``restart_budget``
  restarts, or could not start: the rendezvous port was in use on every try)
  without being stopped: FAILED, the reason naming the host, the exit code and
  the last lines of its output;
* a host whose part has not exited goes down (its agent silent past the
  heartbeat timeout, or past the restart grace after a daemon restart):
  FAILED, the reason naming the host (:meth:`Launches.hosts_lost`). Not launched
  again on the hosts left: a launch is never re-made, and ``restart_budget`` is
  torchrun's, for ranks that die on a host that is still there;
* CANCELLED and FAILED jobs have their running launches stopped at once;
  a SUCCEEDED job's ranks get :data:`SUCCEEDED_GRACE_S` to exit on their own
  (rank 0 calls FinishJob before the others are done) before they are stopped.
  The stop of a part on a host that is down waits for its agent to come back
  (the order is level-triggered), and the job's view says so meanwhile
  (:meth:`Launches.stopping`); an operator who gives the host up
  (``hetpilot nodes forget``) gives its parts up with it.

Retention: an ended job's output (:mod:`hetpilot.daemon.joblogs`) is removed
``log_retention_hours`` after the job ended and every host's part exited
(:meth:`Launches.expire_logs`, from the daemon's periodic sweep); a running
job's never is. The agents remove their launch directories themselves
(:mod:`hetpilot.agents.launcher`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from hetpilot.entry import Entry

from .config import DaemonConfig
from .joblogs import JobLogs
from .records import (
    JOB_CANCELLED,
    JOB_FAILED,
    JOB_SUCCEEDED,
    LAUNCH_EXITED,
    LAUNCH_ORDERED,
    LAUNCH_RUNNING,
    AgentRecord,
    AgentReport,
    DrainRecord,
    HostLaunch,
    JobRecord,
    LaunchRecord,
)
from .store import Store

__all__ = ["EXIT_UNKNOWN", "RDZV_TRIES", "SUCCEEDED_GRACE_S", "LaunchOwner", "LaunchStatus",
           "Launches", "LogChunk", "Order"]

log = logging.getLogger("hetpilot.daemon")

SUCCEEDED_GRACE_S = 60.0
"""How long a SUCCEEDED job's ranks may keep running before they are stopped."""
EXIT_UNKNOWN = 255
"""Exit code of a launch whose exit status was lost (agents/launchstate.py)."""
CANNOT_START = 127
"""Exit code of a launch that could not be started."""
MAX_REASON = 2000
RDZV_TRIES = 5
"""Rendezvous ports a launch tries on its store's host before its job fails."""


@dataclass(frozen=True, kw_only=True)
class LaunchStatus:
    """What an agent reports about one launch (``AgentReport.launches``)."""

    launch_id: str
    job_id: str
    running: bool
    exit_code: int = 0
    reason: str = ""
    pid: int = 0
    stopped: bool = False
    log_bytes: int = 0
    rdzv_port_busy: int = 0
    """Not started: this rendezvous port was in use on the store's host."""


@dataclass(frozen=True, kw_only=True)
class LogChunk:
    """New output of one launch (``AgentReport.logs``)."""

    launch_id: str
    offset: int
    data: bytes


@dataclass(frozen=True, kw_only=True)
class Order:
    """A start order for one host's part of a launch."""

    launch: LaunchRecord
    part: HostLaunch
    entry: Entry
    owner: str = ""
    """The job's owner: her ranks run as her unix user (``LaunchOrder.unix_user``)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Wakeable(Protocol):
    def wake(self) -> None: ...


class LaunchOwner(Protocol):
    """What the launches need of the control plane: the agents and jobs."""

    @property
    def store(self) -> Store: ...

    @property
    def config(self) -> DaemonConfig: ...

    def agent_table(self) -> list[tuple[AgentRecord, bool, AgentReport | None]]: ...

    def drained(self) -> Mapping[str, DrainRecord]: ...

    def is_up(self, host: str) -> bool: ...

    def job_loop(self, job_id: str) -> _Wakeable | None: ...

    async def end_job(self, rec: JobRecord, state: str, reason: str) -> JobRecord: ...


class Launches:
    """The launches of every job, kept in the store and mirrored here. Runs on the
    event loop (the control plane's thread)."""

    def __init__(self, plane: LaunchOwner) -> None:
        self.plane = plane
        self.store = plane.store
        config = plane.config
        self.logs = JobLogs(Path(config.state_dir) / "logs", config.log_bytes_per_host)
        self.logs.clean_leftovers()
        self._expired_at = 0.0
        self._by_job: dict[str, LaunchRecord] = {}
        self._by_id: dict[str, str] = {}
        self._active: set[str] = set()
        """Jobs whose launch has a part not exited yet."""
        for launch in self.store.launches():
            self._remember(launch)
        self._pending: set[str] = {
            r.job_id for r in self.store.list_jobs()
            if r.entry and not r.ended and r.job_id not in self._by_job}
        self._waiting: dict[str, str] = {}
        self._warned: set[str] = set()

    # -- queries ----------------------------------------------------------------

    def get(self, job_id: str) -> LaunchRecord | None:
        return self._by_job.get(job_id)

    def active(self) -> bool:
        """Whether any launch has a host part not exited (agents' reports need a look)."""
        return bool(self._active)

    def _active_launches(self) -> list[LaunchRecord]:
        return [self._by_job[j] for j in sorted(self._active)]

    def devices(self, rec: JobRecord) -> frozenset[str] | None:
        """The devices a job with an entry point may plan on (those with a rank; none
        before it is launched); None for a job without one (any device)."""
        if not rec.entry:
            return None
        launch = self._by_job.get(rec.job_id)
        return launch.device_ids() if launch is not None else frozenset()

    def waiting(self, job_id: str) -> str | None:
        """Why a job with an entry point is not launched yet, if it is not."""
        return self._waiting.get(job_id) if job_id in self._pending else None

    # -- launching --------------------------------------------------------------

    def submitted(self, rec: JobRecord) -> None:
        if rec.entry and not rec.ended and rec.job_id not in self._by_job:
            self._pending.add(rec.job_id)
            self.try_launch(rec)

    def try_pending(self) -> None:
        """Launch the waiting jobs that can be now (an agent came up, a host resumed)."""
        for job_id in sorted(self._pending):
            rec = self.store.get_job(job_id)
            if rec is None or rec.ended:
                self._pending.discard(job_id)
                self._waiting.pop(job_id, None)
                continue
            self.try_launch(rec)

    def eligible(self, rec: JobRecord, entry: Entry) -> list[str]:
        """Hosts that could take the job now, by name."""
        plane = self.plane
        allowed = set(rec.allowed_hosts)
        need = max(1, entry.ranks_per_host)
        return sorted(
            a.host for a, up, _ in plane.agent_table()
            if up and a.launches and a.host not in plane.drained()
            and (not allowed or a.host in allowed) and len(a.devices) >= need)

    def _port(self, busy: Sequence[int] = ()) -> int | None:
        """The lowest rendezvous port no running launch holds (and not in ``busy``)."""
        config = self.plane.config
        held = {la.rdzv_port for la in self._active_launches()} | set(busy)
        for port in range(config.rdzv_port_min, config.rdzv_port_max + 1):
            if port not in held:
                return port
        return None

    def try_launch(self, rec: JobRecord) -> LaunchRecord | None:
        """Launch ``rec`` if enough hosts can take it now; else note why not."""
        entry = Entry.from_dict(rec.entry)
        hosts = self.eligible(rec, entry)
        need = entry.hosts or 1
        if len(hosts) < need:
            self._wait(rec.job_id, f"launch: waiting for {need} host(s) that are up, not "
                       f"drained{', allowed' if rec.allowed_hosts else ''}, with a launching "
                       f"agent and >= {max(1, entry.ranks_per_host)} device(s); "
                       f"{len(hosts)} can now")
            return None
        chosen = hosts[:entry.hosts] if entry.hosts else hosts
        port = self._port()
        if port is None:
            cfg = self.plane.config
            self._wait(rec.job_id, f"launch: no free rendezvous port in {cfg.rdzv_port_min}-"
                       f"{cfg.rdzv_port_max} (daemon rdzv_port_min / rdzv_port_max)")
            return None
        agents = {a.host: a for a, _, _ in self.plane.agent_table()}
        first = agents[chosen[0]]
        address = first.probe_address.rpartition(":")[0] or first.host
        parts = []
        for i, host in enumerate(chosen):
            devices = agents[host].devices
            n = entry.ranks_per_host or len(devices)
            parts.append(HostLaunch(host=host, devices=tuple(d.index for d in devices[:n]),
                                    rdzv_host=i == 0, updated_ms=_now_ms()))
        launch = LaunchRecord(launch_id=uuid.uuid4().hex[:12], job_id=rec.job_id,
                              rdzv_endpoint=f"{address}:{port}", hosts=tuple(parts),
                              created_ms=_now_ms())
        self.store.put_launch(launch)
        self._remember(launch)
        self._pending.discard(rec.job_id)
        self._waiting.pop(rec.job_id, None)
        log.info("job %s: launch %s on %d host(s) (%s), %d rank(s), rendezvous %s, restart "
                 "budget %d: %s", rec.job_id, launch.launch_id, len(parts),
                 ", ".join(f"{p.host}:{'+'.join(p.devices)}" for p in parts),
                 sum(len(p.devices) for p in parts), launch.rdzv_endpoint,
                 entry.restart_budget, entry.describe()[:300])
        loop = self.plane.job_loop(rec.job_id)
        if loop is not None:
            loop.wake()  # it plans on the launched devices from now on
        return launch

    def _wait(self, job_id: str, why: str) -> None:
        if self._waiting.get(job_id) != why:
            log.info("job %s: %s", job_id, why)
        self._waiting[job_id] = why

    def _remember(self, launch: LaunchRecord) -> None:
        self._by_job[launch.job_id] = launch
        self._by_id[launch.launch_id] = launch.job_id
        if launch.exited:
            self._active.discard(launch.job_id)
        else:
            self._active.add(launch.job_id)

    def _save(self, launch: LaunchRecord) -> None:
        self.store.put_launch(launch)
        self._remember(launch)
        self.logs.notify(launch.job_id)

    # -- agents -----------------------------------------------------------------

    async def agent_report(self, host: str, statuses: Sequence[LaunchStatus],
                           chunks: Sequence[LogChunk]) -> tuple[list[Order], list[str]]:
        """Take one report's launch states and output from ``host``; the orders for its
        ack: (launches to start, launch ids to stop)."""
        for chunk in chunks:  # output first: a launch that exited has all of it here
            launch = self._launch(chunk.launch_id)
            if launch is not None and launch.host(host) is not None:
                self.logs.append(launch.job_id, host, chunk.launch_id, chunk.offset,
                                 chunk.data)
        stops: list[str] = []
        reported: dict[str, LaunchStatus] = {}
        busy: set[str] = set()
        changed: set[str] = set()
        for st in statuses:
            launch = self._launch(st.launch_id)
            part = launch.host(host) if launch is not None else None
            if st.rdzv_port_busy and launch is not None and part is not None:
                busy.add(st.launch_id)  # not started there (not "no longer known")
                if self._port_busy(launch, part, st):
                    changed.add(launch.job_id)
                continue
            if launch is None or part is None:
                if st.running:  # a launch no job owns (the daemon's state was replaced)
                    stops.append(st.launch_id)
                    if st.launch_id not in self._warned and len(self._warned) < 10000:
                        self._warned.add(st.launch_id)
                        log.warning("agent %s runs launch %s (job %s), unknown here: "
                                    "stopping it", host, st.launch_id, st.job_id)
                continue
            reported[st.launch_id] = st
            new = self._updated(part, st)
            if new != part:
                self._save(launch.with_host(new))
                self._log_change(launch, part, new)
            if new != part or not st.running:  # an exit again: its job's end may have failed
                changed.add(launch.job_id)
        for launch in self._active_launches():
            part = launch.host(host)
            if (part is not None and part.state == LAUNCH_RUNNING
                    and launch.launch_id not in reported and launch.launch_id not in busy):
                new = replace(part, state=LAUNCH_EXITED, exit_code=EXIT_UNKNOWN,
                              reason=f"the agent on {host} no longer knows this launch "
                                     "(restarted without its state dir?)",
                              updated_ms=_now_ms())
                self._save(launch.with_host(new))
                changed.add(launch.job_id)
                self._log_change(launch, part, new)
        for job_id in sorted(changed):
            await self._settle(job_id)
        starts: list[Order] = []
        for launch in self._active_launches():
            part = launch.host(host)
            if part is None or part.state == LAUNCH_EXITED:
                continue
            now = reported.get(launch.launch_id)
            rec = self.store.get_job(launch.job_id)
            if now is None and part.state == LAUNCH_ORDERED:
                store_host = next((h for h in launch.hosts if h.rdzv_host), part)
                if store_host is not part and store_host.state == LAUNCH_ORDERED:
                    continue  # until the store's host has its port and runs
                if rec is not None and not rec.ended and rec.entry:
                    starts.append(Order(launch=launch, part=part, owner=rec.owner,
                                        entry=Entry.from_dict(rec.entry)))
            elif now is not None and now.running and not now.stopped \
                    and self._should_stop(rec):
                stops.append(launch.launch_id)
        return starts, stops

    def _launch(self, launch_id: str) -> LaunchRecord | None:
        job_id = self._by_id.get(launch_id)
        return self._by_job.get(job_id) if job_id is not None else None

    def _port_busy(self, launch: LaunchRecord, part: HostLaunch, st: LaunchStatus) -> bool:
        """The store's host did not start ``launch``: its rendezvous port is in use there.
        Move it to another port (the next start order carries it), or after
        :data:`RDZV_TRIES` ports (or none left) give the part up as not started (its job
        then fails); True then. A refusal of a port the launch no longer has is old news."""
        port = st.rdzv_port_busy
        rec = self.store.get_job(launch.job_id)
        if (not part.rdzv_host or part.state != LAUNCH_ORDERED or port != launch.rdzv_port
                or rec is None or rec.ended):
            return False
        busy = (*launch.busy_ports, port)
        new_port = self._port(busy) if len(busy) < RDZV_TRIES else None
        if new_port is not None:
            address = launch.rdzv_endpoint.rpartition(":")[0]
            moved = replace(launch, rdzv_endpoint=f"{address}:{new_port}", busy_ports=busy)
            self._save(moved)
            log.info("job %s: rendezvous port %d is in use on %s: launch %s moves to port %d "
                     "(try %d of %d)", launch.job_id, port, part.host, launch.launch_id,
                     new_port, len(busy) + 1, RDZV_TRIES)
            return False
        cfg = self.plane.config
        why = (f"rendezvous port {port} is in use on {part.host} (tried "
               f"{', '.join(map(str, busy))}"
               + (f" of {cfg.rdzv_port_min}-{cfg.rdzv_port_max}" if len(busy) < RDZV_TRIES
                  else "") + "; free them there, or change the daemon's rdzv_port_min / "
               "rdzv_port_max)")
        new = replace(part, state=LAUNCH_EXITED, exit_code=CANNOT_START, reason=why,
                      updated_ms=_now_ms())
        self._save(replace(launch.with_host(new), busy_ports=busy))
        self._log_change(launch, part, new)
        return True

    @staticmethod
    def _updated(part: HostLaunch, st: LaunchStatus) -> HostLaunch:
        """The host's part as its agent reports it (the agent is the truth). The output's
        size is taken when it exits (while it runs it grows with every report)."""
        new = replace(part, state=LAUNCH_RUNNING if st.running else LAUNCH_EXITED,
                      pid=st.pid, stopped=st.stopped or part.stopped,
                      exit_code=0 if st.running else st.exit_code,
                      reason="" if st.running else st.reason[:MAX_REASON],
                      log_bytes=part.log_bytes if st.running else st.log_bytes)
        return part if new == part else replace(new, updated_ms=_now_ms())

    @staticmethod
    def _log_change(launch: LaunchRecord, old: HostLaunch, new: HostLaunch) -> None:
        if new.state == LAUNCH_RUNNING and old.state != LAUNCH_RUNNING:
            log.info("job %s: host %s started %d rank(s) (launch %s, pid %d)", launch.job_id,
                     new.host, len(new.devices), launch.launch_id, new.pid)
        elif new.state == LAUNCH_RUNNING and new.stopped and not old.stopped:
            log.info("job %s: host %s is stopping its ranks (launch %s)", launch.job_id,
                     new.host, launch.launch_id)
        elif new.state == LAUNCH_EXITED and old.state != LAUNCH_EXITED:
            log.info("job %s: host %s's ranks exited with code %d%s (launch %s)%s",
                     launch.job_id, new.host, new.exit_code,
                     ", stopped on order" if new.stopped else "", launch.launch_id,
                     f": {new.reason.splitlines()[-1][:200]}" if new.reason else "")

    def _should_stop(self, rec: JobRecord | None) -> bool:
        if rec is None:
            return True
        if not rec.ended:
            return False
        return rec.state != JOB_SUCCEEDED or _now_ms() - rec.ended_ms > SUCCEEDED_GRACE_S * 1000

    async def _settle(self, job_id: str) -> None:
        """End the job if its launch says how: a host failed, or every host exited 0."""
        launch = self._by_job[job_id]
        rec = self.store.get_job(job_id)
        if rec is None or rec.ended:
            return
        failed = [h for h in launch.hosts
                  if h.state == LAUNCH_EXITED and h.exit_code != 0 and not h.stopped]
        if failed:
            h = failed[0]
            budget = Entry.from_dict(rec.entry).restart_budget if rec.entry else 0
            if h.exit_code in (CANNOT_START, EXIT_UNKNOWN):
                what = "could not start" if h.exit_code == CANNOT_START else "ended unseen"
                reason = f"host {h.host}: {what}: {h.reason}"
            else:
                what = (f"killed by signal {-h.exit_code}" if h.exit_code < 0
                        else f"exited with code {h.exit_code}")
                limit, output = _limit_line(h.reason)
                reason = (f"host {h.host}: {limit + '; ' if limit else ''}torchrun {what} "
                          f"(restart budget {budget} spent)"
                          + (f"; its last output:\n{output}" if output else ""))
            await self.plane.end_job(rec, JOB_FAILED, reason[:MAX_REASON])
        elif launch.exited and all(h.exit_code == 0 for h in launch.hosts):
            await self.plane.end_job(rec, JOB_SUCCEEDED,
                                     f"every rank exited with 0 ({len(launch.hosts)} host(s))")

    async def hosts_lost(self) -> list[str]:
        """End the running jobs whose launch has a part, not exited, on a host that is
        down (from the liveness sweep): FAILED, naming the host. The part stays as its
        agent last reported it: its ranks may still run there, and are stopped when
        the agent comes back. The jobs ended."""
        ended = []
        for launch in self._active_launches():
            lost = [h.host for h in launch.hosts
                    if h.state != LAUNCH_EXITED and not self.plane.is_up(h.host)]
            rec = self.store.get_job(launch.job_id) if lost else None
            if rec is None or rec.ended:
                continue
            timeout = self.plane.config.heartbeat_timeout_s
            await self.plane.end_job(rec, JOB_FAILED, (
                f"host {', '.join(lost)} lost: its agent was silent for over {timeout:g} s "
                f"(heartbeat timeout) while it held part of launch {launch.launch_id}; "
                "not launched again (a launch is never re-made: re-submit the job). Ranks "
                "still running there are stopped when its agent comes back")[:MAX_REASON])
            ended.append(rec.job_id)
        return ended

    def stopping(self, rec: JobRecord) -> str | None:
        """For an ended job whose launch still has parts not exited: which hosts it waits
        for (a host that is down gets the stop order when its agent comes back)."""
        launch = self._by_job.get(rec.job_id)
        if not rec.ended or launch is None or launch.exited:
            return None
        left = [h.host for h in launch.hosts if h.state != LAUNCH_EXITED]
        down = [h for h in left if not self.plane.is_up(h)]
        what = {JOB_CANCELLED: "cancelling", JOB_FAILED: "stopping"}.get(rec.state, "finishing")
        if down:
            return (f"{what}: waiting for host {', '.join(down)} (down: its ranks are stopped "
                    "when its agent comes back; `hetpilot nodes forget HOST` gives them up)")
        return f"{what}: stopping the ranks on host {', '.join(left)}"

    async def forget_host(self, host: str) -> None:
        """An operator gave ``host`` up: its parts not exited are given up (exited, code
        255), which ends their running jobs FAILED."""
        changed = []
        for launch in self._active_launches():
            part = launch.host(host)
            if part is None or part.state == LAUNCH_EXITED:
                continue
            new = replace(part, state=LAUNCH_EXITED, exit_code=EXIT_UNKNOWN,
                          reason=f"given up: host {host} was forgotten by an operator "
                                 "(hetpilot nodes forget)", updated_ms=_now_ms())
            self._save(launch.with_host(new))
            self._log_change(launch, part, new)
            changed.append(launch.job_id)
        for job_id in changed:
            await self._settle(job_id)

    def job_ended(self, rec: JobRecord) -> None:
        """The job ended: parts never started will not be (their ports are free again)."""
        self._pending.discard(rec.job_id)
        self._waiting.pop(rec.job_id, None)
        launch = self._by_job.get(rec.job_id)
        if launch is not None and any(h.state == LAUNCH_ORDERED for h in launch.hosts):
            self._save(replace(launch, hosts=tuple(
                replace(h, state=LAUNCH_EXITED, stopped=True, updated_ms=_now_ms(),
                        reason="not started: the job ended first")
                if h.state == LAUNCH_ORDERED else h for h in launch.hosts)))
        self.logs.notify(rec.job_id)

    def output_complete(self, launch: LaunchRecord) -> bool:
        """Every host's part has exited and all the output it wrote has arrived."""
        for h in launch.hosts:
            if h.state != LAUNCH_EXITED:
                return False
            got = self.logs.received(launch.job_id, h.host)
            if h.log_bytes and (got is None or got < h.log_bytes):
                return False
        return True

    # -- retention ----------------------------------------------------------------

    def logs_expire_ms(self, rec: JobRecord) -> int | None:
        """When the job's kept output is due for removal (wall clock, ms); None: never
        (retention off, the job has not ended, or a part of its launch on a host that
        is up has not exited)."""
        hours = self.plane.config.log_retention_hours
        if not hours or not rec.ended:
            return None
        since = rec.ended_ms
        launch = self._by_job.get(rec.job_id)
        for h in launch.hosts if launch is not None else ():
            if h.state != LAUNCH_EXITED and self.plane.is_up(h.host):
                return None  # still running there (its output may still come)
            since = max(since, h.updated_ms)
        return since + int(hours * 3600 * 1000)

    def expire_logs(self, force: bool = False) -> list[str]:
        """Remove the kept output of jobs that ended ``log_retention_hours`` ago (at most
        once a minute, or a quarter of the retention if shorter, unless ``force``); the
        jobs whose output went."""
        hours = self.plane.config.log_retention_hours
        now = time.monotonic()
        if not hours or (not force and now - self._expired_at < min(60.0, hours * 900)):
            return []
        self._expired_at = now
        removed = []
        wall = _now_ms()
        for job_id in self.logs.jobs():
            rec = self.store.get_job(job_id)
            if rec is None:  # no such job (the state was replaced): by the files' age
                try:
                    due: int | None = int(os.stat(self.logs.job_dir(job_id)).st_mtime * 1000
                                          + hours * 3600 * 1000)
                except OSError:
                    continue
            else:
                due = self.logs_expire_ms(rec)
            if due is not None and wall >= due and self.logs.remove(job_id):
                removed.append(job_id)
        if removed:
            log.info("removed the output of %d job(s) ended over %g h ago "
                     "(log_retention_hours): %s", len(removed), hours,
                     ", ".join(removed[:10]) + (", ..." if len(removed) > 10 else ""))
        return removed


def _limit_line(reason: str) -> tuple[str, str]:
    """Split an agent's exit reason into the line naming a per-launch limit that ended
    the launch (the agent puts it first: ``launch exceeded memory_max ...``, ``launch
    reached tasks_max ...``), so the job's reason leads with it, and the output after."""
    first, _, rest = reason.partition("\n")
    if first.startswith(("launch exceeded ", "launch reached ")):
        return first, rest
    return "", reason
