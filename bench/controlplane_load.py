"""Load benchmark of the control plane: N simulated agents, each reporting once
a second over its own AgentService.Report stream, against a local daemon
subprocess on 127.0.0.1. The agents ask for the ack of every ``--ack-every``-th
report (the agent's ACK_EVERY; the others say ``ack_later``). Per step: p50/p99
latency of the reports that ask (write to ack), cover_p50/p99 of all (write to
the ack that covers it), lost reports (sent minus covered), and the daemon's CPU
use from /proc.

  .venv/bin/python bench/controlplane_load.py --agents 250,500,1000,2000 --seconds 20

Bounded: each step runs --seconds plus a few seconds of ramp-up; the whole run
is capped by --budget seconds. Loopback only. ``--daemon-cpus 0 --load-cpus 1``
pins the daemon (every thread, its planning processes) and the load generator to
separate cores, so the daemon's CPU per report is its own.

  .venv/bin/python bench/controlplane_load.py --store [--reports 20000] [--batch 64]

measures the state store alone, side by side in one run: the CPU per report of one
commit per report (what the daemon did before group commit) against one commit per batch (the
group commit of ``Store.put_reports``), and the ReportCommitter the report path
uses, 2000 reports arriving at once from the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from hetpilot.agents.agent import ACK_EVERY
from hetpilot.daemon.records import AgentReport, DeviceReport, LinkReport
from hetpilot.v1 import agent_pb2, agent_pb2_grpc, common_pb2

from hetpilot.channel import metadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import Daemon, write_config

TOKEN = "bench-cluster-token"


def _register(host: str) -> agent_pb2.RegisterRequest:
    return agent_pb2.RegisterRequest(host=host, probe_address=f"127.0.0.1:{9}",
                                     host_secret=f"bench-host-secret-{host}", devices=[
        agent_pb2.DeviceInfo(index=str(i), name="emu", kind=common_pb2.DEVICE_KIND_EMULATED,
                             tflops=50.0, memory_gb=80.0, price_per_hour=1.0, emulated=True)
        for i in range(2)])


def _report(host: str, seq: int, registration: str) -> agent_pb2.AgentReport:
    return agent_pb2.AgentReport(agent_id=host, seq=seq, unix_ms=int(time.time() * 1000),
                                 registration=registration,
                                 devices=[agent_pb2.DeviceReport(index=str(i), tflops=50.0,
                                                                 memory_total_gb=80.0,
                                                                 memory_free_gb=60.0,
                                                                 utilization=0.5, emulated=True)
                                          for i in range(2)],
                                 links=[agent_pb2.LinkReport(peer_host="peer", gbps=10.0,
                                                             rtt_us=50.0)])


async def _agent(stub: agent_pb2_grpc.AgentServiceStub, host: str, seconds: float,
                 start: float, out: dict[str, Any], ack_every: int = 1) -> None:
    """Register, then report once a second on one stream until ``start + seconds``, as
    hetpilot's agent does: the first report and every ``ack_every``-th ask for their
    ack and wait for it, the others say ``ack_later`` (1: every report asks; a daemon
    that does not know ack_later acks each anyway). A task reads the acks. ``lat``:
    the round trip of each report that asked for its ack (its write to its ack), kept
    with its send time (seconds after ``start``), which separates the first seconds
    after the registration storm from the steady state; ``cover``: each report's
    write to the ack that covers it; ``acked``: reports covered."""
    md = metadata(TOKEN)
    try:
        registration = (await stub.Register(_register(host), metadata=md,
                                            timeout=60)).registration
    except grpc.aio.AioRpcError as exc:
        out["register_failed"].append(exc.code().name)
        return
    out["registered_at"].append(time.monotonic() - start)
    call = stub.Report(metadata=md)
    sent: dict[int, tuple[float, float]] = {}  # seq -> (send time after start, perf_counter)
    waiting: dict[int, asyncio.Future[None]] = {}
    covered = 0

    async def read() -> None:
        nonlocal covered
        while (ack := await call.read()) is not grpc.aio.EOF:
            now = time.perf_counter()
            if ack.seq in waiting:  # a report that asked for its ack
                out["lat"].append((round(sent[ack.seq][0], 3), now - sent[ack.seq][1]))
            for seq in range(covered + 1, ack.seq + 1):
                out["cover"].append(now - sent.pop(seq)[1])
                out["acked"] += 1
            covered = max(covered, ack.seq)
            for seq in [s for s in waiting if s <= covered]:
                waiting.pop(seq).set_result(None)

    await asyncio.sleep(max(0.0, start - time.monotonic()) + random.random())
    reader = asyncio.create_task(read())
    phase = random.randrange(ack_every)  # as the agent: asks not in step with other agents
    end = start + seconds
    seq = 0
    try:
        while time.monotonic() < end:
            seq += 1
            t0 = time.perf_counter()
            sent[seq] = (time.monotonic() - start, t0)
            out["sent"] += 1
            report = _report(host, seq, registration)
            report.ack_later = seq > 1 and (seq - 1 + phase) % ack_every != 0
            asked = None if report.ack_later else asyncio.get_running_loop().create_future()
            if asked is not None:
                waiting[seq] = asked  # (its ack may come before the write returns)
            await call.write(report)
            if asked is not None:
                await asyncio.wait_for(asked, 10)
            if reader.done():
                break
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
        await call.done_writing()
        await asyncio.wait_for(reader, 10)  # the last ack covers every report
    except (grpc.aio.AioRpcError, TimeoutError):
        pass
    finally:
        reader.cancel()
        call.cancel()


async def _worker(address: str, first: int, count: int, seconds: float, start: float,
                  ack_every: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = {"lat": [], "cover": [], "sent": 0, "acked": 0,
                           "register_failed": [], "registered_at": []}
    # a few channels (HTTP/2 connections) per worker, many streams each
    channels = [grpc.aio.insecure_channel(address, options=[
        ("grpc.max_concurrent_streams", 10000)]) for _ in range(4)]
    stubs = [agent_pb2_grpc.AgentServiceStub(c) for c in channels]
    await asyncio.gather(*(_agent(stubs[i % 4], f"h{first + i}", seconds, start, out, ack_every)
                           for i in range(count)))
    for c in channels:
        await c.close()
    return out


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpus(spec: str) -> set[int]:
    return {int(c) for c in spec.split(",") if c.strip()}


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` and of its children (the planning processes) to
    ``cpus``; threads they start later inherit it."""
    pids = [pid, *(int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                   for c in (t / "children").read_text().split())]
    for p in pids:
        for tid in Path(f"/proc/{p}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended
                os.sched_setaffinity(int(tid.name), cpus)


def _step(address: str, pid: int, n: int, seconds: float, workers: int,
          load_cpus: set[int] | None = None, ack_every: int = 1) -> dict:
    start = time.monotonic() + 3.0 + n / 1000  # time for every stream to open
    per = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    procs, first = [], 0
    for count in per:
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", address, str(first), str(count),
             str(seconds), str(time.time() + (start - time.monotonic())), str(ack_every)],
            stdout=subprocess.PIPE, text=True,
            preexec_fn=None if not load_cpus else lambda: os.sched_setaffinity(0, load_cpus)))
        first += count
    time.sleep(max(0.0, start - time.monotonic()))
    cpu0, t0 = _cpu_seconds(pid), time.monotonic()
    results = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    cpu = (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    lat = sorted(x[1] for r in results for x in r["lat"])
    cover = sorted(x for r in results for x in r["cover"])
    sent = sum(r["sent"] for r in results)
    acked = sum(r["acked"] for r in results)

    def pct(q: float, xs: list[float] = lat) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")

    failed = sum(len(r["register_failed"]) for r in results)
    return {"agents": n, "ack_every": ack_every, "register_failed": failed, "sent": sent,
            "acked": acked, "lost": sent - acked,
            "p50_ms": round(pct(0.5), 2), "p99_ms": round(pct(0.99), 2),
            "max_ms": round(lat[-1] * 1000, 2) if lat else None,
            "acks": len(lat), "cover_p50_ms": round(pct(0.5, cover), 1),
            "cover_p99_ms": round(pct(0.99, cover), 1),
            "reports_per_s": round(acked / seconds, 1), "daemon_cpu_cores": round(cpu, 3),
            "daemon_cpu_us_per_report": round(cpu * 1e6 / max(acked / seconds, 1e-9), 1)}


def _store_bench(reports: int, batch: int) -> dict[str, Any]:
    """CPU per report of the SQLite store: a commit per report against a commit per
    ``batch`` reports, alternated in rounds on one database so both see the same file."""
    from hetpilot.daemon.sqlite_store import SqliteStore

    tmp = Path(tempfile.mkdtemp(prefix="hetpilot-store-bench-"))
    store = SqliteStore(tmp / "state.db")
    hosts = [f"h{i}" for i in range(2000)]

    def report(i: int) -> AgentReport:
        return AgentReport(agent_id=hosts[i % len(hosts)], seq=i, unix_ms=i, devices=tuple(
            DeviceReport(index=str(d), tflops=50.0, memory_total_gb=80.0, memory_free_gb=60.0,
                         utilization=0.5, emulated=True) for d in range(2)),
            links=(LinkReport(peer_host="peer", gbps=10.0, rtt_us=50.0),))

    cpu = {"one_commit_each": 0.0, "group_commit": 0.0}
    done = {"one_commit_each": 0, "group_commit": 0}
    rounds = max(1, reports // (batch * 8))
    for r in range(rounds):
        items = [report(r * batch * 8 + i) for i in range(batch * 8)]
        t0 = time.process_time()
        for item in items[:batch * 4]:
            store.put_report(item)
        t1 = time.process_time()
        for i in range(batch * 4, batch * 8, batch):
            store.put_reports(items[i:i + batch])
        t2 = time.process_time()
        cpu["one_commit_each"] += t1 - t0
        cpu["group_commit"] += t2 - t1
        done["one_commit_each"] += batch * 4
        done["group_commit"] += batch * 4
    # the committer the report path uses: 2000 agents' reports arriving at once
    from hetpilot.daemon.group_commit import ReportCommitter

    async def committer_rounds() -> tuple[float, float, int, int]:
        """CPU of the rounds through the committer, and of the same rounds of tasks that
        only yield (the asyncio cost of a task per report, which the daemon's Report
        handlers already pay): the difference is the committer's."""
        committer = ReportCommitter(store)

        async def nothing(_: AgentReport) -> None:
            await asyncio.sleep(0)

        n, spent, tasks_only = 0, 0.0, 0.0
        for r in range(max(1, reports // (2 * len(hosts)))):
            items = [report(r * len(hosts) + i) for i in range(len(hosts))]
            t0 = time.process_time()
            await asyncio.gather(*(nothing(item) for item in items))
            t1 = time.process_time()
            await asyncio.gather(*(committer.put(item) for item in items))
            t2 = time.process_time()
            tasks_only += t1 - t0
            spent += t2 - t1
            n += len(items)
        await committer.close()
        return spent, tasks_only, n, committer.batches

    spent, tasks_only, n, batches = asyncio.run(committer_rounds())
    cpu["committer"], done["committer"] = spent - tasks_only, n
    store.close()
    us = {k: round(cpu[k] * 1e6 / done[k], 1) for k in cpu}
    return {"store": "sqlite (WAL, synchronous=NORMAL)", "batch": batch,
            "committer_reports_per_batch": round(n / max(batches, 1), 1),
            "reports": sum(done.values()), "cpu_us_per_report": us,
            "ratio_one_each_to_group": round(us["one_commit_each"] / max(us["group_commit"],
                                                                         1e-9), 1)}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        address, first, count, seconds, start_wall = sys.argv[2:7]
        ack_every = int(sys.argv[7]) if len(sys.argv) > 7 else 1
        start = time.monotonic() + (float(start_wall) - time.time())
        out = asyncio.run(_worker(address, int(first), int(count), float(seconds), start,
                                  ack_every))
        print(json.dumps(out))
        return 0
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--agents", default="250,500,1000,2000")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=2, help="client processes")
    ap.add_argument("--budget", type=float, default=400.0, help="stop starting steps after this")
    ap.add_argument("--daemon-cpus", default="", help="pin the daemon to these cores (0,1)")
    ap.add_argument("--load-cpus", default="", help="pin the load generator to these cores")
    ap.add_argument("--ack-every", type=int, default=ACK_EVERY,
                    help="each agent asks for the ack of every Nth report (the others say "
                         "ack_later), as hetpilot's agent does; 1: every report")
    ap.add_argument("--store", action="store_true", help="the store alone (see above)")
    ap.add_argument("--reports", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    if args.store:
        print(json.dumps(_store_bench(args.reports, args.batch)), flush=True)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="hetpilot-bench-"))
    config = write_config(tmp / "d.toml", cluster_token=TOKEN, heartbeat_timeout_s=30.0)
    daemon = Daemon(tmp / "s", config, metrics=False, log_level="WARNING")
    began = time.monotonic()
    try:
        address = daemon.start(timeout=30)
        if args.daemon_cpus:
            _pin(daemon.pid, _cpus(args.daemon_cpus))
        print(f"# cpu cores: {os.cpu_count()}, python {sys.version.split()[0]}, "
              f"grpcio {grpc.__version__}; daemon on cores {args.daemon_cpus or 'any'}, "
              f"load on {args.load_cpus or 'any'}", flush=True)
        for n in (int(x) for x in args.agents.split(",")):
            if time.monotonic() - began > args.budget:
                print(f"# budget spent; skipping {n}", flush=True)
                break
            print(json.dumps(_step(address, daemon.pid, n, args.seconds, args.workers,
                                   _cpus(args.load_cpus) or None, args.ack_every)), flush=True)
    finally:
        if daemon.stop(30.0)[0] is None:
            print("# daemon did not stop within 30 s of SIGTERM (killed)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
