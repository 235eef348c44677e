"""A launch never outlives its agent: kill -9 the agent and every process of its
launches ends (the runner hears it from the kernel, PR_SET_PDEATHSIG; SIGTERM, then
SIGKILL to ranks that ignore it, including one that left its parent and session); the
next agent on that state dir reports how it ended. torchrun is played by a stand-in
that starts the launcher's rank command as rank 0 in its own session, as torchrun
does; the agent is a process that holds a real Launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hetpilot.agents.cgroups import _inside, parse_mountinfo, parse_proc_cgroup
from hetpilot.agents.launcher import Launcher
from hetpilot.agents.procs import descendants, proc_stat
from hetpilot.v1 import job_pb2, job_pb2_grpc

from .conftest import CLUSTER_TOKEN, OWNER_MD, start_daemon
from .helpers import submit_request, wait_until

pytestmark = pytest.mark.timeout(90)

# a rank that ignores SIGTERM and leaves a process of its own behind, orphaned, in a
# session of its own (it ignores SIGTERM too)
STUBBORN_RANK = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sleeper = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "time.sleep(300)")
mid = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                      f"[sys.executable, '-c', {sleeper!r}], start_new_session=True, "
                      "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                     capture_output=True, text=True)
open("rank-pids", "w").write(f"{os.getpid()} {mid.stdout.strip()}")
print("ready", flush=True)
time.sleep(300)
"""
STAND_IN = """
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a torchrun slow to stop
child = subprocess.Popen(sys.argv[1:], env=dict(os.environ, RANK="0"), start_new_session=True)
open("pids", "w").write(f"{os.getpid()} {child.pid}")
sys.exit(child.wait())
"""
AGENT = """
import json, sys, time
from hetpilot.agents.launcher import Launcher
from hetpilot.v1 import agent_pb2
STAND_IN, RANK, state, work = sys.argv[1:5]

class StandIn(Launcher):
    def torchrun(self, order, w):
        return [sys.executable, "-c", STAND_IN, *self.rank_command(order, w)]

launcher = StandIn(state, host="h", daemon="d:1", run_as="agent", stop_grace_s=2.0)
order = agent_pb2.LaunchOrder(launch_id="L1", job_id="j1", nnodes=1, devices=["0"],
                              rdzv_endpoint="127.0.0.1:1", workdir=work,
                              command=[sys.executable, "-c", RANK])
launcher.start(order, {})
print(json.dumps({"runner": launcher.get("L1").pid}), flush=True)
while True:
    launcher.poll()
    time.sleep(0.2)
"""


def _launch_cgroups(pid: int) -> list[Path]:
    """The cgroup directories the agent made for the launch whose runner is ``pid``
    (its ``hetpilot-*/<launch>`` cgroups; none where the agent had no hierarchy)."""
    own = parse_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
    found = set()
    for mount in parse_mountinfo(Path("/proc/self/mountinfo").read_text()):
        names = [""] if mount.version == 2 else [n for n in own if n and n in mount.options]
        for name in names:
            path = own.get(name, "")
            directory = _inside(mount, path) if "/hetpilot-" in path else None
            if directory is not None:
                found.add(directory)
    return sorted(found)


def test_no_process_of_a_launch_outlives_its_agent(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    state = tmp_path / "agent"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, STAND_IN, STUBBORN_RANK, str(state),
                              str(work)], stdout=subprocess.PIPE, text=True)
    try:
        runner = json.loads(agent.stdout.readline())["runner"]  # type: ignore[union-attr]
        torchrun, wrapper = map(int, wait_until("the ranks", lambda: (work / "pids").exists()
                                                and (work / "pids").read_text()).split())
        rank, orphan = map(int, wait_until("the rank's own process", lambda: (
            work / "rank-pids").exists() and (work / "rank-pids").read_text()).split())
        pids = {"runner": runner, "torchrun": torchrun, "rankio": wrapper, "rank": rank,
                "orphan": orphan}
        assert all(proc_stat(p) is not None for p in pids.values()), pids
        assert proc_stat(orphan)[0] == runner  # type: ignore[index]  # the runner adopted it
        groups = _launch_cgroups(runner)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        # SIGTERM at once, SIGKILL 2 s later (the agent's stop grace): all gone
        wait_until("every process of the launch to end", lambda: not [
            name for name, pid in pids.items() if proc_stat(pid) is not None], timeout=30)
        # and the launch's cgroups (where the agent made them) with it, before any agent returns
        assert not [g for g in groups if g.exists()], groups
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    # the next agent on the state dir reads how it ended, and why
    again = Launcher(state, host="h", daemon="d:1", run_as="agent")
    ended = again.get("L1")
    assert ended is not None and not ended.running and ended.exit_code != 0
    assert "the agent that started it ended" in ended.reason, ended.reason
    assert b"[rank0]:ready\n" in ended.output.read_bytes()


def test_a_killed_agents_launch_ends_and_its_job_fails_saying_why(tmp_path: Path) -> None:
    """With a real daemon, agent and torchrun: kill -9 the agent, every process of its
    launch ends; the agent started again reports how, and the daemon fails the job
    naming the host and the reason (before, the rank ran on until an agent came back,
    and the job stayed RUNNING)."""
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0, rdzv_port_min=29871,
                     rdzv_port_max=29890)
    token = tmp_path / "cluster.token"
    token.write_text(CLUSTER_TOKEN + "\n")
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPILOT_")}
    argv = [sys.executable, "-m", "hetpilot", "agent", "--daemon", d.address, "--host", "hosta",
            "--probe-listen", "127.0.0.1:0", "--token-file", str(token), "--state-dir",
            str(tmp_path / "agent"), "--emulate", "tflops=2,memory_gb=8,count=1",
            "--run-as", "agent"]
    agents = []
    try:
        agents.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, env=env))
        jobs = job_pb2_grpc.JobServiceStub(d.channel())
        entry = job_pb2.JobEntry(command=[sys.executable, "-c", "import time; print('up', "
                                          "flush=True); time.sleep(300)"],
                                 ranks_per_host=1, hosts=1)
        job_id = jobs.SubmitJob(submit_request(entry=entry), metadata=OWNER_MD,
                                timeout=10).job_id

        def job() -> job_pb2.JobInfo:
            return jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD,
                               timeout=10)

        runner = wait_until("the launch to run", lambda: [
            p.pid for p in job().launch if p.state == job_pb2.HOST_LAUNCH_STATE_RUNNING
            and p.pid], timeout=60)[0]
        ticks = (proc_stat(runner) or (0, 0))[1]

        def rank_up() -> dict[int, int]:  # runner, torchrun, rankio and the rank
            tree = descendants({runner: ticks})
            return len(tree) >= 3 and {runner: ticks, **tree}  # type: ignore[return-value]

        launch = wait_until("the rank to start", rank_up, timeout=60)
        agents[0].send_signal(signal.SIGKILL)
        agents[0].wait(timeout=10)
        wait_until("every process of the launch to end", lambda: not [
            p for p, t in launch.items() if (proc_stat(p) or (0, -1))[1] == t], timeout=30)
        agents.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, env=env))
        info = wait_until("the job to end", lambda: (j := job()).state not in (
            job_pb2.JOB_STATE_PENDING, job_pb2.JOB_STATE_RUNNING) and j, timeout=60)
        assert info.state == job_pb2.JOB_STATE_FAILED
        assert info.reason.startswith("host hosta: ") and \
            "stopped: the agent that started it ended" in info.reason, info.reason
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
                agent.wait(timeout=30)
        d.stop()
