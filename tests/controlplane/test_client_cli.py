"""The job owner's CLI (``hetpilot submit|jobs|job|watch|...``) refuses bad input
before it calls: exit 2 and one line naming the key, flag or file (fuzz campaign
findings); no daemon is needed for any of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hetpilot.agents.config import AgentConfig, ConfigError
from hetpilot.client import cli, jobview
from hetpilot.client.cli import InputError, job_request_from_toml
from hetpilot.client.nodes import print_nodes
from hetpilot.v1 import cluster_pb2, job_pb2

from hetpilot.channel import read_token_file
from hetpilot.cli import main

from .conftest import OWNER_TOKEN, RunningDaemon
from .helpers import model_json

NOWHERE = "127.0.0.1:1"
"""A daemon address nothing answers: a call made by mistake fails with exit 5, not 2."""


def _job(tmp_path: Path, extra: str = "") -> Path:
    """A good job file (and its model.json) in ``tmp_path``, with ``extra`` lines."""
    (tmp_path / "model.json").write_text(model_json())
    job = tmp_path / "job.toml"
    job.write_text('model = "model.json"\nglobal_batch = 64\nmicrobatch_size = 4\n' + extra)
    return job


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``hetpilot ARGV``'s exit code and its stderr."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


def test_job_file_values_of_the_wrong_toml_type_are_refused_by_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job(tmp_path, 'name = "n"\nprofile_on_attach = false\nallowed_hosts = ["gpu01"]\n')
    req = job_request_from_toml(job)
    assert (req.name, req.profile_on_attach, list(req.allowed_hosts)) == ("n", False, ["gpu01"])
    bad = {'allowed_hosts = "gpu01"': "allowed_hosts: must be a list of strings",
           'allowed_hosts = ["a", 1]': "allowed_hosts: must be a list of strings",
           'profile_on_attach = "no"': "profile_on_attach: must be true or false",
           "profile_on_attach = 1": "profile_on_attach: must be true or false",
           "name = 5": "name: must be a string",
           "model = 5": "model: must be a string",
           "global_batch = 64.5": "global_batch: must be an integer",
           'slot_s = "60"': "slot_s: must be a number",
           "schedule = 1": "schedule: must be a string (in quotes) or a list of strings",
           'budgets = { price_per_hour = "20" }': "budgets: must be a table of numbers"}
    base = {"model": '"model.json"', "global_batch": "64", "microbatch_size": "4"}
    path = tmp_path / "bad.toml"
    for line, message in bad.items():
        key = line.split(" = ")[0]
        path.write_text("".join(f"{k} = {v}\n" for k, v in base.items() if k != key) + line)
        with pytest.raises(InputError) as err:
            job_request_from_toml(path)
        assert f"{path}.{message}" in str(err.value), (line, str(err.value))
        code, stderr = _exit(["submit", str(path), "--daemon", NOWHERE], capsys)
        assert code == 2 and f"{path}.{message}" in stderr, (line, code, stderr)


@pytest.mark.parametrize("argv, flag", [
    (["jobs", "--timeout", "nan"], "--timeout"), (["jobs", "--timeout", "inf"], "--timeout"),
    (["jobs", "--timeout", "0"], "--timeout"), (["jobs", "--timeout", "-1"], "--timeout"),
    (["watch", "j", "--after", "-1"], "--after"), (["watch", "j", "--count", "-5"], "--count"),
    (["watch", "j", "--interval", "nan"], "--interval"),
    (["watch", "j", "--after", str(2**63)], "--after"),
    (["logs", "j", "--rank", "-1"], "--rank"), (["logs", "j", "--rank", str(2**32)], "--rank"),
    (["logs", "j", "--reconnect-for", "inf"], "--reconnect-for"),
    (["nodes", "--timeout", "nan"], "--timeout"),
    (["agent", "--stop-grace", "nan"], "--stop-grace"),
    (["agent", "--launch-retention", "-1"], "--launch-retention"),
    (["agent", "--link-probe-interval", "0"], "--link-probe-interval"),
    (["train", "--model", "m:f", "--timeout", "0"], "--timeout"),
    (["train", "--model", "m:f", "--slot-seconds", "inf"], "--slot-seconds"),
    (["train", "--model", "m:f", "--emulate-slowdown", "nan"], "--emulate-slowdown"),
    (["train", "--model", "m:f", "--checkpoint-every", "-1"], "--checkpoint-every"),
    (["train-check", "--timeout", "nan"], "--timeout"),
])
def test_numeric_flags_are_refused_when_parsed_naming_the_flag(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = _exit([*argv, "--daemon", NOWHERE] if argv[0] != "train-check" else argv,
                         capsys)
    assert code == 2, stderr
    assert f"argument {flag}: must be" in stderr and stderr.count("\n") == 1, stderr


def test_a_token_file_gives_its_first_non_empty_line_to_every_client(
        tmp_path: Path, daemon: RunningDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    """The rule of the daemon's own token files; a second line (a comment) was sent too,
    and the daemon answered INTERNAL "Invalid metadata" (exit 1)."""
    token = tmp_path / "owner.token"
    token.write_text(f"\n  {OWNER_TOKEN}  \n# alice's token, made on the head node\n")
    assert read_token_file(token) == OWNER_TOKEN
    code, stderr = _exit(["jobs", "--json", "--daemon", daemon.address,
                          "--token-file", str(token)], capsys)
    assert code == 0, stderr
    agent = AgentConfig(daemon=daemon.address, host="h", token_file=str(token))
    assert agent.cluster_token() == OWNER_TOKEN
    header = "the token has a character a gRPC header cannot carry"
    for content, problem in ((b"\n \n", "holds no token"), (b"tok\x01en\n", header),
                             ("tok\u00e9n\n".encode(), header),
                             (b"\xff\xfetoken\n", "not UTF-8 text")):
        token.write_bytes(content)
        code, stderr = _exit(["jobs", "--daemon", daemon.address, "--token-file", str(token)],
                             capsys)
        assert code == 2 and f"--token-file {token}: {problem}" in stderr, (content, stderr)
        with pytest.raises(ConfigError, match=f"token_file {token}: {problem}"):
            agent.cluster_token()


def test_a_job_or_model_file_that_is_not_utf8_is_refused_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job(tmp_path)
    (tmp_path / "model.json").write_bytes(b'{"layers": "\xff"}')
    code, stderr = _exit(["submit", str(job), "--daemon", NOWHERE], capsys)
    assert code == 2 and f"{job}: model: {tmp_path / 'model.json'}: not UTF-8" in stderr, stderr
    job.write_bytes(b"\xff\xfename = 1\n")
    code, stderr = _exit(["submit", str(job), "--daemon", NOWHERE], capsys)
    assert code == 2 and f"{job}: not UTF-8 text" in stderr, stderr


EVIL = "\x1b[2J\x1b]0;owned\x07ok\x00\u202e[link=http://x]y[/link]"
"""Clears the screen, sets the window title, a NUL, reverses the text, rich markup."""


def _shown(out: str) -> None:
    """What a renderer printed of EVIL: escaped, nothing a terminal would act on."""
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f\u202e]", out), repr(out)
    assert r"\x1b[2J\x1b]0;owned\x07ok\x00\u202e[link=http://x]y[/link]" in out.replace(
        "\n", ""), out


def test_names_reasons_and_warnings_are_printed_with_control_characters_escaped(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    job = job_pb2.JobInfo(job_id="j1", name=EVIL, owner="alice", reason=EVIL,
                          state=job_pb2.JOB_STATE_FAILED, warnings=[EVIL])
    jobview.print_jobs([job], width=400)
    _shown(capsys.readouterr().out)
    jobview.print_job(job)
    _shown(capsys.readouterr().out)
    nodes = cluster_pb2.ListNodesResponse(nodes=[cluster_pb2.NodeInfo(
        host="h", drain_reason=EVIL, state=cluster_pb2.NODE_STATE_DRAINING,
        devices=[cluster_pb2.DeviceStatus(device_id="h:0", name=EVIL)])])
    print_nodes(nodes, links=False, width=400)
    _shown(capsys.readouterr().out)
    assert cli._fail(f"INVALID_ARGUMENT: {EVIL}", 2) == 2
    _shown(capsys.readouterr().err)
