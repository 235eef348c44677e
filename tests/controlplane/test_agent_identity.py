"""Which agent speaks for a host: each Register gives a registration that the host's
reports and heartbeats must carry, a second agent under a connected host's name is
refused, a second agent process on one state directory does not start, and one on
another state directory (another host secret) is refused until the name is forgotten."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hetpilot.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2, cluster_pb2_grpc

from .conftest import CLUSTER_MD, CLUSTER_TOKEN, RunningDaemon, start_daemon
from .helpers import register_request, report, wait_until

pytestmark = pytest.mark.timeout(120)
T = 10.0


def _refused(call: object, *args: object) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, metadata=CLUSTER_MD, timeout=T)  # type: ignore[operator]
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
    return err.value.details() or ""


def _report_once(agents: agent_pb2_grpc.AgentServiceStub, registration: str) -> None:
    list(agents.Report(iter([report("h", 1, registration=registration)]), metadata=CLUSTER_MD,
                       timeout=T))


def test_reports_and_heartbeats_carry_the_latest_registration(daemon: RunningDaemon) -> None:
    agents = agent_pb2_grpc.AgentServiceStub(daemon.channel())
    first = agents.Register(register_request("h", 1), metadata=CLUSTER_MD,
                            timeout=T).registration
    assert first
    _report_once(agents, first)
    assert "carries no registration" in _refused(
        lambda r, **kw: list(agents.Report(iter([r]), **kw)), report("h", 2))
    # registered again (an agent restarted on this machine): the old registration is done
    second = agents.Register(register_request("h", 1), metadata=CLUSTER_MD,
                             timeout=T).registration
    assert second and second != first
    assert "older registration" in _refused(
        lambda r, **kw: list(agents.Report(iter([r]), **kw)),
        report("h", 3, registration=first))
    assert "older registration" in _refused(
        agents.Heartbeat, agent_pb2.HeartbeatRequest(agent_id="h", registration=first))
    _report_once(agents, second)
    agents.Heartbeat(agent_pb2.HeartbeatRequest(agent_id="h", registration=second),
                     metadata=CLUSTER_MD, timeout=T)


def test_a_second_agent_under_a_connected_hosts_name_is_refused(daemon: RunningDaemon) -> None:
    agents = agent_pb2_grpc.AgentServiceStub(daemon.channel())
    first = agents.Register(register_request("h", 1, probe="10.0.0.1:7071"),
                            metadata=CLUSTER_MD, timeout=T).registration
    done, acks = threading.Event(), queue.Queue[int]()

    def reports() -> Iterator[agent_pb2.AgentReport]:
        seq = 0
        while not done.is_set():  # an agent's stream: a report every 0.1 s
            seq += 1
            yield report("h", seq, registration=first)
            done.wait(0.1)

    def stream() -> None:
        for ack in agents.Report(reports(), metadata=CLUSTER_MD, timeout=60):
            acks.put(ack.seq)

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    try:
        acks.get(timeout=T)
        # another process on the same machine (its probe port differs), same --host
        details = _refused(agents.Register, register_request("h", 1, probe="10.0.0.1:7999"))
        assert "has a connected agent" in details and "'h'" in details
        # the connected agent itself may register again (its registration says so)
        again = register_request("h", 1, probe="10.0.0.1:7071")
        again.registration = first
        newer = agents.Register(again, metadata=CLUSTER_MD, timeout=T).registration
        assert newer != first
    finally:
        done.set()
        thread.join(timeout=T)
    # its stream closed: a restarted agent is taken at once
    agents.Register(register_request("h", 1, probe="10.0.0.1:7999"), metadata=CLUSTER_MD,
                    timeout=T)


def _agent(tmp_path: Path, address: str, state: Path, log: Path) -> subprocess.Popen[bytes]:
    token = tmp_path / "cluster.token"
    token.write_text(CLUSTER_TOKEN + "\n")
    return subprocess.Popen(
        [sys.executable, "-m", "hetpilot", "agent", "--daemon", address, "--host", "h",
         "--token-file", str(token), "--probe-listen", "127.0.0.1:0", "--state-dir",
         str(state), "--emulate", "tflops=20,memory_gb=16", "--link-probe-interval", "600"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"))


@pytest.mark.slow
def test_two_agent_processes_on_one_host_name(tmp_path: Path) -> None:
    """Real agents: one state dir holds one agent; another state dir under the same
    --host (another host secret) is refused by the daemon until an operator forgets
    the name, even once the first agent is gone."""
    d = start_daemon(tmp_path / "daemon", heartbeat_timeout_s=2.0)
    procs = []
    try:
        logs = [tmp_path / f"agent{i}.log" for i in range(3)]
        first = _agent(tmp_path, d.address, tmp_path / "s1", logs[0])
        procs.append(first)
        wait_until("the first agent to register", lambda: b"registered with" in logs[0]
                   .read_bytes(), timeout=60)
        same_dir = _agent(tmp_path, d.address, tmp_path / "s1", logs[1])
        procs.append(same_dir)
        assert same_dir.wait(timeout=60) == 2
        err = logs[1].read_text()
        assert f"state dir {tmp_path / 's1'}" in err and f"pid {first.pid}" in err, err
        # the agent made its host secret, kept for its user only
        secret = tmp_path / "s1" / "host.secret"
        assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text()) > 32
        # another state dir holds another secret: refused, while the first is up and
        # after it is gone (the name stays bound), until an operator forgets the name
        other_dir = _agent(tmp_path, d.address, tmp_path / "s2", logs[2])
        procs.append(other_dir)
        wait_until("the second agent to be refused", lambda: b"PERMISSION_DENIED" in logs[2]
                   .read_bytes() and b"nodes forget h" in logs[2].read_bytes(), timeout=60)
        first.terminate()
        assert first.wait(timeout=30) == 0
        refusals = logs[2].read_bytes().count(b"PERMISSION_DENIED")
        wait_until("a refusal after the first agent is gone", lambda: logs[2].read_bytes()
                   .count(b"PERMISSION_DENIED") > refusals, timeout=60)
        assert b"registered with" not in logs[2].read_bytes()
        cluster_pb2_grpc.ClusterServiceStub(d.channel()).ForgetHost(
            cluster_pb2.ForgetHostRequest(host="h"), metadata=CLUSTER_MD, timeout=T)
        wait_until("the second agent to register once the name is forgotten",
                   lambda: b"registered with" in logs[2].read_bytes(), timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        d.stop()
