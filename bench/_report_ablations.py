"""Ablations of the daemon's report path, for bench/controlplane_profile.py --preload
(measurement only, never the daemon's behaviour): HETPILOT_ABLATE names one.

* ``floor_read``: a Report handler that only reads; it acks the reports that ask
  (not ``ack_later``) and, at the end of the stream, covers the rest: what grpc.aio
  costs to receive a report, with the acks the agents ask for.
* ``floor_ackall``: a handler that only acks, every report.
* ``nosql``: reports are not written (``SqliteStore.put_reports`` does nothing).
* ``notake``: the tables do not take reports (no liveness, listener or metrics).
* ``noconv``: the report's conversion from protobuf is skipped (no devices, links).
* ``throughput``: grpc's server option ``grpc.optimization_target=throughput``.
* ``bdp0``: grpc's server option ``grpc.http2.bdp_probe=0``.
* ``window10``: the group commit waits 10 ms after a commit instead of 2 ms.

  HETPILOT_ABLATE=floor_read .venv/bin/python bench/controlplane_profile.py \\
      --agents 2000 --seconds 15 --pin --preload bench/_report_ablations.py
"""

from __future__ import annotations

import os
from typing import Any

import grpc.aio
from hetpilot.daemon import convert, group_commit, membership, servicers, sqlite_store
from hetpilot.daemon.records import AgentReport
from hetpilot.v1 import agent_pb2

WHICH = os.environ.get("HETPILOT_ABLATE", "")


async def _read_only(self: Any, request_iterator: Any, context: Any) -> Any:
    last = 0
    async for request in request_iterator:
        if request.ack_later:
            last = request.seq
        else:
            last = 0
            yield agent_pb2.ReportAck(seq=request.seq)
    if last:
        yield agent_pb2.ReportAck(seq=last)


async def _ack_all(self: Any, request_iterator: Any, context: Any) -> Any:
    async for request in request_iterator:
        yield agent_pb2.ReportAck(seq=request.seq)


def _server_option(name: str, value: Any) -> None:
    plain = grpc.aio.server

    def server(*args: Any, options: Any = None, **kwargs: Any) -> Any:
        return plain(*args, options=[*(options or []), (name, value)], **kwargs)

    grpc.aio.server = server


if WHICH == "floor_read":
    servicers.AgentServicer.Report = servicers._stream(_read_only)  # type: ignore[method-assign]
elif WHICH == "floor_ackall":
    servicers.AgentServicer.Report = servicers._stream(_ack_all)  # type: ignore[method-assign]
elif WHICH == "nosql":
    sqlite_store.SqliteStore.put_reports = lambda self, reports: None  # type: ignore[method-assign]
elif WHICH == "notake":
    membership.Membership._take = (  # type: ignore[method-assign]
        lambda self, report: self.peers(report.agent_id))
elif WHICH == "noconv":
    convert.report_from_proto = (  # type: ignore[assignment]
        lambda req: AgentReport(agent_id=req.agent_id, seq=req.seq, unix_ms=req.unix_ms))
elif WHICH == "throughput":
    _server_option("grpc.optimization_target", "throughput")
elif WHICH == "bdp0":
    _server_option("grpc.http2.bdp_probe", 0)
elif WHICH == "window10":
    group_commit.ReportCommitter.__init__.__defaults__ = (512, 0.010)
elif WHICH:
    raise SystemExit(f"HETPILOT_ABLATE={WHICH!r}: not an ablation of bench/_report_ablations.py")
