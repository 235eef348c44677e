"""Cluster commands: ``hetpilot nodes [--links] [--json]``, ``hetpilot drain HOST``,
``hetpilot resume HOST``, ``hetpilot nodes forget HOST`` (ClusterService).

``nodes`` is for job owners and the cluster admin alike (like ``sinfo`` or
``ray status``): one row per device with its host's state (up, down,
draining) and since when, how long since its agent was last heard of, the
probe's TFLOP/s and what the probe ran, the speed the daemon plans with, the
speeds jobs measured on their own layers (a second table; an owner sees their
own jobs'), memory, load, price. ``--links`` prints the measured link matrix
(Gbit/s and RTT; a list when the matrix does not fit the terminal).

``nodes forget HOST`` unbinds a host name from the secret its agent was given at
its first registration (docs/operating.md, "Host identity"): the next agent to
register the name with the cluster token takes it (an agent whose state dir was
lost, a rebuilt host); launch parts not exited on the host are given up.

``drain``, ``resume`` and ``nodes forget`` need the cluster token (``--token-file
/etc/hetpilot/cluster.token``); an owner's token is refused (exit 4).
Exit codes as for the job commands (:mod:`hetpilot.client.cli`); an unknown
host is 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from hetpilot.v1 import cluster_pb2, cluster_pb2_grpc, common_pb2

from .cli import Md, call, common_arguments
from .tables import Column, fit, print_table, safe, terminal_width

__all__ = ["add_arguments", "run"]

_STATES = {cluster_pb2.NODE_STATE_UP: "up", cluster_pb2.NODE_STATE_DOWN: "down",
           cluster_pb2.NODE_STATE_DRAINING: "draining", cluster_pb2.NODE_STATE_UNSPECIFIED: "?"}
_KINDS = {common_pb2.DEVICE_KIND_CPU: "cpu", common_pb2.DEVICE_KIND_CUDA: "cuda",
          common_pb2.DEVICE_KIND_EMULATED: "emulated", common_pb2.DEVICE_KIND_UNSPECIFIED: "?"}
_INT64 = {"state_since_unix_ms", "registered_unix_ms", "measured_unix_ms", "unix_ms"}


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    common_arguments(parser, "your owner token or the cluster token" if name == "nodes"
                     else "the cluster token")
    if name == "nodes":
        parser.add_argument("--links", action="store_true",
                            help="print the measured links between hosts (Gbit/s, RTT)")
        parser.add_argument("action", nargs="?", choices=["forget"],
                            help="forget HOST: unbind the host name from its agent's secret "
                                 "(the next agent to register it takes it; cluster token)")
        parser.add_argument("host", nargs="?", help="the host to forget")
    else:
        parser.add_argument("host")
    if name == "drain":
        parser.add_argument("--reason", default="", help="shown by `hetpilot nodes`")


def _age(seconds: float) -> str:
    """12s, 4m05s, 3h12m, 2d04h; "-" for unknown (negative)."""
    if seconds < 0:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _plain(value: Any) -> Any:
    """MessageToDict output for scripts: int64 fields as numbers, enums as short words."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if k in _INT64:
            v = int(v)
        elif k == "state":
            v = v.removeprefix("NODE_STATE_").lower()
        elif k == "kind":
            v = v.removeprefix("DEVICE_KIND_").lower()
        out[k] = _plain(v)
    return out


_NODE_COLUMNS = (
    Column("device", 100), Column("state", 95), Column("since", 50, justify="right"),
    Column("seen", 85, justify="right"), Column("kind", 35),
    Column("TFLOP/s", 90, justify="right"), Column("probe", 30),
    Column("planned", 55, justify="right"), Column("job-measured", 52, justify="right"),
    Column("mem GB free/total", 70, justify="right"), Column("util", 60, justify="right"),
    Column("others", 45, justify="right"), Column("$/h", 65, justify="right"),
    Column("jobs", 25, justify="right"), Column("name", 15, shrink=True),
    Column("note", 40, shrink=True),
)
"""One row per device; columns by how much they matter when the terminal is narrow."""


def _job_measured(d: cluster_pb2.DeviceStatus) -> str:
    speeds = [j.tflops for j in d.job_speeds]
    if not speeds:
        return "-"
    low, high = min(speeds), max(speeds)
    span = f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}"
    return f"{span} ({len(speeds)} job{'s' if len(speeds) > 1 else ''})"


def _node_rows(resp: cluster_pb2.ListNodesResponse) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for n in resp.nodes:
        since = _age((resp.unix_ms - n.state_since_unix_ms) / 1000) if n.state_since_unix_ms \
            else "-"
        state = _STATES.get(n.state, "?")
        if n.state == cluster_pb2.NODE_STATE_DRAINING and not n.alive:
            state += " (down)"
        for d in n.devices:
            probe = " ".join(x for x in (d.probe_dtype, d.probe_shape) if x) or "declared"
            rows.append((d.device_id, state, since, _age(n.last_seen_age_s),
                         _KINDS.get(d.kind, "?"), f"{d.tflops:.1f}", probe,
                         f"{d.planned_tflops:.1f}", _job_measured(d),
                         f"{d.memory_free_gb:.1f}/{d.memory_total_gb:.1f}",
                         f"{100 * d.utilization:.0f}%", f"{100 * d.colocated_load:.0f}%",
                         f"{d.price_per_hour:.2f}", str(len(n.jobs)), d.name or "-",
                         n.drain_reason or "-"))
    return rows


def _print_job_speeds(resp: cluster_pb2.ListNodesResponse, width: int) -> None:
    rows = [(d.device_id, j.job_id, f"{j.tflops:.2f}", j.dtype or "-",
             str(j.microbatch) if j.microbatch else "-", _age(
                 (resp.unix_ms - j.measured_unix_ms) / 1000) if j.measured_unix_ms else "-")
            for n in resp.nodes for d in n.devices for j in d.job_speeds]
    if rows:
        print_table("speeds measured on the jobs' own layers (the daemon plans those jobs "
                    "with them)",
                    (Column("device", 100), Column("job", 90),
                     Column("TFLOP/s", 95, justify="right"), Column("dtype", 50),
                     Column("microbatch", 40, justify="right"),
                     Column("measured", 30, justify="right")), rows, width)


def _print_links(resp: cluster_pb2.ListNodesResponse, width: int) -> None:
    """A from x to matrix of "Gbit/s / RTT us" when it fits, else one row per link."""
    if not resp.links:
        print("no links measured yet (agents probe their peers' probe servers)")
        return
    cell = {(x.from_host, x.to_host): f"{x.gbps:.3g}/{x.rtt_us:.0f}" for x in resp.links}
    hosts = sorted({n.host for n in resp.nodes} | {h for pair in cell for h in pair})
    columns = [Column("from \\ to", 100), *(Column(h, 50, justify="right") for h in hosts)]
    rows = [(a, *("-" if a == b else cell.get((a, b), ".") for b in hosts)) for a in hosts]
    if len(fit(columns, rows, width)[0]) == len(columns):
        print_table("links: Gbit/s / RTT us, as the 'from' host measured them", columns, rows,
                    width, caption="'.': not measured (planned with the daemon's defaults)")
        return
    print_table("links (as the 'from' host measured them)",
                (Column("from", 100), Column("to", 100), Column("Gbit/s", 90, justify="right"),
                 Column("RTT us", 80, justify="right")),
                [(x.from_host, x.to_host, f"{x.gbps:.3g}", f"{x.rtt_us:.0f}")
                 for x in sorted(resp.links, key=lambda x: (x.from_host, x.to_host))], width)


def print_nodes(resp: cluster_pb2.ListNodesResponse, links: bool,
                width: int | None = None) -> None:
    width = width or terminal_width()
    if links:
        _print_links(resp, width)
        return
    if not resp.nodes:
        print("no agents have registered yet")
        return
    up = sum(n.state == cluster_pb2.NODE_STATE_UP for n in resp.nodes)
    print_table(f"hetpilot nodes: {len(resp.nodes)} hosts, {up} up", _NODE_COLUMNS,
                _node_rows(resp), width)
    _print_job_speeds(resp, width)


def _nodes(channel: grpc.Channel, md: Md, args: argparse.Namespace) -> int:
    stub = cluster_pb2_grpc.ClusterServiceStub(channel)
    resp = cluster_pb2.ListNodesResponse()
    token = ""
    while True:  # the daemon answers as many hosts as fit in one message, then a token
        page = stub.ListNodes(cluster_pb2.ListNodesRequest(links=args.links, page_token=token),
                              metadata=md, timeout=args.timeout)
        resp.nodes.extend(page.nodes)
        resp.links.extend(page.links)
        resp.unix_ms = page.unix_ms
        token = page.next_page_token
        if not token:
            break
    if args.json:
        print(json.dumps(_plain(MessageToDict(resp, preserving_proto_field_name=True))))
    else:
        print_nodes(resp, args.links)
    return 0


def _drain_or_resume(channel: grpc.Channel, md: Md, args: argparse.Namespace) -> int:
    stub = cluster_pb2_grpc.ClusterServiceStub(channel)
    if args.command == "drain":
        node = stub.DrainHost(cluster_pb2.DrainHostRequest(host=args.host, reason=args.reason),
                              metadata=md, timeout=args.timeout)
        text = (f"{node.host} draining: jobs plan without it from their next slot "
                f"({len(node.jobs)} running job(s) use it now)")
    else:
        node = stub.ResumeHost(cluster_pb2.ResumeHostRequest(host=args.host), metadata=md,
                               timeout=args.timeout)
        text = f"{node.host} {_STATES.get(node.state, '?')}: jobs may plan on it from their " \
               "next slot"
    if args.json:
        print(json.dumps(_plain(MessageToDict(node, preserving_proto_field_name=True))))
    else:
        print(safe(text))
    return 0


def _forget(channel: grpc.Channel, md: Md, args: argparse.Namespace) -> int:
    stub = cluster_pb2_grpc.ClusterServiceStub(channel)
    node = stub.ForgetHost(cluster_pb2.ForgetHostRequest(host=args.host), metadata=md,
                           timeout=args.timeout)
    if args.json:
        print(json.dumps(_plain(MessageToDict(node, preserving_proto_field_name=True))))
    else:
        print(safe(f"{node.host} forgotten ({_STATES.get(node.state, '?')}): the next agent "
                   "to register it with the cluster token is bound to the name"))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.command == "nodes" and getattr(args, "action", None) == "forget":
        if not args.host:
            print("hetpilot nodes forget: error: HOST is required", file=sys.stderr)
            return 2
        return call(args, lambda channel, md: _forget(channel, md, args))
    if args.command == "nodes" and getattr(args, "host", None):
        print(f"hetpilot nodes: error: unexpected argument {safe(args.host)!r} (did you mean "
              "`hetpilot nodes forget HOST`?)", file=sys.stderr)
        return 2
    command = _nodes if args.command == "nodes" else _drain_or_resume
    return call(args, lambda channel, md: command(channel, md, args))
