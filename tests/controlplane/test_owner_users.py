"""Owners' unix users: the owner tokens file's table form (``[alice] token = ...
unix_user = ...``, the ``owner = "token"`` line still valid) and the daemon sending
the owner's unix user with each launch order (an owner without one: empty)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hetpilot.daemon.auth import Authenticator
from hetpilot.daemon.config import AuthConfig, ConfigError
from hetpilot.v1 import agent_pb2_grpc, job_pb2, job_pb2_grpc

from .conftest import (
    CLUSTER_MD,
    CLUSTER_TOKEN,
    OTHER_MD,
    OTHER_TOKEN,
    OWNER_MD,
    OWNER_TOKEN,
    start_daemon,
)
from .helpers import register_request, report, submit_request, wait_until

pytestmark = pytest.mark.timeout(60)

OWNERS = f"""
bob = "{OTHER_TOKEN}"

[alice]
token = "{OWNER_TOKEN}"
unix_user = "alice_u"
"""


def test_the_owner_tokens_file_takes_a_table_per_owner_with_her_unix_user(
        tmp_path: Path) -> None:
    owners = tmp_path / "owners.toml"
    owners.write_text(OWNERS)
    got = AuthConfig(owner_tokens_file=str(owners), cluster_token=CLUSTER_TOKEN).resolved()
    assert got.owner_tokens == {"alice": OWNER_TOKEN, "bob": OTHER_TOKEN}
    assert got.owner_unix_users == {"alice": "alice_u"}
    auth = Authenticator(got)
    assert auth.unix_user("alice") == "alice_u" and auth.unix_user("bob") == ""
    assert auth.owner([("authorization", f"Bearer {OWNER_TOKEN}")]) == "alice"
    for text, message in [
        ('[alice]\nunix_user = "alice"\n', "alice: the table has no token"),
        ('[alice]\ntoken = "alice-token"\nuser = "a"\n', "alice: unknown key(s) user"),
        ('[alice]\ntoken = "alice-token"\nunix_user = "a b"\n',
         "alice.unix_user: must be a unix user name"),
        ('[alice]\ntoken = "alice-token"\nunix_user = "root"\n',
         "alice.unix_user: ranks never run as root"),
        ('[alice]\ntoken = 12345678\n', "alice: the token must be a string, got int"),
    ]:
        owners.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(f"{owners}: {message}")):
            AuthConfig(owner_tokens_file=str(owners)).resolved()
    with pytest.raises(ConfigError, match=r"auth\.owner_unix_users\.alice: must be a unix"):
        AuthConfig(owner_unix_users={"alice": "../x"})


def test_each_launch_order_names_its_owners_unix_user(tmp_path: Path) -> None:
    owners = tmp_path / "owners.toml"
    owners.write_text(OWNERS)
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0, rdzv_port_min=29811,
                     rdzv_port_max=29830,
                     auth=AuthConfig(owner_tokens_file=str(owners), cluster_token=CLUSTER_TOKEN))
    try:
        ch = d.channel()
        agents = agent_pb2_grpc.AgentServiceStub(ch)
        jobs = job_pb2_grpc.JobServiceStub(ch)
        req = register_request("a", 2)
        req.launches = True
        reg = agents.Register(req, metadata=CLUSTER_MD, timeout=5)
        entry = job_pb2.JobEntry(command=["/bin/true"], ranks_per_host=1, hosts=1)
        orders = {}
        for owner, md in (("alice", OWNER_MD), ("bob", OTHER_MD)):
            info = jobs.SubmitJob(submit_request(entry=entry), metadata=md, timeout=5)
            req = report("a", len(orders) + 1, 2, registration=reg.registration)
            [ack] = list(agents.Report(iter([req]), metadata=CLUSTER_MD, timeout=5))
            got = {o.job_id: o for o in ack.start}
            assert info.job_id in got, (info.launch_id, info, list(ack.start))
            orders[owner] = got[info.job_id]
        assert orders["alice"].unix_user == "alice_u"
        assert orders["bob"].unix_user == ""  # none set: agents that switch users refuse it
    finally:
        d.stop()


def test_a_job_whose_owner_has_no_unix_user_fails_naming_why(tmp_path: Path) -> None:
    """A real agent (default ``run_as = "owner"``) refuses bob's launch: bob has no
    unix_user; the daemon fails the job with the agent's reason, naming the host.
    Before, the agent ran bob's command as its own user."""
    owners = tmp_path / "owners.toml"
    owners.write_text(OWNERS)
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=5.0, rdzv_port_min=29831,
                     rdzv_port_max=29850,
                     auth=AuthConfig(owner_tokens_file=str(owners), cluster_token=CLUSTER_TOKEN))
    (tmp_path / "cluster.token").write_text(CLUSTER_TOKEN + "\n")
    (tmp_path / "cluster.token").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPILOT_")}
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "hetpilot", "agent", "--daemon", d.address, "--host",
             "hosta", "--probe-listen", "127.0.0.1:0", "--token-file",
             str(tmp_path / "cluster.token"), "--state-dir", str(tmp_path / "agent"),
             "--emulate", "tflops=2,memory_gb=8,count=1"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        jobs = job_pb2_grpc.JobServiceStub(d.channel())
        marker = tmp_path / "ran"
        entry = job_pb2.JobEntry(command=["/bin/touch", str(marker)], ranks_per_host=1, hosts=1)
        job_id = jobs.SubmitJob(submit_request(entry=entry), metadata=OTHER_MD,
                                timeout=5).job_id

        def ended() -> object:
            j = jobs.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=OTHER_MD, timeout=5)
            return j.state not in (job_pb2.JOB_STATE_PENDING, job_pb2.JOB_STATE_RUNNING) and j

        info = wait_until("bob's job to end", ended, timeout=60, period=0.2)
        assert info.state == job_pb2.JOB_STATE_FAILED, info
        assert info.reason.startswith("host hosta: could not start: not started on hosta: the "
                                      "job's owner has no unix_user"), info.reason
        assert not marker.exists()  # nothing of bob's ran
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        d.stop()
