"""N job control loops planning at once, against a REAL daemon subprocess (issue 13).

  .venv/bin/python bench/daemon_jobs.py [--jobs 8,32] [--seconds 20] [--slot-s 0.5]

Loopback only (127.0.0.1), EMULATED devices only. For each N in --jobs, on a
fresh state dir: start ``hetpilot daemon``, register --agents EMULATED agents
(2 devices each) that keep reporting every 0.5 s, submit N valid jobs
(examples/model.json, different global batches and budgets) all at once from N
threads, then for --seconds sample every job's slot (ListJobs, every 0.5 s) and
the health-check latency, against the same checks for --idle-seconds before the
submits (the ratio: how much planning costs the event loop). Reported per N: slots per job (min/median/max)
against the slots expected (elapsed / slot_s), the jobs on pace (within 2 slots
of that), the jobs stuck at slot 0 and those that stopped advancing (no new slot
in the last --stall-s seconds), plan versions, health-check p99/max, RSS. Then
SIGTERM (exit code and time), restart on the same state dir and sample again
for --restart-seconds: every loop must step again.

A loop stuck at slot 0 or stopped (before or after the restart) is a failure:
last line ``JOBS FAILED: <reasons>`` and exit status 1; ``JOBS OK`` otherwise.
Falling behind the slot rate is reported, not failed (one planning process
serves every job in turn).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from hetpilot.v1 import job_pb2, job_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import (
    Daemon,
    EmulatedAgents,
    Monitor,
    log_summary,
    metadata,
    pct,
    submit_request,
    write_config,
)

OWNER, OWNER_TOKEN = "bench", "bench-owner-token-1"
CLUSTER_TOKEN = "bench-cluster-token-2"
BATCHES = [32, 64, 96, 128, 192, 256, 384, 512]
BUDGETS = [4.0, 8.0, 16.0, 32.0, 1000.0]


class Slots:
    """Every job's (time, slot, plan_version), sampled with ListJobs."""

    def __init__(self, address: str, jobs: list[str]) -> None:
        self.jobs = jobs
        self.history: dict[str, list[tuple[float, int, int]]] = {j: [] for j in jobs}
        self.warnings: dict[str, str] = {}
        self.errors: dict[str, int] = {}
        self._channel = grpc.insecure_channel(address)
        self._stub = job_pb2_grpc.JobServiceStub(self._channel)
        self._lock = threading.Lock()

    def sample(self) -> None:
        try:
            resp = self._stub.ListJobs(job_pb2.ListJobsRequest(), metadata=metadata(OWNER_TOKEN),
                                       timeout=5)
        except grpc.RpcError as exc:
            name = exc.code().name  # type: ignore[attr-defined]
            self.errors[name] = self.errors.get(name, 0) + 1
            return
        now = time.monotonic()
        with self._lock:
            for info in resp.jobs:
                if info.job_id in self.history:
                    self.history[info.job_id].append((now, info.slot, info.plan_version))
                    self.warnings[info.job_id] = "; ".join(info.warnings)

    def first(self, job: str) -> int:
        with self._lock:
            h = self.history[job]
            return h[0][1] if h else -1

    def last(self, job: str) -> tuple[float, int, int]:
        with self._lock:
            h = self.history[job]
            return h[-1] if h else (0.0, -1, 0)

    def slot_at(self, job: str, t: float) -> int:
        with self._lock:
            before = [s for (ts, s, _) in self.history[job] if ts <= t]
        return before[-1] if before else -1

    def close(self) -> None:
        self._channel.close()


def submit_all(address: str, n: int, slot_s: float) -> tuple[list[str], list[float], list[str]]:
    """N SubmitJob calls released together from N threads; (job ids, latencies, errors)."""
    barrier = threading.Barrier(n)
    channel = grpc.insecure_channel(address)
    stub = job_pb2_grpc.JobServiceStub(channel)

    def one(i: int) -> tuple[str, float, str]:
        req = submit_request(name=f"jobs-{i}", global_batch=BATCHES[i % len(BATCHES)],
                             microbatch_size=4, slot_s=slot_s, v=10.0,
                             budgets={"price_per_hour": BUDGETS[i % len(BUDGETS)]},
                             request_id=f"bench-{i}")
        barrier.wait(timeout=30)
        t0 = time.perf_counter()
        try:
            info = stub.SubmitJob(req, metadata=metadata(OWNER_TOKEN), timeout=30)
            return info.job_id, time.perf_counter() - t0, ""
        except grpc.RpcError as exc:
            return "", time.perf_counter() - t0, f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]

    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(one, range(n)))
    channel.close()
    return ([r[0] for r in results if r[0]], [r[1] for r in results],
            [r[2] for r in results if r[2]])


def sample_phase(daemon: Daemon, jobs: list[str], seconds: float, slot_s: float,
                 stall_s: float) -> dict[str, Any]:
    """Sample for ``seconds``; per-job slots counted from the first sample."""
    slots = Slots(daemon.address, jobs)
    monitor = Monitor(daemon, period=0.5, extra=slots.sample).start()
    t0 = time.monotonic()
    time.sleep(seconds)
    stats = monitor.stop()
    slots.sample()
    t_end = time.monotonic()
    elapsed = t_end - t0
    done = {j: slots.last(j)[1] - max(slots.first(j), 0) for j in jobs}
    final = {j: slots.last(j)[1] for j in jobs}
    expected = elapsed / slot_s
    # "stopped": no new slot for longer than the jobs' turn takes (with N jobs sharing one
    # planning process a turn can be seconds) and at least stall_s
    median = statistics.median(done.values()) if done else 0
    window = min(max(stall_s, 2.5 * elapsed / max(median, 1)), 0.6 * elapsed)
    stuck0 = [j for j in jobs if final[j] <= 0]
    stopped = [j for j in jobs if final[j] > 0 and final[j] <= slots.slot_at(j, t_end - window)]
    first_step = [next((ts - t0 for ts, s, _ in slots.history[j] if s > max(slots.first(j), 0)),
                       None) for j in jobs]
    not_stepping = [j for j in jobs if done[j] <= 0]
    versions = [slots.last(j)[2] for j in jobs]
    failing = [j for j in jobs if "failed" in slots.warnings.get(j, "")]
    vals = list(done.values()) or [0]
    out = {
        "elapsed_s": round(elapsed, 1), "expected_slots": round(expected, 1),
        "slots_min": min(vals), "slots_median": statistics.median(vals), "slots_max": max(vals),
        "on_pace": sum(1 for v in vals if v >= expected - 2),
        "stall_window_s": round(window, 1),
        "first_step_s_max": None if None in first_step or not first_step
        else round(max(x for x in first_step if x is not None), 1),
        "stuck_at_0": len(stuck0), "stopped": len(stopped), "not_stepping": len(not_stepping),
        "plan_versions": [min(versions or [0]), statistics.median(versions or [0]),
                          max(versions or [0])],
        "loops_with_failure_warning": len(failing),
        "example_warning": next((slots.warnings[j][:160] for j in jobs
                                 if slots.warnings.get(j)), ""),
        "health_p99_ms": round(pct(stats.health_ms, 0.99), 1),
        "health_max_ms": round(max(stats.health_ms, default=float("nan")), 1),
        "health_failures": len(stats.health_failures),
        "rss_mb": round(max(stats.rss_kb, default=0) / 1024),
        "planner_rss_mb": round(max(stats.planner_rss_kb, default=0) / 1024),
        "list_errors": slots.errors,
    }
    slots.close()
    return out


def run_n(n: int, args: argparse.Namespace, reasons: list[str]) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"hetpilot-jobs{n}-"))
    config = write_config(tmp / "daemon.toml", cluster_token=CLUSTER_TOKEN,
                          owner_tokens={OWNER: OWNER_TOKEN}, slot_s=args.slot_s,
                          report_interval_s=0.5, heartbeat_timeout_s=5.0, grace_s=2.0)
    daemon = Daemon(tmp / "state", config, log=tmp / "daemon.log")
    row: dict[str, Any] = {"jobs": n, "state_dir": str(tmp)}
    agents = None
    try:
        daemon.start(timeout=30)
        hosts = [f"emu{i}" for i in range(args.agents)]
        agents = EmulatedAgents(daemon.address, CLUSTER_TOKEN, hosts, devices=2,
                                interval=0.5).start()
        t_wait = time.monotonic() + 15
        while agents.stats.acked < len(hosts) and time.monotonic() < t_wait:
            time.sleep(0.1)
        # the same health checks with no job planning: the baseline of the ratio below
        idle = Monitor(daemon, period=0.5).start()
        time.sleep(args.idle_seconds)
        idle_ms = idle.stop().health_ms
        row["idle_health_p99_ms"] = round(pct(idle_ms, 0.99), 1)
        jobs, lat, errors = submit_all(daemon.address, n, args.slot_s)
        row["submit_max_ms"] = round(max(lat, default=0) * 1000, 1)
        row["submit_errors"] = errors[:3]
        if errors:
            reasons.append(f"N={n}: {len(errors)} submits failed ({errors[0]})")
        row["before"] = sample_phase(daemon, jobs, args.seconds, args.slot_s, args.stall_s)
        b = row["before"]
        row["health_p99_ratio"] = round(b["health_p99_ms"] / max(row["idle_health_p99_ms"],
                                                                 1e-3), 1)
        for key, what in (("stuck_at_0", "stuck at slot 0"), ("stopped", "stopped advancing")):
            if b[key]:
                reasons.append(f"N={n}: {b[key]} job loop(s) {what}")
        rc, took = daemon.stop(15.0)
        row["stop"] = {"exit_code": rc, "seconds": round(took, 2)}
        if rc != 0:
            reasons.append(f"N={n}: SIGTERM gave exit code {rc} after {took:.1f} s")
        t0 = time.monotonic()
        daemon.start(timeout=30)
        row["restart_s"] = round(time.monotonic() - t0, 2)
        agents.retarget(daemon.address)
        row["after"] = sample_phase(daemon, jobs, args.restart_seconds, args.slot_s,
                                    min(args.stall_s, args.restart_seconds / 2))
        a = row["after"]
        if a["not_stepping"]:
            reasons.append(f"N={n}: {a['not_stepping']} job loop(s) did not step after the "
                           f"restart ({args.restart_seconds:g} s)")
        rc, took = daemon.stop(15.0)
        row["stop2"] = {"exit_code": rc, "seconds": round(took, 2)}
        if rc != 0:
            reasons.append(f"N={n}: second SIGTERM gave exit code {rc} after {took:.1f} s")
    except Exception as exc:
        reasons.append(f"N={n}: {type(exc).__name__}: {exc}")
    finally:
        if agents is not None:
            agents.stop()
        daemon.kill()
        logsum = log_summary(tmp / "daemon.log")
        row["log_tracebacks"] = logsum["tracebacks"]
        row["log_exceptions"] = logsum["exceptions"][:3]
    if not reasons and not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="8,32", help="comma-separated job counts")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--slot-s", type=float, default=0.5)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--restart-seconds", type=float, default=10.0)
    ap.add_argument("--idle-seconds", type=float, default=5.0,
                    help="health checks before the jobs are submitted: the baseline")
    ap.add_argument("--stall-s", type=float, default=None,
                    help="a loop with no new slot in the last this many seconds has stopped "
                    "(default max(5, 8 slots))")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs even when OK")
    args = ap.parse_args()
    if args.stall_s is None:
        args.stall_s = max(5.0, 8 * args.slot_s)
    ns = [int(x) for x in args.jobs.split(",") if x.strip()]
    cap = sum(args.seconds + args.restart_seconds + args.idle_seconds + 90 for _ in ns)
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(cap):
            print(f"JOBS FAILED: hard time cap of {cap:.0f} s reached", flush=True)
            os._exit(1)

    threading.Thread(target=watchdog, daemon=True).start()
    print(f"# hetpilot job loops: loopback 127.0.0.1, {args.agents} EMULATED agents x 2 "
          f"devices, slot_s {args.slot_s:g}, {os.cpu_count()} CPU cores", flush=True)
    reasons: list[str] = []
    rows = []
    for n in ns:
        r: list[str] = []
        row = run_n(n, args, r)
        reasons += r
        rows.append(row)
        print(f"# N={n}: {json.dumps(row)}", flush=True)
    print_table(rows, args)
    done.set()
    if reasons:
        print("JOBS FAILED: " + "; ".join(reasons))
        return 1
    print("JOBS OK")
    return 0


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"job loops (loopback, EMULATED devices; slot_s {args.slot_s:g}, "
              f"{args.seconds:g} s, then restart and {args.restart_seconds:g} s)")
    for col in ("N", "phase", "expected slots", "slots min/med/max", "on pace",
                "stuck at 0", "stopped", "plan versions min/med/max", "health p99/max ms",
                "RSS MB (planner)", "SIGTERM exit/s"):
        t.add_column(col)
    for row in rows:
        for phase, key, stop in (("first run", "before", "stop"),
                                 ("after restart", "after", "stop2")):
            p = row.get(key)
            if not p:
                continue
            s = row.get(stop, {})
            t.add_row(str(row["jobs"]), phase, str(p["expected_slots"]),
                      f"{p['slots_min']}/{p['slots_median']}/{p['slots_max']}",
                      f"{p['on_pace']}/{row['jobs']}", str(p["stuck_at_0"]),
                      str(p["stopped"] if key == "before" else p["not_stepping"]),
                      "/".join(str(v) for v in p["plan_versions"]),
                      f"{p['health_p99_ms']}/{p['health_max_ms']}",
                      f"{p['rss_mb']} ({p['planner_rss_mb']})",
                      f"{s.get('exit_code')}/{s.get('seconds')}")
    Console(width=180, highlight=False).print(t)
    for row in rows:
        print(f"N={row['jobs']}: health p99 while the jobs plan / idle (same daemon, same "
              f"checks, side by side): {(row.get('before') or {}).get('health_p99_ms')} / "
              f"{row.get('idle_health_p99_ms')} ms = {row.get('health_p99_ratio')}x")
        print(f"N={row['jobs']}: submit max {row.get('submit_max_ms')} ms, errors "
              f"{row.get('submit_errors')}; restart took {row.get('restart_s')} s; daemon log "
              f"Traceback lines {row.get('log_tracebacks')} {row.get('log_exceptions')}; "
              f"first step within {(row.get('before') or {}).get('first_step_s_max')} s of "
              f"the submits (after restart {(row.get('after') or {}).get('first_step_s_max')} "
              f"s); 'stopped' = no new slot in the last "
              f"{(row.get('before') or {}).get('stall_window_s')} s; warning e.g. "
              f"{(row.get('before') or {}).get('example_warning')!r}")


if __name__ == "__main__":
    sys.exit(main())
