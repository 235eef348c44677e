"""A job's ``[entry.env]`` reaches its ranks only: not the agent's runner, not
torchrun. Real torchrun, one rank on this CPU. Before, a job's ``PYTHONPATH`` replaced
the runner (a rank that failed ended with 0) and its ``LD_PRELOAD`` loaded into
torchrun. And a taken probe port ends the agent with one line naming
``--probe-listen``, exit 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hetpilot.agents.agent import exposure
from hetpilot.agents.config import ConfigError, load_agent_config
from hetpilot.agents.launcher import Launcher
from hetpilot.v1 import agent_pb2

from .helpers import wait_until

pytestmark = pytest.mark.timeout(120)

FAKE_RUNNER = """
import sys
args = sys.argv[1:]
open(args[args.index("--exit") + 1] if "--exit" in args else args[0], "w").write("0\\n")
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ended(launcher: Launcher, launch_id: str) -> Any:
    launcher.poll()
    state = launcher.get(launch_id)
    return state is not None and not state.running and state


def test_entry_env_reaches_the_ranks_only(tmp_path: Path) -> None:
    # a PYTHONPATH that would replace hetpilot's runner (and rankio) with one that says 0
    hijack = tmp_path / "hijack" / "hetpilot" / "agents"
    hijack.mkdir(parents=True)
    for init in (hijack.parent / "__init__.py", hijack / "__init__.py"):
        init.write_text("")
    (hijack / "runner.py").write_text(FAKE_RUNNER)
    launcher = Launcher(tmp_path / "agent", host="h", daemon="d:1", run_as="agent",
                        stop_grace_s=2.0)
    work = tmp_path / "work"
    work.mkdir()
    rank = ("import os, sys; print('PYTHONPATH=' + os.environ.get('PYTHONPATH', ''), "
            "'MARK=' + os.environ.get('MARK', ''), flush=True); sys.exit(3)")
    order = agent_pb2.LaunchOrder(
        launch_id="L1", job_id="j1", nnodes=1, devices=["0"], rdzv_host=True,
        rdzv_endpoint=f"127.0.0.1:{_free_port()}", workdir=str(work),
        command=[sys.executable, "-c", rank],
        env={"PYTHONPATH": str(tmp_path / "hijack"), "LD_PRELOAD": "/nonexistent/libhijack.so",
             "MARK": "job-env"})
    assert launcher.start(order, {})
    state = wait_until("the launch to end", lambda: _ended(launcher, "L1"), timeout=100)
    out = state.output.read_bytes().decode(errors="replace")
    # the rank failed, and the launch says so: the runner and torchrun were hetpilot's
    assert state.exit_code not in (0, 127, 255), (state.exit_code, out[-2000:])
    # the rank had the job's environment, prefixed by its rank ...
    assert f"[rank0]:PYTHONPATH={tmp_path / 'hijack'} MARK=job-env\n" in out, out[-2000:]
    # ... and nothing else did: no preload error from torchrun or the runner
    assert "libhijack" not in "\n".join(line for line in out.splitlines()
                                        if not line.startswith("[rank0]:")), out[-2000:]


def test_a_taken_probe_port_ends_the_agent_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        token = tmp_path / "cluster.token"
        token.write_text("cluster-token-89\n")
        done = subprocess.run(
            [sys.executable, "-m", "hetpilot", "agent", "--daemon", "127.0.0.1:1", "--host",
             "h", "--probe-listen", f"127.0.0.1:{port}", "--token-file", str(token),
             "--state-dir", str(tmp_path / "agent"), "--emulate", "tflops=1,memory_gb=1",
             "--log-level", "ERROR"],
            capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"hetpilot agent: error: --probe-listen 127.0.0.1:{port}: ")
    assert "in use" in lines[0]


def test_the_agent_warns_of_secrets_its_ranks_could_read(tmp_path: Path) -> None:
    token = tmp_path / "cluster.token"
    token.write_text("cluster-token-89\n")
    token.chmod(0o644)
    config = load_agent_config(None, daemon="h:1", token_file=str(token), run_as="owner")
    [warning] = exposure(config)
    assert f"token_file {token} is readable by other users (mode 644)" in warning
    token.chmod(0o600)
    assert exposure(config) == []
    single = load_agent_config(None, daemon="h:1", token_file=str(token), run_as="agent")
    assert bool(exposure(single)) == (os.geteuid() == 0)  # ranks as root: said
    assert exposure(load_agent_config(None, daemon="h:1", launch=False)) == []


@pytest.mark.parametrize(("text", "message"), [
    ('[launch]\nrun_as = "root"\n', 'launch.run_as: must be "owner" or "agent", got \'root\''),
    ("[launch]\noutput_bytes = 1000\n", "launch.output_bytes: must be an integer >= 65536"),
    ('[launch]\noutput_bytes = "1G"\n', "launch.output_bytes: must be an integer"),
    ("[launch]\nrun_az = 1\n", "launch: unknown key(s) run_az"),
])
def test_the_launch_table_is_checked_by_field(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_agent_config(cfg, daemon="h:1")
    assert message in str(err.value)
    cfg.write_text('[launch]\nrun_as = "agent"\noutput_bytes = 1048576\n')
    got = load_agent_config(cfg, daemon="h:1").launching
    assert (got.run_as, got.output_bytes) == ("agent", 1048576)
    assert load_agent_config(cfg, daemon="h:1", run_as="owner").launching.run_as == "owner"
