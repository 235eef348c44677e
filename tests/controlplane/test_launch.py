"""Launching (issue 16): a daemon and two agents (EMULATED devices, both on this
machine) as real subprocesses; ``hetpilot submit`` with an ``[entry]`` makes the
agents start a 2-rank gloo trainer under torchrun (one rank per agent, c10d
rendezvous at the port the daemon picked), ``nodes``, ``jobs``, ``logs --follow``
and ``watch`` show it, the job ends SUCCEEDED by itself; a second job is
cancelled while it trains and its processes (runner, torchrun, ranks) are gone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hetpilot.agents.launcher import _proc_stat, descendants
from hetpilot.v1 import job_pb2, job_pb2_grpc

from hetpilot.channel import Endpoint, open_sync

from .conftest import CLUSTER_TOKEN, OWNER_MD, OWNER_TOKEN, wait_endpoints
from .helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

JOB = """
name = "{name}"
profile_on_attach = true      # hetpilot train sends the model's profile on Attach
global_batch = 16
microbatch_size = 4
slot_s = 0.5

[entry]
module = "hetpilot"
args = ["train", "--model", "hetpilot.trainer.examples:mlp", "--epochs", "{epochs}",
        "--log-format", "json"]
ranks_per_host = 1
hosts = 2

[entry.env]
GLOO_SOCKET_IFNAME = "lo"
OMP_NUM_THREADS = "1"
"""


def _free_port_base(span: int = 20) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    return min(port, 65535 - span)


class Launching:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        base = _free_port_base()
        (tmp / "daemon.toml").write_text(f"""
[daemon]
metrics_listen = ""
slot_s = 0.5
report_interval_s = 0.2
heartbeat_timeout_s = 2.0
grace_s = 1.0
drain_s = 0.1
rdzv_port_min = {base}
rdzv_port_max = {base + 20}

[auth]
owner_tokens = {{ alice = "{OWNER_TOKEN}" }}
cluster_token = "{CLUSTER_TOKEN}"
""")
        (tmp / "cluster.token").write_text(CLUSTER_TOKEN + "\n")
        self.env = {**os.environ, "HETPILOT_TOKEN": OWNER_TOKEN, "PYTHONUNBUFFERED": "1",
                    "COLUMNS": "200"}
        for key in ("HETPILOT_JOB_ID", "HETPILOT_ADDRESS", "HETPILOT_TOKEN_FILE"):
            self.env.pop(key, None)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.jobs: job_pb2_grpc.JobServiceStub | None = None

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", "hetpilot", *args], env=self.env,
                                stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        proc = self.spawn("daemon", "daemon", "--listen", "127.0.0.1:0", "--state-dir",
                          str(self.state), "--config", str(self.tmp / "daemon.toml"))
        ends = wait_endpoints(self.state, timeout=30)
        assert ends["pid"] == proc.pid
        self.env["HETPILOT_ADDRESS"] = ends["grpc"]
        self.jobs = job_pb2_grpc.JobServiceStub(open_sync(Endpoint(address=ends["grpc"])))
        for host in ("hosta", "hostb"):
            self.spawn(f"agent-{host}", "agent", "--host", host, "--probe-listen",
                       "127.0.0.1:0", "--token-file", str(self.tmp / "cluster.token"),
                       "--state-dir", str(self.tmp / f"agent-{host}"), "--stop-grace", "5",
                       "--run-as", "agent",
                       "--emulate", "tflops=2,memory_gb=8,price_per_hour=1,count=1")

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hetpilot", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def json(self, *args: str) -> Any:
        out = self.cli(*args, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def info(self, job_id: str) -> job_pb2.JobInfo:
        """The job, asked in this process (waits poll with this: a CLI process per poll
        would take a core of the two the test has)."""
        assert self.jobs is not None
        return self.jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD,
                                timeout=10)

    def submit(self, name: str, epochs: int) -> str:
        path = self.tmp / f"{name}.toml"
        path.write_text(JOB.format(name=name, epochs=epochs))
        out = self.cli("submit", str(path))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def launching(tmp_path: Path) -> Iterator[Launching]:
    c = Launching(tmp_path)
    try:
        yield c
    finally:
        c.close()


def _tree(pid: int) -> dict[int, int]:
    """``pid`` and its live descendants (pid -> start ticks)."""
    st = _proc_stat(pid)
    if st is None:
        return {}
    return {pid: st[1], **descendants({pid: st[1]})}


def _alive(procs: dict[int, int]) -> list[int]:
    return [p for p, ticks in procs.items() if (_proc_stat(p) or (0, -1))[1] == ticks]


def _exited(c: Launching, job_id: str) -> Any:
    """The job once every host's part of its launch has exited."""
    j = c.info(job_id)
    return all(p.state == job_pb2.HOST_LAUNCH_STATE_EXITED for p in j.launch) and j


def test_submit_launches_two_ranks_logs_and_cancel(launching: Launching) -> None:
    c = launching
    started = time.monotonic()
    c.start()
    nodes = wait_until("both agents up", lambda: (n := c.json("nodes").get("nodes", [])) and len(
        [x for x in n if x["state"] == "up"]) == 2 and n, timeout=30)
    assert sorted(n["host"] for n in nodes) == ["hosta", "hostb"]

    # -- a job that trains 2 epochs and ends by itself ------------------------
    job_id = c.submit("mlp", epochs=2)
    follow = c.spawn("follow", "logs", job_id, "--follow")
    watch = c.spawn("watch", "watch", job_id, "--json")
    ended = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED)
    try:
        wait_until("the job to end", lambda: c.info(job_id).state in ended, timeout=90,
                   period=0.2)
    except AssertionError:
        raise AssertionError(f"daemon log:\n{c.log('daemon')[-4000:]}") from None
    job = c.json("job", job_id)
    assert job["state"] == "succeeded", (job["reason"], c.log("daemon")[-3000:])
    assert job["model_name"] == "mlp" and job["plan_version"] >= 1
    # planned on the launched ranks' devices only; both, or one where the link the job
    # measured between them makes a second replica slower than none (a small MLP)
    assert job["devices"] and set(job["devices"]) <= {"hosta:0", "hostb:0"}
    assert job["entry"]["module"] == "hetpilot" and job["rdzv_endpoint"].startswith("127.0.0.1:")
    parts = {p["host"]: p for p in job["launch"]}
    assert set(parts) == {"hosta", "hostb"} and parts["hosta"]["rdzv_host"]
    assert all(p["pid"] > 0 for p in parts.values())
    # the ranks exit after rank 0's FinishJob; both hosts then report exit 0
    info = wait_until("both hosts' exit", lambda: _exited(c, job_id), timeout=30)
    assert [p.exit_code for p in info.launch] == [0, 0]
    assert follow.wait(timeout=30) == 0  # --follow ends once the job and its output have
    followed = c.log("follow")
    records = [json.loads(line.split(":", 1)[1]) for line in followed.splitlines()
               if line.startswith("[rank0]:{")]
    # one record per epoch, and one more for each plan switch inside an epoch (the daemon
    # may re-plan once the ranks' measurements at the plan's microbatch size arrive)
    assert [r["epoch"] for r in records if r["closed_by"] == "epoch"] == [0, 1], \
        followed[-3000:]
    assert records[0]["device_id"] in ("hosta:0", "hostb:0")
    assert watch.wait(timeout=30) == 0  # the watch ends with the job
    plans = [json.loads(line) for line in c.log("watch").splitlines() if '"version"' in line]
    assert plans and plans[0]["version"] == 1
    listing = c.cli("jobs")
    assert listing.returncode == 0 and job_id in listing.stdout and "succeeded" in listing.stdout
    rank0 = c.cli("logs", job_id, "--rank", "0")
    assert rank0.returncode == 0 and rank0.stdout.count("[rank0]:{") == len(records)
    assert all(line.startswith("[rank0]:") for line in rank0.stdout.splitlines())
    assert "[rank0]" not in c.cli("logs", job_id, "--rank", "1").stdout
    # one copy of the output on each agent: no per-rank files beside it (torchrun --tee)
    agent_dir = c.tmp / "agent-hosta"
    assert list(agent_dir.glob("launches/*/output/*.log"))
    assert not list(agent_dir.glob("**/stdout.log")) and not list(agent_dir.glob("**/stderr.log"))
    first_done = time.monotonic() - started

    # -- a long job, cancelled once its ranks run: its processes are gone -----
    job_id = c.submit("long", epochs=100000)

    def ranks() -> Any:
        parts = [p for p in c.info(job_id).launch
                 if p.state == job_pb2.HOST_LAUNCH_STATE_RUNNING]
        trees = [_tree(p.pid) for p in parts]
        # runner, torchrun and the rank (hetpilot train) on each host
        return len(parts) == 2 and all(len(t) >= 3 for t in trees) and trees

    trees = wait_until("the long job's ranks", ranks, timeout=60, period=0.2)
    procs = {p: t for tree in trees for p, t in tree.items()}
    on_nodes = {n["host"]: n.get("jobs", []) for n in c.json("nodes")["nodes"]}
    assert on_nodes == {"hosta": [job_id], "hostb": [job_id]}, on_nodes
    assert c.cli("cancel", job_id).returncode == 0
    wait_until("the cancelled job's processes to go", lambda: not _alive(procs), timeout=20)
    info = wait_until("both hosts' exit", lambda: _exited(c, job_id), timeout=20)
    assert info.state == job_pb2.JOB_STATE_CANCELLED and all(p.stopped for p in info.launch)
    assert "stopping on the daemon's order" in c.log("agent-hosta")
    print(f"first job done after {first_done:.1f} s, all after "
          f"{time.monotonic() - started:.1f} s")
