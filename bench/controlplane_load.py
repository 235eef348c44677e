"""Load benchmark of the control plane: N simulated agents, each reporting once
a second over its own AgentService.Report stream, against a local daemon
subprocess on 127.0.0.1. Per step: p50/p99 report latency (write to ack),
lost reports (sent minus acked), and the daemon's CPU use from /proc.

  .venv/bin/python bench/controlplane_load.py --agents 250,500,1000,2000 --seconds 20

Bounded: each step runs --seconds plus a few seconds of ramp-up; the whole run
is capped by --budget seconds. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
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
                 start: float, out: dict[str, Any]) -> None:
    """Register, then report once a second on one stream until ``start + seconds``.
    Each latency is kept with its send time (seconds after ``start``), which separates
    the first seconds after the registration storm from the steady state."""
    md = metadata(TOKEN)
    try:
        registration = (await stub.Register(_register(host), metadata=md,
                                            timeout=60)).registration
    except grpc.aio.AioRpcError as exc:
        out["register_failed"].append(exc.code().name)
        return
    out["registered_at"].append(time.monotonic() - start)
    call = stub.Report(metadata=md)
    await asyncio.sleep(max(0.0, start - time.monotonic()) + random.random())
    end = start + seconds
    seq = 0
    try:
        while time.monotonic() < end:
            seq += 1
            t0 = time.perf_counter()
            sent_at = time.monotonic() - start
            out["sent"] += 1
            await call.write(_report(host, seq, registration))
            ack = await asyncio.wait_for(call.read(), 10)
            if ack is grpc.aio.EOF or ack.seq != seq:
                break
            out["lat"].append((round(sent_at, 3), time.perf_counter() - t0))
            out["acked"] += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
        await call.done_writing()
    except (grpc.aio.AioRpcError, TimeoutError):
        pass
    finally:
        call.cancel()


async def _worker(address: str, first: int, count: int, seconds: float, start: float
                  ) -> dict[str, Any]:
    out: dict[str, Any] = {"lat": [], "sent": 0, "acked": 0, "register_failed": [],
                           "registered_at": []}
    # a few channels (HTTP/2 connections) per worker, many streams each
    channels = [grpc.aio.insecure_channel(address, options=[
        ("grpc.max_concurrent_streams", 10000)]) for _ in range(4)]
    stubs = [agent_pb2_grpc.AgentServiceStub(c) for c in channels]
    await asyncio.gather(*(_agent(stubs[i % 4], f"h{first + i}", seconds, start, out)
                           for i in range(count)))
    for c in channels:
        await c.close()
    return out


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _step(address: str, pid: int, n: int, seconds: float, workers: int) -> dict:
    start = time.monotonic() + 3.0 + n / 1000  # time for every stream to open
    per = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    procs, first = [], 0
    for count in per:
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", address, str(first), str(count),
             str(seconds), str(time.time() + (start - time.monotonic()))],
            stdout=subprocess.PIPE, text=True))
        first += count
    time.sleep(max(0.0, start - time.monotonic()))
    cpu0, t0 = _cpu_seconds(pid), time.monotonic()
    results = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    cpu = (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    lat = sorted(x[1] for r in results for x in r["lat"])
    sent = sum(r["sent"] for r in results)
    acked = sum(r["acked"] for r in results)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")

    failed = sum(len(r["register_failed"]) for r in results)
    return {"agents": n, "register_failed": failed, "sent": sent, "acked": acked, "lost": sent - acked,
            "p50_ms": round(pct(0.5), 2), "p99_ms": round(pct(0.99), 2),
            "max_ms": round(lat[-1] * 1000, 2) if lat else None,
            "reports_per_s": round(acked / seconds, 1), "daemon_cpu_cores": round(cpu, 3)}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        address, first, count, seconds, start_wall = sys.argv[2:7]
        start = time.monotonic() + (float(start_wall) - time.time())
        out = asyncio.run(_worker(address, int(first), int(count), float(seconds), start))
        print(json.dumps(out))
        return 0
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--agents", default="250,500,1000,2000")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=2, help="client processes")
    ap.add_argument("--budget", type=float, default=400.0, help="stop starting steps after this")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hetpilot-bench-"))
    config = write_config(tmp / "d.toml", cluster_token=TOKEN, heartbeat_timeout_s=30.0)
    daemon = Daemon(tmp / "s", config, metrics=False, log_level="WARNING")
    began = time.monotonic()
    try:
        address = daemon.start(timeout=30)
        print(f"# cpu cores: {os.cpu_count()}, python {sys.version.split()[0]}, "
              f"grpcio {grpc.__version__}", flush=True)
        for n in (int(x) for x in args.agents.split(",")):
            if time.monotonic() - began > args.budget:
                print(f"# budget spent; skipping {n}", flush=True)
                break
            print(json.dumps(_step(address, daemon.pid, n, args.seconds, args.workers)),
                  flush=True)
    finally:
        if daemon.stop(30.0)[0] is None:
            print("# daemon did not stop within 30 s of SIGTERM (killed)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
