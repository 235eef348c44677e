"""Child processes of the demo: each in its own process group, all stopped on the way out.

``stop_all`` sends SIGTERM to every group, waits a bounded time, then SIGKILLs
what is left, so nothing outlives the demo, whether it ends, fails or is
interrupted (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any

__all__ = ["Procs"]


class Procs:
    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen[Any]]] = []
        self._logs: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str], *, env: dict[str, str] | None = None,
              stdout_pipe: bool = False) -> subprocess.Popen[Any]:
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop_all
        self._logs.append(log)
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if stdout_pipe else log,
                                stderr=log, start_new_session=True,
                                text=stdout_pipe or None)
        self.procs.append((name, proc))
        self._record()
        return proc

    def log(self, name: str) -> str:
        try:
            return (self.logdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def _record(self) -> None:
        """pids.json: every child's pid (= its process group), for checks after the fact."""
        tmp = self.logdir / "pids.json.tmp"
        tmp.write_text(json.dumps([{"name": n, "pid": p.pid} for n, p in self.procs]))
        os.replace(tmp, self.logdir / "pids.json")

    def stop(self, names: set[str], grace_s: float = 5.0) -> None:
        self._stop([(n, p) for n, p in self.procs if n in names], grace_s)

    def stop_all(self, grace_s: float = 5.0) -> None:
        self._stop(self.procs, grace_s)
        for log in self._logs:
            log.close()

    @staticmethod
    def _stop(procs: list[tuple[str, subprocess.Popen[Any]]], grace_s: float) -> None:
        for _, proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for _, proc in procs:
            if proc.poll() is None:  # leader not reaped yet: the group id is still ours
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
        # the leaders are gone; their helpers (the daemon's planning process and
        # multiprocessing's resource tracker, which ignores SIGTERM and ends when its
        # pipe closes) get the rest of the grace, then the group is killed
        for _, proc in procs:
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _group_alive(proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
