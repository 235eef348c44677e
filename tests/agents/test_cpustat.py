"""CPU load statistics of an agent on real processes (the host is shared and
noisy, so each check compares two readings of the same window)."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest
from hetpilot.agents.config import AgentConfig, ConfigError
from hetpilot.agents.cpustat import CpuMeter, CpuStats

# busy for 1 s of its own CPU (however busy the host), then idle but alive until told
# (a live job process, as a trainer rank)
SPIN = ("import sys, time\nwhile time.process_time() < 1.0: pass\n"
        "print('done', flush=True)\nsys.stdin.read()")


def _own_cpu_s() -> float:
    """CPU seconds of this process, every thread (a test worker may keep threads of
    earlier tests, e.g. gRPC's, which the meter counts as the reader's own)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spin_child(marker: str, meter: CpuMeter) -> tuple[float, float, CpuStats]:
    """Run a child whose command line carries ``marker`` busy for 1 s; read
    ``meter`` once it is done but still alive. Returns the child's CPU
    seconds, the window's wall seconds and the reading."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    meter.read()
    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", SPIN, marker], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "done"
    stats = meter.read()
    wall = time.monotonic() - t0
    child.communicate("")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu, wall, stats


def _cpus() -> int:
    import os

    return os.cpu_count() or 1


def test_a_foreign_busy_process_is_colocated_load() -> None:
    own = _own_cpu_s()
    _, wall, stats = _spin_child("some-other-job", CpuMeter(job_pattern="hetpilot-test-job-xyz"))
    own_share = (_own_cpu_s() - own) / (wall * _cpus())
    # all of the child's work is someone else's: only the reader's own time is taken out
    # (an absolute 0.1 failed once when both cores were busy: 1.0 against 0.899)
    assert stats.utilization - stats.colocated_load < own_share + 0.1
    assert stats.colocated_load > 0.2 / _cpus()


def test_the_jobs_own_processes_are_not_colocated_load() -> None:
    child_cpu, wall, stats = _spin_child("hetpilot-test-job-xyz",
                                         CpuMeter(job_pattern="hetpilot-test-job-xyz"))
    child_share = child_cpu / (wall * _cpus())
    assert child_cpu > 0.9  # it did run (its CPU, not its share: a loaded host stretches wall)
    # what was taken out is the child's own share of the host, within noise
    assert stats.utilization - stats.colocated_load == pytest.approx(child_share, abs=0.1)


def test_job_pattern_must_be_a_regex() -> None:
    with pytest.raises(ConfigError, match="job_pattern"):
        AgentConfig(job_pattern="(unclosed")
