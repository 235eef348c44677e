"""The cluster the daemon plans on, observed from agent membership, the slowdown
estimator and the config: devices of up, undrained agents at the speed their
latest report and the estimator give them, links as the agents probed them.

Functions, not a class: they read the live tables of a
:class:`~hetpilot.daemon.membership.Membership` on the event loop and hold
nothing themselves.
"""

from __future__ import annotations

from dataclasses import replace

from hetpilot.adapt.online import Adapter
from hetpilot.planner.types import Cluster, Device, Link, Network

from .config import DaemonConfig
from .membership import Membership
from .records import DeviceInfo, DeviceReport, LinkTime

__all__ = ["device_speed", "emulated_devices", "link_refs", "observed_cluster"]


def observed_cluster(members: Membership, adapter: Adapter, config: DaemonConfig,
                     allowed_hosts: tuple[str, ...] = (),
                     only: frozenset[str] | None = None) -> Cluster:
    """The cluster as the latest reports show it: devices of up agents only, drained
    hosts left out; only the devices in ``only`` when given (a launched job's)."""
    allowed = set(allowed_hosts)
    drained = members.drained()
    devices: list[Device] = []
    for host in sorted(members.up):
        agent = members.agent(host)
        if agent is None or (allowed and host not in allowed) or host in drained:
            continue
        report = members.latest_report(host)
        measured = {d.index: d for d in report.devices} if report else {}
        for d in agent.devices:
            if only is not None and f"{host}:{d.index}" not in only:
                continue
            tflops = _speed(adapter, host, d, measured.get(d.index))
            if tflops <= 0 or d.memory_gb <= 0:
                continue
            devices.append(Device(id=f"{host}:{d.index}", host=host, tflops=tflops,
                                  memory_gb=d.memory_gb, price_per_hour=d.price_per_hour,
                                  power_watts=d.power_watts))
    hosts = {d.host for d in devices}
    links: list[Link] = []
    for host in sorted(hosts):
        report = members.latest_report(host)
        for link in report.links if report else ():
            if link.peer_host in hosts and link.peer_host != host and link.gbps > 0:
                links.append(Link(a=host, b=link.peer_host, gbps=link.gbps,
                                  latency_us=link.rtt_us / 2))
    network = Network(intra_host_gbps=config.intra_host_gbps,
                      inter_host_gbps=config.inter_host_gbps,
                      latency_us=config.latency_us, host_links=tuple(links))
    return Cluster(devices=tuple(devices), network=network)


def _speed(adapter: Adapter, host: str, d: DeviceInfo, m: DeviceReport | None) -> float:
    """The TFLOP/s the agents' view gives a device now: the latest probe (or the
    registered speed), over the estimator's predicted slowdown when it has one, else
    times ``1 - colocated_load``; emulated devices as reported."""
    tflops = m.tflops if m is not None and m.tflops > 0 else d.tflops
    predicted = None
    if m is not None and not d.emulated:  # plan with predicted speeds
        predicted = adapter.predict_tflops(
            f"{host}:{d.index}", adapter.interference(host, m, d.tflops), d.tflops)
    if predicted is not None:
        return predicted
    if m is not None and 0 < m.colocated_load < 1 and not d.emulated:
        tflops *= 1.0 - m.colocated_load
    return tflops


def device_speed(members: Membership, adapter: Adapter, device_id: str) -> float:
    """What :func:`observed_cluster` would give ``device_id`` now; 0 when no registered
    agent has it."""
    host, _, index = device_id.rpartition(":")
    agent = members.agent(host)
    info = next((d for d in agent.devices if d.index == index), None) if agent else None
    if info is None:
        return 0.0
    report = members.latest_report(host)
    m = next((d for d in report.devices if d.index == index), None) if report else None
    return max(0.0, _speed(adapter, host, info, m))


def emulated_devices(members: Membership) -> frozenset[str]:
    return frozenset(f"{a.host}:{d.index}" for a, _, _ in members.agent_table()
                     for d in a.devices if d.emulated)


def link_refs(cluster: Cluster, device_id: str,
              links: tuple[LinkTime, ...]) -> tuple[LinkTime, ...]:
    """``links`` with the latency and bandwidth each pair has in ``cluster`` (the
    observed one now; 0 where a device is unknown), for
    :meth:`~hetpilot.daemon.measured_fit.Measured.apply`."""
    out = []
    for lt in links:
        if device_id in cluster.by_id and lt.peer in cluster.by_id:
            gbps, lat = cluster.link(device_id, lt.peer)
            lt = replace(lt, ref_latency_s=lat, ref_gbps=gbps)
        out.append(lt)
    return tuple(out)
