"""The cluster as ``hetpilot nodes`` shows it: every agent, its devices and state.

Why a view of its own: an operator deciding what to drain, or a job owner
wondering why a plan left a device out, needs in one place what the daemon
plans with — each device's probe speed and what the probe ran, the speed the
daemon plans with now, the speeds jobs measured on their own layers (which
the daemon plans those jobs with instead), memory, load, price — and each
host's state (up, down, draining) with how long it has been so and how long
since its agent was last heard of. Built from the control plane's live tables
on the event loop; no protobuf here (:mod:`hetpilot.daemon.convert`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .controlplane import ControlPlane
from .records import (
    LAUNCH_RUNNING,
    AgentRecord,
    DeviceInfo,
    DeviceReport,
    DrainRecord,
    LinkReport,
)

__all__ = ["NODE_DOWN", "NODE_DRAINING", "NODE_UP", "DeviceView", "JobSpeed", "NodeView",
           "node_views"]

NODE_UP = "up"
NODE_DOWN = "down"
NODE_DRAINING = "draining"


@dataclass(frozen=True, kw_only=True)
class JobSpeed:
    """A device's speed as one job's trainer measured it on the job's layers (fitted)."""

    job_id: str
    tflops: float
    dtype: str
    microbatch: int
    unix_ms: int


@dataclass(frozen=True, kw_only=True)
class DeviceView:
    host: str
    info: DeviceInfo
    report: DeviceReport | None
    planned_tflops: float
    job_speeds: tuple[JobSpeed, ...] = ()

    @property
    def device_id(self) -> str:
        return f"{self.host}:{self.info.index}"


@dataclass(frozen=True, kw_only=True)
class NodeView:
    agent: AgentRecord
    state: str
    since_ms: int
    alive: bool
    last_seen_age_s: float
    """Negative: not heard of since the daemon started."""
    drain: DrainRecord | None
    devices: tuple[DeviceView, ...]
    jobs: tuple[str, ...]


def _job_speeds(plane: ControlPlane, visible: set[str] | None) -> dict[str, list[JobSpeed]]:
    """Device id -> the speeds the running jobs the caller may see measured on it."""
    out: dict[str, list[JobSpeed]] = {}
    for job_id, fit in sorted(plane.job_fits().items()):
        if visible is not None and job_id not in visible:
            continue
        records = plane.store.measurements(job_id)
        by_device = {m.device_id: m for m in records}
        for device_id, tflops in fit.fit.tflops.items():
            m = by_device.get(device_id)
            out.setdefault(device_id, []).append(JobSpeed(
                job_id=job_id, tflops=float(tflops), dtype=m.dtype if m else fit.dtype,
                microbatch=m.microbatch if m else 0, unix_ms=m.unix_ms if m else 0))
    return out


def _launched(plane: ControlPlane, job_id: str) -> tuple[str, ...]:
    """Devices on which the job's launched ranks run now (its agents said so)."""
    launch = plane.launches.get(job_id)
    if launch is None:
        return ()
    return tuple(f"{h.host}:{d}" for h in launch.hosts if h.state == LAUNCH_RUNNING
                 for d in h.devices)


def node_views(plane: ControlPlane, owner: str | None, with_links: bool = False
               ) -> tuple[list[NodeView], list[tuple[str, LinkReport]]]:
    """Every registered host in name order (and, ``with_links``, each reported link as
    (from host, link)). ``owner``: job speeds and job ids of that owner's jobs only;
    None: every job's (the cluster token)."""
    now_ms = int(time.time() * 1000)
    running = plane.running_jobs()
    visible = None
    if owner is not None:
        visible = {j for j in running if (rec := plane.store.get_job(j)) is not None
                   and rec.owner == owner}
    devices_of = {j: (*plane.store.job_status(j)[0].devices, *_launched(plane, j))
                  for j in running if visible is None or j in visible}
    speeds = _job_speeds(plane, visible)
    drained = plane.drained()
    nodes: list[NodeView] = []
    links: list[tuple[str, LinkReport]] = []
    for agent, up, report in sorted(plane.agent_table(), key=lambda t: t[0].host):
        host = agent.host
        measured = {d.index: d for d in report.devices} if report else {}
        devices = tuple(
            DeviceView(host=host, info=d, report=measured.get(d.index),
                       planned_tflops=plane.device_speed(f"{host}:{d.index}"),
                       job_speeds=tuple(speeds.get(f"{host}:{d.index}", ())))
            for d in agent.devices)
        since, heard = plane.members.host_times(host)
        drain = drained.get(host)
        state = NODE_DRAINING if drain is not None else NODE_UP if up else NODE_DOWN
        jobs = tuple(j for j, devs in devices_of.items()
                     if any(d.rpartition(":")[0] == host for d in devs))
        nodes.append(NodeView(agent=agent, state=state, since_ms=since, alive=up,
                              last_seen_age_s=(now_ms - heard) / 1000 if heard else -1.0,
                              drain=drain, devices=devices, jobs=jobs))
        if with_links and report is not None:
            links.extend((host, link) for link in report.links)
    return nodes, links
