"""Per-launch limits against a memory hog and a fork bomb, as root, with real torchrun
(issue 37: per-launch memory and process limits; docs/operating.md, "Limits").

  .venv/bin/python bench/launch_limits.py [--memory-max 1G] [--tasks-max 256] [--out l.json]

One agent's Launcher as root with ``[launch] memory_max`` and ``tasks_max``, two owners
(unix users made with useradd and removed after; without them both launch as the
agent's user, and the report says so). Owner A's launch prints a tick every 0.1 s.
Owner B then launches, one after the other:

  * a memory hog: allocates and touches 64 MiB blocks without end;
  * a fork bomb: every process forks without end (retrying when refused); the rank
    exits 3 after its first refused fork, its children go on.

For each of B's launches: its exit, the first line of its reason (which must name the
limit), how long it ran, how many processes of B were left anywhere on the machine
once it ended (must be 0) and whether its cgroup was removed; A's ticks before and
after (A must tick on), and the lowest ``MemAvailable`` of the machine seen meanwhile.
Last line ``LIMITS OK`` or ``LIMITS FAILED: <reasons>``; exit 0 or 1. Without root or
a usable cgroup hierarchy it says why and exits 1 (a campaign without it is not
clean).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "controlplane"))

from agent_tenancy import _ended, _order  # noqa: E402
from helpers import wait_until  # type: ignore[import-not-found]  # noqa: E402
from hetpilot.agents.cgroups import LaunchGroups, Limits  # noqa: E402
from hetpilot.agents.config import parse_size  # noqa: E402
from hetpilot.agents.launcher import Launcher  # noqa: E402
from hetpilot.agents.procs import process_table  # noqa: E402
from sandbox import (  # type: ignore[import-not-found]  # noqa: E402
    shared_dir,
    unix_users,
    why_no_users,
)

TICKER = """
import itertools, time
for i in itertools.count():
    print("tick", i, flush=True)
    time.sleep(0.1)
"""
HOG = """
blocks = []
while True:
    blocks.append(bytearray(64 << 20))
    for i in range(0, 64 << 20, 4096):
        blocks[-1][i] = 1
    print("held", len(blocks) * 64, "MiB", flush=True)
"""
BOMB = """
import os, sys, time
leader = os.getpid()
while True:
    try:
        os.fork()
    except OSError:
        if os.getpid() == leader:
            print("fork refused:", sys.exc_info()[1], flush=True)
            sys.exit(3)
        time.sleep(0.01)
"""


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _ticks(launcher: Launcher, launch_id: str) -> int:
    state = launcher.get(launch_id)
    assert state is not None
    return state.output.read_bytes().count(b"[rank0]:tick ")


def _uid_processes(uid: int) -> int:
    """Processes of ``uid`` alive on the machine."""
    live, _ = process_table()
    count = 0
    for pid in live:
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += 1
        except OSError:
            pass
    return count


@contextmanager
def _owners() -> Iterator[tuple[str, str, str]]:
    """(run_as, owner A's user, owner B's user): two users made for the run, or the
    agent's own user when they cannot be made."""
    if why_no_users():
        yield "agent", "", ""
        return
    with unix_users(2) as (alice, bob):
        yield "owner", alice, bob


def run(memory_max: int, tasks_max: int, failures: list[str]) -> dict[str, Any]:
    limits = Limits(memory_max=memory_max, tasks_max=tasks_max)
    with shared_dir() as base, _owners() as (run_as, alice, bob):
        groups = LaunchGroups(base / "agent", limits)
        why = groups.why_not()
        if why or os.geteuid() != 0:
            failures.append(f"skipped: {why or 'needs root'}")
            return {"skipped": why or "needs root"}
        launcher = Launcher(base / "agent", host="h", daemon="127.0.0.1:1", run_as=run_as,
                            stop_grace_s=3.0, cgroups=groups)
        report: dict[str, Any] = {"limits": str(limits), "run_as": run_as,
                                  "hierarchy": groups.hierarchy.describe()}
        launcher.start(_order("LA", TICKER, user=alice), {})
        wait_until("A's ticks", lambda: _ticks(launcher, "LA") >= 3, timeout=120)
        b_uid = pwd.getpwnam(bob).pw_uid if bob else -1
        for name, code in (("memory_hog", HOG), ("fork_bomb", BOMB)):
            launch_id = f"LB-{name}"
            ticks_before = _ticks(launcher, "LA")
            lowest = _mem_available()
            t0 = time.monotonic()
            launcher.start(_order(launch_id, code, user=bob), {})
            dirs = launcher.cgroups.dirs(launch_id)

            def ended(launch_id: str = launch_id) -> Any:
                nonlocal lowest
                lowest = min(lowest, _mem_available())
                return _ended(launcher, launch_id)

            state = wait_until(f"B's {name}", ended, timeout=300, period=0.05)
            seconds = time.monotonic() - t0
            gone = wait_until("its cgroup removed", lambda dirs=dirs: (  # type: ignore[misc]
                launcher.poll(), not any(d.exists() for d in dirs))[1], timeout=60)
            left = _uid_processes(b_uid) if bob else None
            wait_until("A to tick on", lambda n=ticks_before: _ticks(launcher, "LA") >= n + 5,
                       timeout=60)
            a = launcher.get("LA")
            first = state.reason.splitlines()[0] if state.reason else ""
            want = "memory_max" if name == "memory_hog" else "tasks_max"
            report[name] = {"exit": state.exit_code, "reason": first,
                            "seconds": round(seconds, 2), "cgroup_removed": bool(gone),
                            "b_processes_left": left,
                            "a_running": bool(a and a.running),
                            "a_ticks_before_after": [ticks_before, _ticks(launcher, "LA")],
                            "lowest_mem_available_mib": lowest >> 20}
            if state.exit_code == 0 or want not in first:
                failures.append(f"{name}: exit {state.exit_code}, reason {first!r}")
            if left:
                failures.append(f"{name}: {left} process(es) of B left")
            if not (a and a.running):
                failures.append(f"{name}: A's launch ended")
        launcher.stop("LA")
        wait_until("A's launch to end", lambda: _ended(launcher, "LA"), timeout=120)
        return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-max", default="1G")
    parser.add_argument("--tasks-max", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    failures: list[str] = []
    report = run(parse_size("--memory-max", args.memory_max), args.tasks_max, failures)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print("LIMITS OK" if not failures else "LIMITS FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
