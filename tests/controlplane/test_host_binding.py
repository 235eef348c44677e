"""Hosts bound to their credentials (issue 37.2), over the gRPC API: the cluster
token only bootstraps a host; the first Register of a name binds it to a secret
(the agent's, or one the daemon makes), the daemon keeps only its hash, across
restarts, and a later Register of the name needs that secret; only an operator
unbinds a name (ForgetHost, `hetpilot nodes forget`)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from hetpilot.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
)

from .conftest import CLUSTER_MD, CLUSTER_TOKEN, OWNER_MD, RunningDaemon, start_daemon
from .helpers import host_secret, register_request, report, submit_request

pytestmark = pytest.mark.timeout(120)
T = 10.0


def _code(call: object, request: object, md: object = CLUSTER_MD) -> tuple[grpc.StatusCode, str]:
    try:
        call(request, metadata=md, timeout=T)  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def _register(host: str, secret: str = "") -> agent_pb2.RegisterRequest:
    req = register_request(host, 1)
    req.host_secret = secret
    return req


def test_the_first_register_binds_the_name_and_later_ones_need_its_secret(
        daemon: RunningDaemon) -> None:
    agents = agent_pb2_grpc.AgentServiceStub(daemon.channel())
    # no secret sent: the daemon makes one and answers it, once
    made = agents.Register(_register("h"), metadata=CLUSTER_MD, timeout=T).host_secret
    assert len(made) >= 32
    code, why = _code(agents.Register, _register("h"))
    assert code == grpc.StatusCode.PERMISSION_DENIED, why
    assert "bound" in why and "carries none" in why and "hetpilot nodes forget h" in why
    code, why = _code(agents.Register, _register("h", "x" * 40))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "another secret" in why, why
    resp = agents.Register(_register("h", made), metadata=CLUSTER_MD, timeout=T)
    assert resp.registration and not resp.host_secret  # nothing new to keep
    # the agent's own secret: bound as sent, nothing answered
    assert not agents.Register(_register("g", host_secret("g")), metadata=CLUSTER_MD,
                               timeout=T).host_secret
    assert _code(agents.Register, _register("g", made))[0] == grpc.StatusCode.PERMISSION_DENIED
    # a malformed secret is the caller's error, named, and never echoed
    code, why = _code(agents.Register, _register("k", "short secret"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "host_secret" in why, why
    assert "short secret" not in why


def test_an_impostor_after_a_daemon_restart_gets_neither_the_name_nor_its_orders(
        tmp_path: Path) -> None:
    """Right after a restart every known host is up (its restart grace): an impostor
    with the cluster token registering a live host's name first is refused, the real
    agent then re-registers with its secret, and the host's launch orders go to it."""
    state = tmp_path / "state"
    d = start_daemon(state, rdzv_port_min=29831, rdzv_port_max=29840)
    secret = "real-agent-secret-0123456789abcdef"
    try:
        agents = agent_pb2_grpc.AgentServiceStub(d.channel())
        req = _register("h", secret)
        req.launches = True
        agents.Register(req, metadata=CLUSTER_MD, timeout=T)
    finally:
        d.stop()
    # the store keeps the binding as a hash only
    with sqlite3.connect(state / "state.db") as db:
        [(body,)] = db.execute("SELECT body FROM agents WHERE host='h'").fetchall()
    assert secret not in body
    assert json.loads(body)["secret_hash"] == hashlib.sha256(secret.encode()).hexdigest()

    d = start_daemon(state, rdzv_port_min=29831, rdzv_port_max=29840)
    try:
        ch = d.channel()
        agents = agent_pb2_grpc.AgentServiceStub(ch)
        impostor = register_request("h", 4, probe="10.9.9.9:7071")
        impostor.launches = True
        impostor.host_secret = ""
        code, why = _code(agents.Register, impostor)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, why)
        assert "the host is up" in why and "cluster token alone" in why
        impostor.host_secret = "guessed-secret-000000000000"
        assert _code(agents.Register, impostor)[0] == grpc.StatusCode.PERMISSION_DENIED
        # the impostor holds no registration: its reports are refused
        code, why = _code(lambda r, **kw: list(agents.Report(iter([r]), **kw)),
                          report("h", 1, 1))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, why)
        # the real agent comes back with its secret and gets the host's orders
        req = _register("h", secret)
        req.launches = True
        registration = agents.Register(req, metadata=CLUSTER_MD, timeout=T).registration
        entry = job_pb2.JobEntry(command=["sleep", "60"], ranks_per_host=1, hosts=1)
        info = job_pb2_grpc.JobServiceStub(ch).SubmitJob(submit_request(entry=entry),
                                                         metadata=OWNER_MD, timeout=T)
        assert [p.host for p in info.launch] == ["h"]
        [ack] = list(agents.Report(iter([report("h", 1, 1, registration=registration)]),
                                   metadata=CLUSTER_MD, timeout=T))
        [order] = ack.start
        assert order.trainer_token == info.trainer_token
    finally:
        d.stop()


def test_forgetting_a_host_is_an_operators_act_and_lets_the_next_agent_bind_it(
        daemon: RunningDaemon) -> None:
    ch = daemon.channel()
    agents = agent_pb2_grpc.AgentServiceStub(ch)
    cluster = cluster_pb2_grpc.ClusterServiceStub(ch)
    agents.Register(_register("h", "lost-state-dir-secret-0000"), metadata=CLUSTER_MD,
                    timeout=T)
    rebuilt = "rebuilt-host-secret-11111111"
    assert _code(agents.Register, _register("h", rebuilt))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    forget = cluster_pb2.ForgetHostRequest(host="h")
    code, why = _code(cluster.ForgetHost, forget, OWNER_MD)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "cluster token" in why, why
    assert _code(cluster.ForgetHost, cluster_pb2.ForgetHostRequest(host="nope"))[0] == \
        grpc.StatusCode.NOT_FOUND
    assert _code(cluster.ForgetHost, cluster_pb2.ForgetHostRequest())[0] == \
        grpc.StatusCode.INVALID_ARGUMENT
    # from the CLI, as an operator would
    token = Path(daemon.state_dir.parent / "cluster.token")
    token.write_text(CLUSTER_TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPILOT_")}
    out = subprocess.run([sys.executable, "-m", "hetpilot", "nodes", "forget", "h", "--daemon",
                          daemon.address, "--token-file", str(token)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "h forgotten" in out.stdout, out
    # the next agent binds the name; the old secret is refused from then on
    agents.Register(_register("h", rebuilt), metadata=CLUSTER_MD, timeout=T)
    assert _code(agents.Register, _register("h", "lost-state-dir-secret-0000"))[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    agents.Register(_register("h", rebuilt), metadata=CLUSTER_MD, timeout=T)
