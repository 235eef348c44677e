"""Where the daemon's time goes per agent report (issue 13): the load of
bench/controlplane_load.py (N simulated agents, one report a second each on its
own AgentService.Report stream) against a daemon that runs under a profiler.

  .venv/bin/python bench/controlplane_profile.py --agents 1000 --seconds 15 --profile cprofile
  .venv/bin/python bench/controlplane_profile.py --agents 500,1000,1500,2000 --pin
  .venv/bin/python bench/controlplane_profile.py --agents 2000 --pin --versus ../base/.venv/bin/python --rounds 4

The agents report as hetpilot's agent does (``--ack-every``, default its
ACK_EVERY): every Nth report asks for its ack, the others say ``ack_later``.
Per step it prints one JSON line: latency of the reports that ask (write to their
ack at the client; ``cover_*``: every report's write to the ack that covers it),
lost reports (sent, not covered), the daemon's CPU per report (per report sent
and covered) from /proc split by thread (the asyncio
loop runs in the main thread; grpc's C-core threads are separate), the load
clients' CPU per report, and, with a profiler:

* ``--profile cprofile``: cProfile in the daemon's main thread, switched on by
  SIGUSR1 when the steady reporting window starts (after every agent has
  registered) and off by SIGUSR2 when it ends; the top functions by own and by
  cumulative time, in microseconds per report. cProfile sees Python functions
  and the C functions Python calls, not grpc's Cython internals nor its C
  threads; it slows Python code down, so read its numbers as shares.
* ``--profile pyspy``: py-spy (pip-installed into .venv; not a dependency)
  sampling every thread's Python stack at 100 Hz, without pausing the daemon
  (``--nonblocking``), over the window: collapsed stacks. (``--native`` needs
  blocking samples, which on 2 cores stalled the daemon to 36 reports/s.)
* ``--profile perf``: Linux perf over the window, by thread and shared object.

``--pin`` runs the daemon on CPU 0 and the load clients on CPU 1 (2-core
machine), so the daemon has one core of its own and "agents per core" is
measured rather than inferred (other people's jobs on the machine can still
land on CPU 0: ``other_cpu_cores`` in the output shows how much else ran).
``--preload FILE`` execs FILE in the daemon before
it starts (used only to measure prototypes; see RESULTS-controlplane-profile.md).
``--versus PYTHON`` measures a before and an after side by side in one run: each
step runs ``--rounds`` times with the daemon under PYTHON (another checkout's
venv, with its own hetpilot: "base") and under this interpreter ("this"),
alternately, the load the same; each line is tagged ``daemon``, and the medians
of both close the step.

The daemon is started through this file (``--wrap``), which calls
``hetpilot.cli.main(["daemon", ...])`` in the main thread. Loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

TOKEN = "bench-cluster-token"


# -- the daemon side: cProfile switched by signals ------------------------------------

def wrap(argv: list[str]) -> int:
    """``--wrap PROFILE_OUT [--preload FILE] -- daemon args``: run the daemon in this
    process; SIGUSR1 starts cProfile in the main thread, SIGUSR2 stops it and writes
    the stats to PROFILE_OUT."""
    import cProfile

    out = argv[0]
    rest = argv[1:]
    if rest and rest[0] == "--preload":
        path = rest[1]
        exec(compile(Path(path).read_text(), path, "exec"), {"__name__": "preload"})
        rest = rest[2:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    prof = cProfile.Profile()
    state = {"on": False}

    def start(signum: int, frame: object) -> None:
        if not state["on"]:
            state["on"] = True
            prof.enable()

    def stop(signum: int, frame: object) -> None:
        if state["on"]:
            prof.disable()
            state["on"] = False
            prof.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from hetpilot.cli import main as cli_main

    try:
        return cli_main(["daemon", *rest])
    finally:
        stop(0, None)


# -- the load: controlplane_load's agents (latencies stamped with their send time) ----

# -- the driver side ------------------------------------------------------------------

def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (utime+stime) of each thread of ``pid``, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            stat = (task / "stat").read_text()
            comm = stat[stat.index("(") + 1: stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            name = "main (asyncio loop)" if task.name == str(pid) else comm
            out[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def machine_busy() -> float:
    """CPU seconds all processes have used so far, from /proc/stat (user..steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def start_daemon(tmp: Path, profile_out: Path, preload: str | None, pin: bool,
                 python: str = sys.executable) -> tuple[subprocess.Popen[bytes], str]:
    from _daemon import write_config

    tmp.mkdir(parents=True, exist_ok=True)
    config = write_config(tmp / "d.toml", cluster_token=TOKEN, heartbeat_timeout_s=30.0)
    state = tmp / "s"
    state.mkdir(parents=True, exist_ok=True)
    cmd = [python, __file__, "--wrap", str(profile_out)]
    if preload:
        cmd += ["--preload", preload]
    cmd += ["--", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--config",
            str(config), "--metrics-listen", "", "--log-level", "WARNING"]
    preexec = (lambda: os.sched_setaffinity(0, {0})) if pin else None
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, preexec_fn=preexec)
    began = time.monotonic()
    while time.monotonic() - began < 60:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads((state / "endpoints.json").read_text())
            if data["pid"] == proc.pid:
                return proc, data["grpc"]
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("daemon did not start")


def _profiler(kind: str, pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    venv_bin = Path(sys.executable).parent
    if kind == "pyspy":
        return subprocess.Popen([str(venv_bin / "py-spy"), "record", "--pid", str(pid),
                                 "--threads", "--nonblocking", "--rate", "100",
                                 "--duration", str(int(seconds)), "--format", "raw",
                                 "--output", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if kind == "perf":
        return subprocess.Popen(["perf", "record", "-F", "499", "-g", "-p", str(pid),
                                 "-o", str(out), "--", "sleep", str(seconds)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return None


def step(address: str, pid: int, n: int, seconds: float, workers: int, pin: bool,
         profile: str, work: Path, ack_every: int = 1) -> dict:
    start = time.monotonic() + 3.0 + n / 500  # every agent registers and opens its stream
    per = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    procs, first = [], 0
    preexec = (lambda: os.sched_setaffinity(0, {1})) if pin else None
    for count in per:
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", address,
             str(first), str(count), str(seconds), str(time.time() + (start - time.monotonic())),
             str(ack_every)],
            stdout=subprocess.PIPE, text=True, preexec_fn=preexec))
        first += count
    time.sleep(max(0.0, start - time.monotonic()))
    busy0 = machine_busy()
    cpu0, kids0, t0 = thread_cpu(pid), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    # the workers' CPU so far (start-up, Register): not part of the window
    workers0 = sum(sum(thread_cpu(p.pid).values()) for p in procs if p.poll() is None)
    if profile == "cprofile":
        os.kill(pid, signal.SIGUSR1)
    prof_out = work / f"{profile}-{n}.{'txt' if profile == 'pyspy' else 'data'}"
    prof = _profiler(profile, pid, seconds, prof_out)
    results = [json.loads(p.communicate(timeout=seconds + 120)[0]) for p in procs]
    wall = time.monotonic() - t0
    cpu1, kids1 = thread_cpu(pid), resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = machine_busy() - busy0
    if profile == "cprofile":
        os.kill(pid, signal.SIGUSR2)
    if prof is not None:
        prof.wait(timeout=seconds + 60)
    stamped = [tuple(x) for r in results for x in r["lat"]]
    lat = sorted(x for _, x in stamped)
    cover = sorted(x for r in results for x in r["cover"])
    steady = sorted(x for t, x in stamped if t >= 2.0)
    by_second: dict[int, float] = defaultdict(float)
    for t, x in stamped:
        by_second[int(t)] = max(by_second[int(t)], x)
    registered = [t for r in results for t in r["registered_at"]]
    sent = sum(r["sent"] for r in results)
    acked = sum(r["acked"] for r in results)

    def pct(q: float, xs: list[float] | None = None) -> float:
        xs = lat if xs is None else xs
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 2) if xs else float("nan")

    threads = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
    total = sum(threads.values())
    clients = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime) - workers0
    return {
        "agents": n, "pinned": pin, "profile": profile,
        "register_failed": len([c for r in results for c in r["register_failed"]]),
        "last_register_s_before_start": round(-max(registered), 2) if registered else None,
        "ack_every": ack_every, "sent": sent, "acked": acked, "lost": sent - acked,
        "p50_ms": pct(0.5), "p99_ms": pct(0.99), "p999_ms": pct(0.999),
        "acks": len(lat), "cover_p50_ms": pct(0.5, cover), "cover_p99_ms": pct(0.99, cover),
        "max_ms": round(lat[-1] * 1000, 2) if lat else None,
        "p99_ms_after_2s": pct(0.99, steady),
        "max_ms_by_second": [round(by_second[k] * 1000, 1) for k in sorted(by_second)],
        "reports_per_s": round(acked / seconds, 1), "window_s": round(wall, 2),
        "daemon_cpu_cores": round(total / wall, 3),
        "daemon_cpu_us_per_report": round(total / max(acked, 1) * 1e6, 1),
        "daemon_threads_us_per_report": {k: round(v / max(acked, 1) * 1e6, 1)
                                         for k, v in sorted(threads.items(), key=lambda x: -x[1])
                                         if v > 0},
        "clients_cpu_us_per_report": round(clients / max(acked, 1) * 1e6, 1),
        "clients_cpu_cores": round(clients / wall, 3),
        # everything else on the machine (other people's jobs; this driver, a profiler)
        "other_cpu_cores": round((busy - total - clients) / wall, 3),
        "profile_file": str(prof_out) if profile != "none" else None,
        "loadavg": os.getloadavg()[0],
    }


def print_cprofile(path: Path, reports: int, top: int) -> None:
    import pstats

    st = pstats.Stats(str(path))
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        short = file.replace(str(ROOT) + "/", "")
        if "site-packages/" in short:
            short = short.split("site-packages/", 1)[1]
        if "lib/python3" in short:
            short = "stdlib/" + short.split("lib/python3.11/", 1)[-1]
        rows.append((f"{short}:{line}({fn})", nc, tt, ct))
    print(f"# cProfile of the daemon's main thread over the window; {reports} reports; "
          f"total own time {st.total_tt:.2f} s = {st.total_tt / reports * 1e6:.1f} us/report "
          "(wall-clock timer: select.epoll.poll is mostly idle waiting)")  # type: ignore[attr-defined]
    for key, title in ((2, "own (tottime)"), (3, "cumulative")):
        print(f"# top {top} by {title}: us/report own, us/report cumulative, calls/report, function")
        for name, nc, tt, ct in sorted(rows, key=lambda r: -r[key])[:top]:
            print(f"{tt / reports * 1e6:9.1f} {ct / reports * 1e6:9.1f} {nc / reports:7.2f}  {name}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--wrap":
        return wrap(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":  # a load client process
        from controlplane_load import main as load_main

        return load_main()
    from hetpilot.agents.agent import ACK_EVERY  # not at the top: --wrap runs under --versus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default="1000")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--workers", type=int, default=2, help="client processes")
    ap.add_argument("--profile", choices=("none", "cprofile", "pyspy", "perf"), default="none")
    ap.add_argument("--pin", action="store_true", help="daemon on CPU 0, clients on CPU 1")
    ap.add_argument("--preload", help="a file exec'd in the daemon first (prototypes)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default="", help="keep profiles here (default: a temp dir)")
    ap.add_argument("--versus", help="another interpreter to run the daemon under, "
                                     "alternately with this one (a before and after)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each daemon per step")
    ap.add_argument("--ack-every", type=int, default=ACK_EVERY,
                    help="each agent asks for the ack of every Nth report (the others say "
                         "ack_later), as hetpilot's agent does; 1: every report")
    args = ap.parse_args()
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hetpilot-profile-"))
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="hetpilot-profile-daemon-"))
    import grpc

    print(f"# cpu cores: {os.cpu_count()}, python {sys.version.split()[0]}, grpcio "
          f"{grpc.__version__}, profile {args.profile}, pin {args.pin}, "
          f"preload {args.preload}", flush=True)
    daemons = [("base", args.versus), ("this", sys.executable)] if args.versus else [
        ("this", sys.executable)]
    for n in (int(x) for x in args.agents.split(",")):
        runs: dict[str, list[dict]] = defaultdict(list)
        for r in range(args.rounds):
            for tag, python in daemons:
                cprof = work / f"cprofile-{n}-{tag}-{r}.pstats"
                res = run_step(tmp / f"d{n}-{tag}-{r}", cprof, python, n, args, work)
                res["daemon"] = tag
                runs[tag].append(res)
                print(json.dumps(res), flush=True)
                if args.profile == "cprofile" and cprof.exists():
                    print_cprofile(cprof, max(res["acked"], 1), args.top)
        if len(daemons) > 1 or args.rounds > 1:
            print(json.dumps({"agents": n, "medians": {tag: medians(rs) for tag, rs in runs.items()}}),
                  flush=True)
    return 0


def run_step(tmp: Path, cprof: Path, python: str, n: int, args: argparse.Namespace,
             work: Path) -> dict:
    """One step against a fresh daemon run under ``python``."""
    proc, address = start_daemon(tmp, cprof, args.preload, args.pin, python)
    try:
        res = step(address, proc.pid, n, args.seconds, args.workers, args.pin, args.profile, work,
                   args.ack_every)
        if args.profile == "cprofile":
            res["profile_file"] = str(cprof)
        return res
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def medians(runs: list[dict]) -> dict:
    """The median of each figure that says how a daemon did, over its runs."""
    import statistics

    keys = ("daemon_cpu_us_per_report", "p50_ms", "p99_ms", "max_ms", "cover_p99_ms", "lost",
            "reports_per_s")
    out: dict = {}
    for k in keys:
        values = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(values) if values else None
    out["daemon_cpu_us_per_report_runs"] = [r["daemon_cpu_us_per_report"] for r in runs]
    out["p99_ms_runs"] = [r["p99_ms"] for r in runs]
    out["lost_total"] = sum(r["lost"] for r in runs)
    return out


if __name__ == "__main__":
    sys.exit(main())
