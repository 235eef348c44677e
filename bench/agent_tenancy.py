"""Campaign against the agent's launcher, as root, with real torchrun (issue 37: a
cluster its owners can share).

  .venv/bin/python bench/agent_tenancy.py [--trials 3] [--flood-mib 64] [--out t.json]

Three parts, each on this machine only (loopback, CPU ranks, users and a tmpfs made
for the run and removed after):

  * tenancy: two unix users made with useradd; owner A's launch (her rank sleeps with
    a secret in its ``[entry.env]``), then owner B's rank tries to read A's trainer
    token, her job environment file, her launch directory, her output, her launch
    record, her rank's and torchrun's ``/proc/<pid>/environ``, the agent's
    environment and cluster token, and to list the state dir, to signal A's rank
    (``kill -0``) and to read A's command line (which Linux makes public). Each
    attempt's result is printed.
  * agent death: a process holding a real Launcher starts a launch (torchrun, one
    rank), then is killed with SIGKILL; the launch's processes (runner, torchrun,
    rankio, the rank, and a process the rank left in a session of its own) are
    counted every 50 ms until none is left. Once with a rank that stops on SIGTERM,
    once with one that ignores it. ``--trials`` each.
  * output flood: a 16 MiB tmpfs as the agent's state dir, ``output_bytes`` 2 MiB;
    a rank prints ``--flood-mib`` MiB (100-byte lines), then a second launch starts
    and prints one line. Reports the flood's rate through rankio and the runner,
    what the disk holds after, and the second launch's exit.

Needs root (useradd, mount, switching users) and a Python other users can run (a
part says why it is skipped otherwise). Last line: ``TENANCY OK`` or
``TENANCY FAILED: <reasons>``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "controlplane"))

from helpers import wait_until  # type: ignore[import-not-found]  # noqa: E402
from hetpilot.agents.launcher import Launcher  # noqa: E402
from hetpilot.agents.procs import descendants, proc_stat  # noqa: E402
from hetpilot.v1 import agent_pb2  # noqa: E402
from sandbox import (  # type: ignore[import-not-found]  # noqa: E402
    PROBE,
    shared_dir,
    unix_users,
    why_no_users,
)

SLEEPER = "import time; print('ready', flush=True); time.sleep(600)"
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sleeper = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
pid = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
print("ready", pid, flush=True)
time.sleep(600)
"""
AGENT = """
import json, sys, time
from hetpilot.agents.launcher import Launcher
from hetpilot.v1 import agent_pb2
state, work, port, code = sys.argv[1:5]
launcher = Launcher(state, host="h", daemon="127.0.0.1:1", run_as="agent", stop_grace_s=3.0)
launcher.start(agent_pb2.LaunchOrder(
    launch_id="L1", job_id="j1", nnodes=1, devices=["0"], rdzv_host=True,
    rdzv_endpoint="127.0.0.1:" + port, workdir=work, command=[sys.executable, "-c", code]), {})
print(json.dumps({"runner": launcher.get("L1").pid}), flush=True)
while True:
    launcher.poll()
    time.sleep(0.2)
"""


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _order(launch_id: str, code: str, *args: str, user: str = "", **kw: Any) -> Any:
    return agent_pb2.LaunchOrder(launch_id=launch_id, job_id=f"job-{launch_id}", nnodes=1,
                                 devices=["0"], rdzv_host=True,
                                 rdzv_endpoint=f"127.0.0.1:{_port()}", unix_user=user,
                                 command=[sys.executable, "-c", code], args=list(args),
                                 trainer_token=f"hpj_{launch_id}_secret", **kw)


def _ended(launcher: Launcher, launch_id: str) -> Any:
    launcher.poll()
    state = launcher.get(launch_id)
    return state is not None and not state.running and state


def tenancy(failures: list[str]) -> dict[str, str]:
    why = why_no_users()
    if why:
        return {"skipped": why}
    with shared_dir() as base, unix_users(2) as (alice, bob):
        token = base / "cluster.token"
        token.write_text("cluster-token-of-the-agent\n")
        os.chmod(token, 0o600)
        launcher = Launcher(base / "agent", host="h", daemon="127.0.0.1:1", stop_grace_s=3.0)
        launcher.start(_order("LA", SLEEPER, user=alice, env={"SECRET": "a-secret"}), {})
        a = launcher.get("LA")
        assert a is not None and a.work is not None
        wait_until("A's rank", lambda: b"[rank0]:ready" in a.output.read_bytes(), timeout=120)
        tree = descendants({a.pid: a.start_ticks})
        torchrun = next(p for p in tree if (proc_stat(p) or (0, 0))[0] == a.pid)
        rank = next(p for p in tree if Path(f"/proc/{p}/cmdline").read_bytes().startswith(
            sys.executable.encode()) and b"time.sleep(600)" in
            Path(f"/proc/{p}/cmdline").read_bytes() and b"rankio" not in
            Path(f"/proc/{p}/cmdline").read_bytes())
        [segment] = a.output.segments()
        targets = {
            "A's trainer token": str(a.work / "trainer.token"),
            "A's [entry.env] file": str(a.work / "env.json"),
            "A's launch directory": str(a.work),
            "A's output on the agent": str(segment[1]),
            "A's launch record": str(a.dir / "launch.json"),
            "A's rank's environment": f"/proc/{rank}/environ",
            "A's torchrun's environment": f"/proc/{torchrun}/environ",
            "the agent's environment": f"/proc/{os.getpid()}/environ",
            "the agent's cluster token": str(token),
            "the state dir (list)": str(base / "agent"),
            "the launch records (list)": str(launcher.root),
            "the launch directories (list)": str(launcher.work),
            "A's command line (public on Linux)": f"/proc/{rank}/cmdline",
            "B's own trainer token (control)": str(launcher.work / "LB" / "trainer.token"),
        }
        launcher.start(_order("LB", PROBE, json.dumps(targets), str(rank), user=bob), {})
        b = wait_until("B's probe", lambda: _ended(launcher, "LB"), timeout=120)
        line = next(x for x in b.output.read_bytes().decode().splitlines() if "PROBE " in x)
        seen: dict[str, str] = json.loads(line.split("PROBE ", 1)[1])
        launcher.stop("LA")
        wait_until("A's launch to end", lambda: _ended(launcher, "LA"), timeout=120)
        for what, result in seen.items():
            expect_read = what.startswith(("A's command line", "B's own"))
            if expect_read != (result.startswith(("READ", "listed", "ALLOWED"))):
                failures.append(f"tenancy: {what}: {result}")
        return seen


def agent_death(trials: int, failures: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, code in (("rank stops on SIGTERM", SLEEPER), ("rank ignores SIGTERM", STUBBORN)):
        times, alive_1s = [], []
        for _ in range(trials):
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp) / "work"
                work.mkdir()
                agent = subprocess.Popen(
                    [sys.executable, "-c", AGENT, str(Path(tmp) / "agent"), str(work),
                     str(_port()), code], stdout=subprocess.PIPE, text=True)
                runner = json.loads(agent.stdout.readline())["runner"]  # type: ignore[union-attr]
                state = Path(tmp) / "agent" / "launches" / "L1" / "output"

                def ready(state: Path = state) -> bool:
                    return any(b"[rank0]:ready" in p.read_bytes() for p in state.glob("*.log"))

                wait_until("the rank", ready, timeout=120)
                procs = {runner: (proc_stat(runner) or (0, 0))[1],
                         **descendants({runner: (proc_stat(runner) or (0, 0))[1]})}
                t0 = time.monotonic()
                agent.send_signal(signal.SIGKILL)
                agent.wait()
                seen_1s = None
                while True:
                    alive = [p for p, t in procs.items() if (proc_stat(p) or (0, -1))[1] == t]
                    now = time.monotonic() - t0
                    if seen_1s is None and now >= 1.0:
                        seen_1s = len(alive)
                    if not alive or now > 60:
                        break
                    time.sleep(0.05)
                if alive:
                    failures.append(f"agent death ({name}): {len(alive)} process(es) alive "
                                    "60 s after kill -9")
                    for p in alive:  # ours: this run started them
                        os.kill(p, signal.SIGKILL)
                times.append(round(now, 2))
                alive_1s.append(seen_1s if seen_1s is not None else 0)
                out_n = len(procs)
        out[name] = {"processes": out_n, "seconds_until_none": times,
                     "alive_after_1s": alive_1s}
    return out


def flood(mib: int, failures: list[str]) -> dict[str, Any]:
    if os.geteuid() != 0:
        return {"skipped": "needs root to mount a tmpfs"}
    with tempfile.TemporaryDirectory() as tmp:
        disk = Path(tmp) / "disk"
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0711", "tmpfs",
                        str(disk)], check=True)
        try:
            launcher = Launcher(disk / "agent", host="h", daemon="127.0.0.1:1", run_as="agent",
                                output_bytes=2 * 1024 * 1024)
            code = (f"import sys\nfor _ in range({mib * 1024 * 1024 // 100 // 1000}):\n"
                    "    sys.stdout.write(('x' * 99 + '\\n') * 1000)\n"
                    "print('last line', flush=True)\n")
            t0 = time.monotonic()
            launcher.start(_order("A", code), {})
            a = wait_until("the flood", lambda: _ended(launcher, "A"), timeout=300)
            took = time.monotonic() - t0
            work_bytes = sum(f.stat().st_size for f in (disk / "agent" / "work").rglob("*")
                             if f.is_file())
            launcher.start(_order("B", "print('hello from B')"), {})
            b = wait_until("B", lambda: _ended(launcher, "B"), timeout=120)
            free = os.statvfs(disk)
            result = {
                "flood_mib": mib, "flood_exit": a.exit_code,
                "flood_seconds_incl_torchrun_start": round(took, 2),
                "output_bytes_written": a.output_bytes(),
                "output_bytes_on_disk": a.output.on_disk(),
                "torchrun_files_bytes": work_bytes,
                "fs_free_mib_after": round(free.f_bavail * free.f_frsize / 2**20, 2),
                "second_launch_exit": b.exit_code,
                "second_launch_output": b.output.read_bytes().decode(errors="replace"),
            }
            if a.output.on_disk() > 2 * 1024 * 1024 or b.exit_code != 0 or a.exit_code != 0:
                failures.append(f"flood: {result}")
            return result
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--flood-mib", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    failures: list[str] = []
    try:
        tenants: dict[str, Any] = tenancy(failures)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the sandbox's skip (a user cannot run this Python)
        tenants = {"skipped": str(exc)}
    report = {"tenancy": tenants,
              "agent_death": agent_death(args.trials, failures),
              "flood": flood(args.flood_mib, failures)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print("TENANCY OK" if not failures else "TENANCY FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
