"""deploy/: the systemd units verify, the example configs load, and the daemon
speaks sd_notify (READY, WATCHDOG, STOPPING) and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hetpilot.agents.config import ConfigError as AgentConfigError
from hetpilot.agents.config import load_agent_config, parse_emulate
from hetpilot.client.cli import job_request_from_toml
from hetpilot.daemon.config import AuthConfig, ConfigError, load_daemon_config

pytestmark = pytest.mark.timeout(60)
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_example_configs_load() -> None:
    d = load_daemon_config(DEPLOY / "daemon.toml")
    assert d.listen == "0.0.0.0:7070" and d.auth.owner_tokens_file
    a = load_agent_config(DEPLOY / "agent.toml")
    assert a.daemon.endswith(":7070") and not a.emulate
    req = job_request_from_toml(DEPLOY / "job.toml")
    assert req.global_batch == 512 and req.budgets["price_per_hour"] == 20.0 and req.model_json
    assert not req.HasField("entry") and d.rdzv_port_min == 29400
    req = job_request_from_toml(DEPLOY / "train-job.toml")  # the README's launched job
    assert req.profile_on_attach and req.entry.module == "hetpilot" and req.entry.args[0] == "train"


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        load_daemon_config(None, heartbeat_timeout_s=-1)
    bad = tmp_path / "d.toml"
    bad.write_text("[daemon]\nlisten = '127.0.0.1:1'\nbogus = 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_daemon_config(bad)
    assert parse_emulate("tflops=5,memory_gb=2,count=3").count == 3
    with pytest.raises(AgentConfigError):
        parse_emulate("tflops=nan,memory_gb=2")


@pytest.mark.parametrize(("text", "message"), [
    # a string is not a boolean: Python would read "false" as true and turn auth off
    ('[auth]\nallow_unauthenticated = "false"\n', "auth.allow_unauthenticated: must be true or false"),
    ('[daemon]\ninsecure_local = "no"\n', "daemon.insecure_local: must be true or false"),
    ("[daemon]\nlisten = 7070\n", "daemon.listen: must be a string"),
    ('[daemon]\ndrain_s = "x"\n', "daemon.drain_s: must be a number"),
    ("[daemon]\nmax_message_bytes = 1.5e6\n", "daemon.max_message_bytes: must be an integer"),
    ("[daemon]\nmax_concurrent_streams = 0\n", "max_concurrent_streams: must be in"),
    ("daemon = 5\n", "daemon: must be a table"),
    ('[auth]\nowner_tokens = "x"\n', "auth.owner_tokens: must be a table"),
    ("[auth.owner_tokens]\nalice = 12345678\n", "auth.owner_tokens: must be a table"),
    ("[tls]\ncert_file = 1\nkey_file = 2\n", "tls.cert_file: must be a string"),
    # a token no client could send (gRPC metadata is printable ASCII; clients strip it)
    ('[auth]\ncluster_token = "clüstertoken"\n', "auth.cluster_token: the token has a character"),
    ('[auth.owner_tokens]\nalice = "alice\\u001b[31mtoken"\n',
     "auth.owner_tokens.alice: the token has a character a gRPC header cannot carry ('\\x1b')"),
    ('[auth]\ncluster_token = "clustertoken "\n', "auth.cluster_token: the token begins or ends"),
    ("[daemon]\n[daemon.auth]\nallow_unauthenticated = true\n", "daemon.auth: give it as"),
    # the agent's config, by the same rule
    ('[agent]\nlaunch = "no"\n', "agent.launch: must be true or false"),
    ('[agent]\nlink_probe_bytes = "4MB"\n', "agent.link_probe_bytes: must be an integer"),
    ('[[emulate]]\ntflops = "5"\nmemory_gb = 1\n', "emulate[0].tflops: must be a number"),
    ("emulate = 3\n", "emulate: must be"),
    ("[agent]\nemulate = 3\n", "agent.emulate: give each device"),
])
def test_config_values_of_the_wrong_type_are_refused_by_name(
        tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    agent = "[agent]" in text or "emulate" in text
    with pytest.raises(AgentConfigError if agent else ConfigError, match=re.escape(message)):
        if agent:
            load_agent_config(cfg, daemon="head:7070")
        else:
            load_daemon_config(cfg)


def test_tokens_read_from_files_are_checked_naming_the_file(tmp_path: Path) -> None:
    """The token files' tokens get the inline tokens' checks when the daemon reads them
    (``AuthConfig.resolved``), each naming its file; before, an owner file's integer
    became a token and a non-ASCII one failed every call of its owner."""
    owners = tmp_path / "owners.toml"
    cluster = tmp_path / "cluster.token"
    for text, message in [('alice = 12345678\n', "alice: the token must be a string, got int"),
                          ('alice = "alicé-token"\n', "alice: the token has a character")]:
        owners.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(f"{owners}: {message}")):
            AuthConfig(owner_tokens_file=str(owners)).resolved()
    cluster.write_text("tökenofthecluster\n")
    with pytest.raises(ConfigError, match=re.escape(f"auth.cluster_token_file {cluster}: ")):
        AuthConfig(cluster_token_file=str(cluster)).resolved()
    owners.write_text('alice = "alice-token"\n')
    cluster.write_text("cluster-token\n# a comment\n")
    got = AuthConfig(owner_tokens_file=str(owners), cluster_token_file=str(cluster)).resolved()
    assert got.owner_tokens == {"alice": "alice-token"} and got.cluster_token == "cluster-token"


def test_a_config_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    cfg = tmp_path / "d.toml"
    cfg.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ConfigError, match=r"d\.toml"):
        load_daemon_config(cfg)


def test_systemd_units_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed: units NOT verified")
    exe = Path(sys.executable).with_name("hetpilot")
    units = []
    for unit in ("hetpilot-daemon.service", "hetpilot-agent.service"):
        text = (DEPLOY / unit).read_text().replace("/opt/hetpilot/venv/bin/hetpilot", str(exe))
        (tmp_path / unit).write_text(text)
        units.append(str(tmp_path / unit))
    out = subprocess.run([tool, "verify", *units], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "hetpilot" not in out.stderr, out.stderr


def test_sd_notify_and_sigterm(tmp_path: Path) -> None:
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(20)
    env = {**os.environ, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    cfg = tmp_path / "d.toml"
    cfg.write_text("[auth]\nallow_unauthenticated = true\n")
    proc = subprocess.Popen([sys.executable, "-m", "hetpilot", "daemon", "--listen",
                             "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
                             "--metrics-listen", "", "--config", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        messages: list[str] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("WATCHDOG=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        assert any("READY=1" in m and "STATUS=serving" in m for m in messages), messages
        assert any("WATCHDOG=1" in m for m in messages), messages
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        rest = []
        sock.settimeout(0.5)
        try:
            while True:
                rest.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
        assert any("STOPPING=1" in m for m in rest), rest
    finally:
        proc.kill()
        proc.wait(timeout=10)
        sock.close()


def test_daemon_config_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    empty = tmp_path / "cluster.token"
    empty.write_text("\n")
    owners = tmp_path / "owners.toml"
    owners.write_text('alice = "same-token-123"\n')
    cases = {
        "auth.cluster_token_file": f'[auth]\ncluster_token_file = "{empty}"\n',
        "auth.owner_tokens_file": f'[auth]\nowner_tokens_file = "{tmp_path / "none.toml"}"\n',
        "equals the cluster token": f'[auth]\nowner_tokens_file = "{owners}"\n'
                                    'cluster_token = "same-token-123"\n',
        "slot_s": "[daemon]\nslot_s = 1e-9\n",
        "d.toml": "[daemon\n",
    }
    for expected, text in cases.items():
        cfg = tmp_path / "d.toml"
        cfg.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "hetpilot", "daemon", "--config", str(cfg),
                               "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (expected, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and expected in proc.stderr, proc.stderr


def test_ports_past_65535_and_bad_job_numbers_are_refused_by_name(tmp_path: Path) -> None:
    """Issue 16: port 99999 used to wrap to 34463; ``global_batch = 512.7`` was truncated,
    -512 gave a protobuf message and "lots" a Python one."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hetpilot", *args], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "HETPILOT_TOKEN": "t" * 8})

    daemon = run("daemon", "--listen", "127.0.0.1:99999", "--state-dir", str(tmp_path / "s"))
    assert daemon.returncode == 2 and "listen: port must be" in daemon.stderr, daemon.stderr
    client = run("jobs", "--daemon", "127.0.0.1:99999")
    assert client.returncode == 2 and "--daemon: port must be" in client.stderr, client.stderr
    model = (DEPLOY.parent / "examples" / "model.json").resolve()
    for value in ("512.7", "-512", '"lots"'):
        job = tmp_path / "job.toml"
        job.write_text(f'model = "{model}"\nglobal_batch = {value}\nmicrobatch_size = 8\n')
        out = run("submit", str(job), "--daemon", "127.0.0.1:1")
        assert out.returncode == 2, (value, out.stderr)
        assert "global_batch" in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert "Traceback" not in out.stderr
