"""Operating a cluster from the command line (issue 16): ``hetpilot nodes|drain|resume``
and ``jobs`` against a real daemon, tables that fit the terminal, the client's
authentication hints, and a daemon usable on one machine as started
(``--insecure-local``, or tokens made on the first start)."""

from __future__ import annotations

import json
import logging
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hetpilot.client.tables import Column, print_table
from hetpilot.daemon.config import AuthConfig
from hetpilot.v1 import agent_pb2, agent_pb2_grpc, job_pb2, job_pb2_grpc

from hetpilot.channel import metadata
from hetpilot.cli import main

from .conftest import (
    CLUSTER_MD,
    CLUSTER_TOKEN,
    OWNER_MD,
    OWNER_TOKEN,
    RunningDaemon,
    start_daemon,
)
from .helpers import register_request, report, submit_request

pytestmark = pytest.mark.timeout(90)
T = 5.0


def _lines(text: str) -> list[str]:
    return [line.rstrip("\n") for line in text.splitlines()]


def test_tables_fit_the_width_and_never_split_a_number(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    columns = [Column("id", 100), Column("name", 60, shrink=True),
               Column("iter s", 80, justify="right"), Column("cost", 40),
               Column("loss", 50, justify="right"), Column("model", 10, shrink=True)]
    rows = [("3f2a9c1b7e40", "a rather long job name", "0.056312", "$/h 8.61/10.00",
             "1.234e-05", "bert-base-uncased"),
            ("77aa00bb11cc", "short", "12.500000", "$/h 0.00", "nan", "-")]
    for width in (40, 55, 70, 90, 140):
        dropped = print_table("t", columns, rows, width)
        out = capsys.readouterr().out
        assert all(len(line) <= width for line in _lines(out)), (width, out)
        for i, col in enumerate(columns):
            if col.shrink:
                continue
            for row in rows:  # each number is whole on one line, or its column left out
                assert (row[i] in out) != (col.header in dropped), (width, col.header, out)
        if dropped:
            assert "left out" in out
    assert print_table("t", columns, rows, 140) == []


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RunningDaemon]:
    """A daemon with two hosts (a probe of a:0 and a link a -> b) and one job."""
    d = start_daemon(tmp_path / "state", heartbeat_timeout_s=600.0)
    try:
        ch = d.channel()
        agents = agent_pb2_grpc.AgentServiceStub(ch)
        regs = {host: agents.Register(register_request(host, 2), metadata=CLUSTER_MD,
                                      timeout=T).registration for host in ("a", "b")}
        ra = report("a", 1, 2, registration=regs["a"])
        ra.links.append(agent_pb2.LinkReport(peer_host="b", gbps=9.5, rtt_us=40.0))
        list(agents.Report(iter([ra, report("b", 1, 2, registration=regs["b"])]),
                           metadata=CLUSTER_MD, timeout=T))
        job_pb2_grpc.JobServiceStub(ch).SubmitJob(submit_request(name="a-job-with-a-long-name"),
                                                  metadata=OWNER_MD, timeout=T)
        yield d
    finally:
        d.stop()


def test_nodes_jobs_drain_resume_commands(cluster: RunningDaemon, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HETPILOT_ADDRESS", cluster.address)
    monkeypatch.setenv("HETPILOT_TOKEN", OWNER_TOKEN)
    admin = tmp_path / "cluster.token"
    admin.write_text(CLUSTER_TOKEN + "\n")
    for width in ("60", "100", "200"):
        monkeypatch.setenv("COLUMNS", width)
        assert main(["nodes"]) == 0
        out = capsys.readouterr().out
        assert all(len(line) <= int(width) for line in _lines(out)), out
        assert "a:0" in out and "b:1" in out and "up" in out
        assert main(["jobs"]) == 0
        out = capsys.readouterr().out
        assert all(len(line) <= int(width) for line in _lines(out)), out
        assert re.search(r"\b[0-9a-f]{12}\b", out)  # the job id, whole
    assert main(["nodes"]) == 0  # at 200 columns: every column, the probe's TFLOP/s
    out = capsys.readouterr().out
    assert "50.0" in out and "declared" in out and "left out" not in out
    assert main(["nodes", "--links"]) == 0
    out = capsys.readouterr().out
    assert "9.5/40" in out and "from \\ to" in out
    assert main(["nodes", "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert [n["host"] for n in nodes] == ["a", "b"] and nodes[0]["state"] == "up"
    assert isinstance(nodes[0]["state_since_unix_ms"], int)

    # drain needs the cluster token: an owner's is refused (exit 4, naming where tokens come from)
    assert main(["drain", "a"]) == 4
    err = capsys.readouterr().err
    assert "PERMISSION_DENIED" in err and "cluster token" in err
    assert "--token-file" in err and "HETPILOT_TOKEN" in err
    assert main(["drain", "ghost", "--token-file", str(admin)]) == 3
    assert "'ghost'" in capsys.readouterr().err
    assert main(["drain", "a", "--reason", "disk swap", "--token-file", str(admin)]) == 0
    assert "a draining" in capsys.readouterr().out
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["nodes"]) == 0
    out = capsys.readouterr().out
    assert "draining" in out and "disk swap" in out
    assert main(["resume", "a", "--token-file", str(admin)]) == 0
    assert "a up" in capsys.readouterr().out


def test_bad_or_missing_token_says_where_tokens_come_from(
        cluster: RunningDaemon, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("HETPILOT_TOKEN", raising=False)
    assert main(["jobs", "--daemon", cluster.address]) == 4
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "--token-file" in err and "HETPILOT_TOKEN" in err
    assert "none was given" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("HETPILOT_TOKEN", "wrong-token-123")
    assert main(["nodes", "--daemon", cluster.address]) == 4
    err = capsys.readouterr().err
    assert "--token-file" in err and "none was given" not in err


def test_daemon_help_shows_the_state_dir_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["daemon", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "/var/lib/hetpilot" in out and "127.0.0.1:7070" in out and "--insecure-local" in out


def test_insecure_local_refuses_a_non_loopback_listen(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hetpilot", "daemon", "--insecure-local",
                           "--listen", "0.0.0.0:0", "--state-dir", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--insecure-local" in proc.stderr
    assert "0.0.0.0:0" in proc.stderr and not (tmp_path / "s").exists()


def test_insecure_local_serves_this_machine_without_tokens(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.WARNING, logger="hetpilot.daemon")
    d = start_daemon(tmp_path / "state", insecure_local=True, auth=AuthConfig())
    try:
        jobs = job_pb2_grpc.JobServiceStub(d.channel())
        info = jobs.SubmitJob(submit_request(), timeout=T)  # no token at all
        assert info.owner == "anonymous"
        assert jobs.ListJobs(job_pb2.ListJobsRequest(), timeout=T).jobs
    finally:
        d.stop()
    assert "NO AUTHENTICATION" in caplog.text and "NO AUTHENTICATION" in capfd.readouterr().err
    assert not (tmp_path / "state" / "owner.token").exists()


def test_first_start_without_tokens_makes_them(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hetpilot.daemon")
    state = tmp_path / "state"
    d = start_daemon(state, auth=AuthConfig())
    owner_file, cluster_file = state / "owner.token", state / "cluster.token"
    try:
        assert stat.S_IMODE(owner_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(cluster_file.stat().st_mode) == 0o600
        token = owner_file.read_text().strip()
        jobs = job_pb2_grpc.JobServiceStub(d.channel())
        assert jobs.SubmitJob(submit_request(), metadata=metadata(token), timeout=T).owner == \
            "admin"
        with pytest.raises(grpc.RpcError) as err:
            jobs.ListJobs(job_pb2.ListJobsRequest(), timeout=T)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        agents = agent_pb2_grpc.AgentServiceStub(d.channel())
        agents.Register(register_request("h"), timeout=T,
                        metadata=metadata(cluster_file.read_text().strip()))
    finally:
        d.stop()
    # the exact commands, with the address it serves on and the files' absolute paths
    assert f"export HETPILOT_ADDRESS={d.address} HETPILOT_TOKEN=\"$(cat {owner_file})\"" \
        in caplog.text
    assert f"--token-file {cluster_file}" in caplog.text
    d = start_daemon(state, auth=AuthConfig())  # a restart reuses them
    try:
        jobs = job_pb2_grpc.JobServiceStub(d.channel())
        assert jobs.ListJobs(job_pb2.ListJobsRequest(), metadata=metadata(token), timeout=T).jobs
    finally:
        d.stop()
