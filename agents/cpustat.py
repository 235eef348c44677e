"""A CPU host's load statistics, computed one way for agents and recordings.

The slowdown estimator (:mod:`hetpilot.adapt`) learns from rows recorded by
:mod:`hetpilot.adapt.collect` and is served, in the daemon, the statistics
CPU agents report. Both read them here, so the forest is served what it
learnt from:

- ``utilization``: busy share of all CPUs since the previous reading
  (``/proc/stat``);
- ``colocated_load``: the same with the job's own CPU time taken out, i.e.
  what other work on the host took (0..1);
- ``colocated_processes``: runnable processes that are not the job's
  (``/proc/loadavg``'s runnable count less the job's runnable processes).

"The job" is the reader itself plus, for an agent, every process whose
command line matches ``job_pattern`` (a trainer's ranks, by default anything
started as ``hetpilot ...``): a trainer's own work is not interference.
A process of the job that exits between two readings takes its CPU time
with it, so that window's co-located load reads a little high.

GPU hosts report NVML's utilisation instead (:mod:`.probes`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuMeter", "CpuStats", "cpu_ticks", "meminfo_gb", "memory_used", "runnable"]


def cpu_ticks() -> tuple[float, float]:
    """(total, busy) clock ticks of all CPUs since boot."""
    with open("/proc/stat") as fh:
        vals = [float(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)  # idle + iowait
    return sum(vals), sum(vals) - idle


def runnable() -> int:
    """Runnable processes on the host now, the reader included."""
    with open("/proc/loadavg") as fh:
        return int(fh.read().split()[3].split("/")[0])


def meminfo_gb() -> tuple[float, float]:
    """(total, available) GB from /proc/meminfo; zeros where it is missing."""
    values: dict[str, float] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                values[key] = float(rest.split()[0]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    return values.get("MemTotal", 0.0), values.get("MemAvailable", 0.0)


def memory_used() -> float:
    """Share of memory in use (1 - MemAvailable / MemTotal)."""
    info: dict[str, float] = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            info[key] = float(value.split()[0])
    return 1.0 - info.get("MemAvailable", 0.0) / max(info.get("MemTotal", 1.0), 1.0)


def _process(pid: int) -> tuple[float, bool] | None:
    """(utime + stime ticks, runnable now) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return float(fields[11]) + float(fields[12]), fields[0] == "R"


def _matching(pattern: re.Pattern[str]) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern.search(cmd):
            out.append(int(entry.name))
    return out


@dataclass(frozen=True)
class CpuStats:
    utilization: float
    colocated_load: float
    colocated_processes: int


class CpuMeter:
    """Load statistics over the window since the previous :meth:`read` (or
    since construction)."""

    def __init__(self, job_pattern: str | None = None) -> None:
        self._pattern = re.compile(job_pattern) if job_pattern else None
        self._total, self._busy = cpu_ticks()
        self._own = self._job()[0]

    def _job(self) -> tuple[dict[int, float], int]:
        """Per process CPU ticks of the job, and how many of it are runnable."""
        pids = {os.getpid()}
        if self._pattern is not None:
            pids.update(_matching(self._pattern))
        ticks, running = {}, 0
        for pid in pids:
            got = _process(pid)
            if got is not None:
                ticks[pid] = got[0]
                running += got[1] or pid == os.getpid()  # the reader runs while it reads
        return ticks, running

    def read(self) -> CpuStats:
        total, busy = cpu_ticks()
        own, running = self._job()
        # a process new since the last reading spent all its ticks in this window
        own_d = sum(t - self._own.get(pid, 0.0) for pid, t in own.items())
        total_d, busy_d = max(total - self._total, 1e-9), busy - self._busy
        self._total, self._busy, self._own = total, busy, own
        return CpuStats(
            utilization=min(1.0, max(0.0, busy_d / total_d)),
            colocated_load=min(1.0, max(0.0, (busy_d - own_d) / total_d)),
            colocated_processes=max(0, runnable() - running),
        )
