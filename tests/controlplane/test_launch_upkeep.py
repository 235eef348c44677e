"""Keeping launches tidy and robust (issue 16, the rest):

* retention: the agent removes a launch's directory only once it has ended and
  the daemon acknowledged its exit and all of its output, after its grace
  period, and never adopts or starts it again; the daemon removes an ended
  job's output after ``log_retention_hours``, never a running job's;
* output kept exactly once across a daemon restart (the files are the record),
  ``hetpilot logs --follow`` going on through a daemon restart without printing
  a line twice, and giving up (exit 5) on a daemon that does not come back;
* the rendezvous port checked by the agent of the host that serves it: a port
  held busy there moves the launch to another port.

Real parts throughout: daemons on the test's ports with SQLite state dirs, the
CLI and an agent with torchrun as subprocesses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from hetpilot.agents.launchcmd import port_in_use
from hetpilot.agents.launchstate import TOMBSTONES
from hetpilot.daemon.joblogs import DROPPED, HostReader, JobLogs, read_index
from hetpilot.v1 import agent_pb2, job_pb2

from .conftest import CLUSTER_TOKEN, OWNER_MD, OWNER_TOKEN, RunningDaemon, start_daemon
from .helpers import submit_request, wait_until
from .test_launch_orders import Agents, _entry, _exited, _running
from .test_launcher import FakeTorchrun, _order, _pids

pytestmark = pytest.mark.timeout(90)
T = 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the agent: launch directories -----------------------------------------------------


def test_a_launch_directory_goes_only_once_done_and_never_comes_back(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    launcher = FakeTorchrun(tmp_path / "agent", host="h", daemon="d:1", run_as="agent",
                            stop_grace_s=1.0, retention_s=0.3)
    order = _order(workdir=str(work))
    assert launcher.start(order, {})
    state = launcher.get("L1")
    assert state is not None
    _pids(work)
    assert launcher.clean(force=True) == [] and state.dir.is_dir()  # running
    launcher.stop("L1")
    wait_until("the launch to end", lambda: (launcher.poll(), not state.running)[1])
    assert launcher.clean(force=True) == [] and state.dir.is_dir()  # ended, not acknowledged
    output = state.output.read_bytes()
    launcher.acked([("L1", False)], [("L1", 0, output[:-1])])  # not all of its output yet
    assert not state.done and launcher.clean(force=True) == []
    launcher.acked([("L1", False)], [("L1", len(output) - 1, output[-1:])])
    assert state.done and launcher.clean(force=True) == []  # within its grace period
    time.sleep(0.35)
    assert launcher.clean(force=True) == ["L1"]
    assert not state.dir.exists() and "L1" not in launcher
    assert (launcher.root / TOMBSTONES).read_text().split() == ["L1"]
    # a restarted agent neither adopts nor starts it again
    again = FakeTorchrun(tmp_path / "agent", host="h", daemon="d:1", run_as="agent",
                         retention_s=0.3)
    assert again.get("L1") is None and again.statuses() == []
    assert not again.start(order, {}) and not state.dir.exists()
    # a removal cut short by a restart (recorded, not renamed; renamed, not deleted) ends
    (again.root / "L2").mkdir()
    (again.root / "L2" / "launch.json").write_text('{"launch_id": "L2", "job_id": "j"}')
    (again.root / ".trash-L3").mkdir()
    with open(again.root / TOMBSTONES, "a") as fh:
        fh.write("L2\n")
    third = FakeTorchrun(tmp_path / "agent", host="h", daemon="d:1", run_as="agent")
    assert sorted(p.name for p in third.root.iterdir()) == [TOMBSTONES]
    assert third.statuses() == [] and not third.start(_order("L2"), {})
    launcher.poll()


def test_the_store_host_refuses_a_busy_rendezvous_port_without_using_the_id(
        tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    launcher = FakeTorchrun(tmp_path / "agent", host="h", daemon="d:1", run_as="agent")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        assert port_in_use(busy)
        order = _order(workdir=str(work), rdzv_host=True, rdzv_endpoint=f"h:{busy}")
        assert not launcher.start(order, {}) and not launcher.start(order, {})
        [(launch_id, job_id, port, why)] = launcher.refusals()
        assert (launch_id, job_id, port) == ("L1", "job1", busy) and "in use on h" in why
        assert "L1" not in launcher and not (launcher.root / "L1").exists()
        # a host that does not serve the store does not check (nor refuse)
        assert launcher.start(_order("L9", workdir=str(work / "..")), {})
    launcher.acked([], [], [("L1", busy)])  # the daemon has it
    assert launcher.refusals() == []
    free = _free_port()
    assert launcher.start(_order(workdir=str(work), rdzv_host=True,
                                 rdzv_endpoint=f"h:{free}"), {})
    assert launcher.refusals() == [] and launcher.get("L1") is not None
    for launch_id in ("L1", "L9"):
        launcher.stop(launch_id)
    wait_until("the launches to end", lambda: (launcher.poll(), not launcher.running())[1])


# -- the daemon: output kept once, by the files ----------------------------------------


def test_output_is_kept_once_across_restarts_and_rotations(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    logs = JobLogs(root, 64 * 1024)  # rotates at 32 KiB
    logs.append("j", "a", "L", 0, b"one\n")
    again = JobLogs(root, 64 * 1024)  # a restarted daemon: nothing in memory
    again.append("j", "a", "L", 0, b"one\n")  # resent after a lost ack
    again.append("j", "a", "L", 2, b"e\ntwo\n")  # overlapping
    path = again.path("j", "a")
    assert path.read_bytes() == b"one\ntwo\n" and again.received("j", "a") == 8
    line = b"x" * 1023 + b"\n"
    for i in range(40):  # 40 KiB: one rotation
        again.append("j", "a", "L", 8 + i * 1024, line)
    total = 8 + 40 * 1024
    index = read_index(path)
    assert index is not None and index.rotated_base == 0 and index.base > 0
    assert path.with_name("a.log.1").stat().st_size + path.stat().st_size == total
    # killed between the rotation and the index update: the inodes tell
    os.replace(path, path.with_name("a.log.1"))
    third = JobLogs(root, 64 * 1024)
    assert third.received("j", "a") == total
    third.append("j", "a", "L", total - 1024, line)  # resent: nothing
    third.append("j", "a", "L", total, b"end\n")
    reader = HostReader(path)  # from the oldest kept (what .log.1 holds), in order
    got = b"".join(iter(reader.read, b""))
    assert got == line * ((len(got) - 4) // 1024) + b"end\n" and len(got) > 4 * 1024
    assert reader.offset == total + 4
    # resumed from an offset: from there on, whichever file holds it
    reader = HostReader(path, total - 1024)
    assert b"".join(iter(reader.read, b"")) == line + b"end\n"
    assert HostReader(path, 5).read().startswith(DROPPED)  # no longer kept


# -- the daemon restarts under a follower ---------------------------------------------


def _daemon(state: Path, port: int, **kw: object) -> RunningDaemon:
    args: dict[str, object] = dict(heartbeat_timeout_s=600.0, rdzv_port_min=29851,
                                   rdzv_port_max=29899)
    args.update(kw)
    return start_daemon(state, listen=f"127.0.0.1:{port}", **args)


def _cli(tmp: Path, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    env = {**os.environ, "HETPILOT_TOKEN": OWNER_TOKEN}
    env.pop("HETPILOT_ADDRESS", None)
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "hetpilot", *args], stdout=o, stderr=e,
                                env=env)
    return proc, out, err


@pytest.mark.slow
def test_logs_follow_goes_on_through_a_daemon_restart(tmp_path: Path) -> None:
    state, port = tmp_path / "state", _free_port()
    d = _daemon(state, port)
    address = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        a = Agents(d)
        a.register("a")
        job = a.jobs.SubmitJob(submit_request(entry=_entry(hosts=1)), metadata=OWNER_MD,
                               timeout=T)
        job_id, launch_id = job.job_id, job.launch_id
        first = b"[rank0]:one\n[rank0]:tw"

        def chunk(offset: int, data: bytes) -> agent_pb2.LogChunk:
            return agent_pb2.LogChunk(launch_id=launch_id, offset=offset, data=data)

        a.report("a", _running(launch_id, job_id), logs=(chunk(0, first),))
        follow, out, err = _cli(tmp_path, "follow", "logs", job_id, "--follow",
                                "--daemon", address)
        procs.append(follow)
        wait_until("the first line", lambda: out.read_bytes() == b"[rank0]:one\n")
        d.stop()  # the daemon goes; its follower is told to come back (UNAVAILABLE)
        wait_until("the follower to notice", lambda: b"lost the daemon" in err.read_bytes())
        # the same state dir and port (heartbeat timeout: the retention sweep's period)
        d = _daemon(state, port, log_retention_hours=0.001, heartbeat_timeout_s=2.0)
        a = Agents(d)
        a.register("a")  # reconnected, the agent registers again
        # the agent never got the ack of its last report: it sends that chunk again
        a.report("a", _running(launch_id, job_id), logs=(chunk(0, first),))
        rest = b"o\n[rank0]:three\n"
        a.report("a", _running(launch_id, job_id), logs=(chunk(len(first), rest),))
        kept = [m.data for m in a.jobs.StreamLogs(job_pb2.StreamLogsRequest(job_id=job_id),
                                                  metadata=OWNER_MD, timeout=T)]
        assert b"".join(kept) == first + rest  # the resent chunk kept once
        a.report("a", _exited(launch_id, job_id, 0, log_bytes=len(first + rest)))
        assert follow.wait(timeout=20) == 0, err.read_bytes()
        # each line once: the follower resumed after the last line it printed
        assert out.read_bytes() == b"[rank0]:one\n[rank0]:two\n[rank0]:three\n"
        assert b"reconnected" in err.read_bytes()

        # retention: the ended job's output goes, a running job's stays
        other = a.jobs.SubmitJob(submit_request(entry=_entry(hosts=1)), metadata=OWNER_MD,
                                 timeout=T)
        a.report("a", _running(other.launch_id, other.job_id),
                 logs=(agent_pb2.LogChunk(launch_id=other.launch_id, data=b"hi\n"),))
        logs = state / "logs"
        wait_until("the ended job's output to go", lambda: not (logs / job_id).exists(),
                   timeout=15)
        assert (logs / other.job_id / "a.log").read_bytes() == b"hi\n"
        with pytest.raises(grpc.RpcError) as exc:
            list(a.jobs.StreamLogs(job_pb2.StreamLogsRequest(job_id=job_id),
                                   metadata=OWNER_MD, timeout=T))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "output was removed" in exc.value.details()

        # a daemon that does not come back: the follower gives up, exit 5
        follow, out, err = _cli(tmp_path, "giveup", "logs", other.job_id, "--follow",
                                "--daemon", address, "--reconnect-for", "1")
        procs.append(follow)
        wait_until("its line", lambda: out.read_bytes() == b"hi\n")
        d.stop()
        assert follow.wait(timeout=20) == 5
        assert b"gave up" in err.read_bytes()
        bad = subprocess.run([sys.executable, "-m", "hetpilot", "logs", job_id, "--follow",
                              "--reconnect-for", "-1", "--daemon", address],
                             capture_output=True, text=True, timeout=30,
                             env={**os.environ, "HETPILOT_TOKEN": OWNER_TOKEN})
        assert bad.returncode == 2 and "--reconnect-for" in bad.stderr
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=10)
        if d._thread.is_alive():
            d.stop()


# -- a real agent: the rendezvous port held busy on its host --------------------------


@pytest.mark.slow
def test_a_busy_rendezvous_port_on_the_store_host_moves_the_launch(tmp_path: Path) -> None:
    """The test holds the daemon's first rendezvous port on this host (the store's host):
    the agent refuses it, the daemon moves the launch to the next port, torchrun runs
    there; then the agent removes the launch's directory (retention 0) and the daemon
    the job's output (retention 2 s)."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    busy = busy if busy <= 65535 - 8 else None
    if busy is None:
        held.close()
        pytest.skip("no port range above the held port")
    d = start_daemon(tmp_path / "state", rdzv_port_min=busy, rdzv_port_max=busy + 8,
                     heartbeat_timeout_s=5.0, log_retention_hours=0.0006)
    (tmp_path / "cluster.token").write_text(CLUSTER_TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPILOT_")}
    agent_log = tmp_path / "agent.log"
    with open(agent_log, "wb") as fh:
        agent = subprocess.Popen(
            [sys.executable, "-m", "hetpilot", "agent", "--daemon", d.address, "--host",
             "hosta", "--probe-listen", "127.0.0.1:0", "--token-file",
             str(tmp_path / "cluster.token"), "--state-dir", str(tmp_path / "agent"),
             "--emulate", "tflops=2,memory_gb=8,count=1", "--launch-retention", "0",
             "--run-as", "agent"],
            stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        a = Agents(d)
        entry = job_pb2.JobEntry(command=[sys.executable, "-c", "print('hello from rank')"],
                                 ranks_per_host=1, hosts=1)
        job_id = a.jobs.SubmitJob(submit_request(entry=entry), metadata=OWNER_MD,
                                  timeout=T).job_id

        def ended() -> Any:
            j = a.job(job_id)
            return j.state not in (job_pb2.JOB_STATE_PENDING, job_pb2.JOB_STATE_RUNNING) and j

        try:
            info = wait_until("the job to end", ended, timeout=60, period=0.2)
        except AssertionError:
            raise AssertionError(agent_log.read_text()[-3000:]) from None
        assert info.state == job_pb2.JOB_STATE_SUCCEEDED, (info.reason,
                                                           agent_log.read_text()[-3000:])
        port = int(info.rdzv_endpoint.rpartition(":")[2])
        assert busy < port <= busy + 8
        assert f"rendezvous port {busy} is in use on hosta" in agent_log.read_text()
        launch_dir = tmp_path / "agent" / "launches" / info.launch_id
        wait_until("the launch directory to go", lambda: not launch_dir.exists(), timeout=15)
        assert info.launch_id in (launch_dir.parent / TOMBSTONES).read_text().split()
        # the agent logs the removal after it: the directory can be gone first (CI, once)
        wait_until("the removal in the agent's log",
                   lambda: "directory removed" in agent_log.read_text(), timeout=15)
        logs = tmp_path / "state" / "logs" / job_id
        wait_until("the job's output to go", lambda: not logs.exists(), timeout=15)
    finally:
        held.close()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=15)
        d.stop()


@pytest.mark.slow
def test_watch_goes_on_through_a_daemon_restart(tmp_path: Path) -> None:
    """A stopping daemon ends WatchPlans with UNAVAILABLE, not as the job's end: ``hetpilot
    watch`` reconnects after the restart, resumes after the last version it printed, and
    ends when the job does."""
    state, port = tmp_path / "state", _free_port()
    d = _daemon(state, port)
    address = f"127.0.0.1:{port}"
    watch = None
    try:
        a = Agents(d)
        a.register("a", launches=False)
        job_id = a.jobs.SubmitJob(submit_request(), metadata=OWNER_MD, timeout=T).job_id
        wait_until("a plan", lambda: a.job(job_id).plan_version >= 1)
        watch, out, err = _cli(tmp_path, "watch", "watch", job_id, "--json", "--count", "0",
                               "--daemon", address)
        wait_until("the first version", lambda: b'"version": 1' in out.read_bytes())
        d.stop()
        time.sleep(3.0)  # before the fix it took the stop for the job's end: exit 0 here
        assert watch.poll() is None, err.read_bytes()  # waiting for the daemon, not done
        d = _daemon(state, port)
        a = Agents(d)
        a.jobs.CancelJob(job_pb2.CancelJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=T)
        assert watch.wait(timeout=30) == 0, err.read_bytes()
        versions = [line for line in out.read_text().splitlines() if '"version"' in line]
        assert len(versions) == len(set(versions))  # none printed twice
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
        d.stop()
