"""A launch ends with its host (issue 37.3), with real processes: a daemon, two
agents, two one-host jobs whose entry point sleeps (under the agent's runner and
torchrun). The agent running them is killed with SIGKILL; one job is cancelled
while its host is down, the other is left alone. The cancelled one says it waits
for the host (`hetpilot jobs`), the other fails naming the host after the
heartbeat timeout; once an agent starts again on that state dir, the stop orders
kept for the host reach it and the processes of both launches are gone."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from hetpilot.v1 import job_pb2

from .helpers import wait_until
from .test_launch import Launching, _alive, _tree, launching  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SLEEPER = """
name = "{name}"
profile_on_attach = true
global_batch = 16
microbatch_size = 4

[entry]
command = ["sleep", "600"]
ranks_per_host = 1
hosts = 1
"""


def _submit(c: Launching, name: str) -> str:
    path = c.tmp / f"{name}.toml"
    path.write_text(SLEEPER.format(name=name))
    out = c.cli("submit", str(path))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _warning(info: job_pb2.JobInfo, head: str) -> str:
    return next((w for w in info.warnings if w.startswith(head)), "")


def test_a_killed_agent_ends_its_launches_and_a_cancel_waits_for_it(
        launching: Launching) -> None:  # noqa: F811 - the fixture
    c = launching
    c.start()
    # both agents up before the jobs come, so both launch on the first host by name
    wait_until("both agents up", lambda: len([n for n in c.json("nodes").get("nodes", [])
                                              if n["state"] == "up"]) == 2, timeout=60)
    cancelled, left = _submit(c, "cancelled"), _submit(c, "left")

    def running(job_id: str) -> Any:
        parts = [p for p in c.info(job_id).launch if p.state == job_pb2.HOST_LAUNCH_STATE_RUNNING]
        tree = _tree(parts[0].pid) if parts else {}
        return len(tree) >= 3 and (parts[0].host, tree)  # runner, torchrun, sleep

    (host, tree1), (host2, tree2) = (wait_until(f"job {j}'s ranks", lambda j=j: running(j),
                                                timeout=90, period=0.2)
                                     for j in (cancelled, left))
    assert host == host2 == "hosta"  # the first launching host by name
    procs = {**tree1, **tree2}
    c.procs[f"agent-{host}"].send_signal(signal.SIGKILL)
    c.procs[f"agent-{host}"].wait(timeout=10)
    assert c.cli("cancel", cancelled).returncode == 0

    info = wait_until("the cancel to wait for the host", lambda: _warning(
        j := c.info(cancelled), f"cancelling: waiting for host {host} (down") and j, timeout=30)
    assert info.state == job_pb2.JOB_STATE_CANCELLED
    info = wait_until("the job left alone to fail", lambda: (
        j := c.info(left)).state in (job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED,
                                     job_pb2.JOB_STATE_SUCCEEDED) and j, timeout=30)
    assert info.state == job_pb2.JOB_STATE_FAILED
    assert info.reason.startswith(f"host {host} lost: its agent was silent"), info.reason
    listing = c.cli("jobs", "--all")
    assert listing.returncode == 0, listing.stderr
    assert f"cancelling: waiting for host {host}" in listing.stdout, listing.stdout
    assert f"failed, stopping: waiting for host {host}" in listing.stdout, listing.stdout

    # an agent starts again on the host's state dir: both stops are carried out
    c.spawn(f"agent-{host}", "agent", "--host", host, "--probe-listen", "127.0.0.1:0",
            "--token-file", str(c.tmp / "cluster.token"), "--state-dir",
            str(c.tmp / f"agent-{host}"), "--stop-grace", "5", "--run-as", "agent",
            "--emulate", "tflops=2,memory_gb=8,price_per_hour=1,count=1")
    wait_until("the launches' processes to go", lambda: not _alive(procs), timeout=60)
    def exited(job_id: str) -> Any:
        info = c.info(job_id)
        return all(p.state == job_pb2.HOST_LAUNCH_STATE_EXITED for p in info.launch) and info

    for job_id, state in ((cancelled, job_pb2.JOB_STATE_CANCELLED),
                          (left, job_pb2.JOB_STATE_FAILED)):
        info = wait_until(f"job {job_id}'s part to exit", lambda j=job_id: exited(j), timeout=30)
        assert info.state == state and not _warning(info, "cancelling:") \
            and not _warning(info, "stopping:"), info
    assert Path(c.tmp / f"agent-{host}" / "host.secret").exists()
