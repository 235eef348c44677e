"""The agent's side of launching (:mod:`hetpilot.agents.launcher`) without torchrun:
a launch id starts at most once (repeated orders, a restarted agent), a restarted
agent watches what still runs and reads how the rest ended, a stop kills the whole
tree; and the job file's ``[entry]`` is checked field by field."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hetpilot.agents.launcher import EXIT_UNKNOWN, Launcher, _proc_stat
from hetpilot.client.cli import InputError, job_request_from_toml
from hetpilot.trainer.cli import _device_id, launched_defaults
from hetpilot.v1 import agent_pb2

from .helpers import wait_until

pytestmark = pytest.mark.timeout(60)

# a "torchrun" that starts its rank command (the launcher's: the entry under rankio) as
# rank 0 in its own session, as torchrun does, writes its pid and the rank's, then waits
RANKS = """
import os, subprocess, sys, time
child = subprocess.Popen(sys.argv[1:], env=dict(os.environ, RANK="0"), start_new_session=True)
open("pids", "w").write(f"{os.getpid()} {child.pid}")
print("torchrun: started", flush=True)
if os.environ.get("EXIT_AT_ONCE"):
    while not os.path.exists("printed"):  # the rank has said hello
        time.sleep(0.01)
    os.killpg(child.pid, 9)
    sys.exit(int(os.environ["EXIT_AT_ONCE"]))
time.sleep(60)
"""
RANK = "import time; print('hello', flush=True); open('printed', 'w').close(); time.sleep(60)"


class FakeTorchrun(Launcher):
    def torchrun(self, order: Any, work: Path) -> list[str]:
        return [sys.executable, "-c", RANKS, *self.rank_command(order, work)]

    def rank_command(self, order: Any, work: Path) -> list[str]:
        real = super().rank_command(order, work)
        return [*real[:real.index("--") + 1], sys.executable, "-c", RANK]


def _order(launch_id: str = "L1", **kw: object) -> agent_pb2.LaunchOrder:
    args: dict[str, object] = dict(launch_id=launch_id, job_id="job1", nnodes=2,
                                   devices=["0", "1"], rdzv_endpoint="127.0.0.1:29400",
                                   module="hetpilot", args=["train"], trainer_token="hpj_secret",
                                   env={"A": "1"})
    args.update(kw)
    return agent_pb2.LaunchOrder(**args)  # type: ignore[arg-type]


def _launcher(tmp: Path, cls: type[Launcher] = FakeTorchrun) -> Launcher:
    return cls(tmp / "agent", host="h", daemon="127.0.0.1:7070", stop_grace_s=1.0,
               run_as="agent")


def _pids(workdir: Path) -> list[int]:
    text = wait_until("the ranks", lambda: (workdir / "pids").exists() and
                      (workdir / "pids").read_text())
    return [int(p) for p in text.split()]


def _gone(pid: int) -> bool:
    return _proc_stat(pid) is None


def test_a_launch_starts_once_and_a_restarted_agent_watches_it(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    launcher = _launcher(tmp_path)
    order = _order(workdir=str(work))
    assert launcher.start(order, {"0": "cuda", "1": "cuda"})
    assert not launcher.start(order, {})  # repeated (a lost ack): nothing more starts
    torchrun, rank = _pids(work)
    state = launcher.get("L1")
    assert state is not None and state.running and state.pid != torchrun
    assert state.work is not None
    token = state.work / "trainer.token"
    assert token.read_text().strip() == "hpj_secret"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    env = Path(f"/proc/{torchrun}/environ").read_bytes().split(b"\0")
    assert b"HETPILOT_TOKEN_FILE=" + str(token).encode() in env
    assert b"HETPILOT_DEVICE_IDS=h:0,h:1" in env and b"CUDA_VISIBLE_DEVICES=0,1" in env
    assert b"HETPILOT_JOB_ID=job1" in env and b"PYTHONUNBUFFERED=1" in env
    assert b"A=1" not in env  # the job's environment is the ranks' only
    cmdline = Path(f"/proc/{state.pid}/cmdline").read_bytes()
    assert b"hpj_secret" not in cmdline  # never on a command line
    real = Launcher(tmp_path / "x", host="h", daemon="d:1").torchrun(_order(rdzv_host=True),
                                                                       tmp_path)
    assert real[1:4] == ["-m", "hetpilot.agents.torchrun", "--nnodes"]
    assert "is_host=true" in real and real[-4:] == ["-u", "-m", "hetpilot", "train"]
    assert "--tee" not in real and "--redirects" not in real  # one copy of the output
    wait_until("output", lambda: b"[rank0]:hello\n" in state.output.read_bytes())
    assert b"torchrun: started\n" in state.output.read_bytes()

    # the agent restarts: the launch is known (never started again) and watched
    again = _launcher(tmp_path)
    assert not again.start(order, {})
    adopted = again.get("L1")
    assert adopted is not None and adopted.running and adopted.pid == state.pid
    again.poll()
    assert [s.launch_id for s in again.statuses()] == ["L1"]
    chunks = again.chunks()
    assert chunks and chunks[0][:2] == ("L1", 0) and b"[rank0]:hello\n" in chunks[0][2]
    # stop: SIGTERM to the tree (the rank is in its own session, as torchrun's are)
    assert again.stop("L1") and not again.stop("L1")
    wait_until("the launch to end", lambda: (again.poll(), not again.get("L1").running)[1])
    wait_until("every process gone", lambda: all(_gone(p) for p in (state.pid, torchrun, rank)))
    ended = again.get("L1")
    assert ended.stopped and ended.exit_code == -15  # the runner saved torchrun's status
    assert ended.reason == "stopped on the daemon's order" and not token.exists()
    # acknowledged with all of its output: no longer reported, and still never started again
    again.acked([("L1", False)], [("L1", 0, ended.output.read_bytes())])
    assert again.statuses() == [] and json.loads((ended.dir / "launch.json").read_text())["done"]
    third = _launcher(tmp_path)
    assert not third.start(order, {}) and third.statuses() == []
    launcher.poll()  # the first agent's child is reaped (it was its parent)


def test_exit_status_is_read_back_after_a_restart_and_failures_say_why(tmp_path: Path,
                                                                       monkeypatch: Any) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("EXIT_AT_ONCE", "3")
    launcher = _launcher(tmp_path)
    assert launcher.start(_order(workdir=str(work)), {})
    state = launcher.get("L1")
    assert state is not None and state.proc is not None
    state.proc.wait(timeout=20)
    # a new agent reads the status the runner saved (the first never polled)
    again = _launcher(tmp_path)
    ended = again.get("L1")
    assert ended is not None and ended.exit_code == 3 and "[rank0]:hello" in ended.reason, \
        ended
    # a launch whose status was never saved (the runner was SIGKILLed with the host)
    (ended.dir / "exit").unlink()
    data = json.loads((ended.dir / "launch.json").read_text())
    data["exit_code"] = None
    (ended.dir / "launch.json").write_text(json.dumps(data))
    lost = _launcher(tmp_path).get("L1")
    assert lost is not None and lost.exit_code == EXIT_UNKNOWN and "lost" in lost.reason
    # an order whose entry would be one of torchrun's own options (an older daemon's):
    # refused here too, never started
    assert launcher.start(_order("L3", module="", command=["--max-restarts=9", "x"]), {})
    refused = launcher.get("L3")
    assert refused is not None and refused.exit_code == 127 and "'-'" in refused.reason
    assert refused.pid == 0 and refused.proc is None
    # a workdir that is not there: reported as a start that failed, at once
    assert launcher.start(_order("L2", workdir=str(tmp_path / "nowhere")), {})
    failed = launcher.get("L2")
    assert failed is not None and failed.exit_code == 127 and "nowhere" in failed.reason
    launcher.poll()


def test_job_file_entry_is_checked_by_field(tmp_path: Path) -> None:
    model = Path(__file__).resolve().parents[2] / "examples" / "model.json"
    head = f'model = "{model}"\nglobal_batch = 16\nmicrobatch_size = 4\n'
    job = tmp_path / "job.toml"
    job.write_text(head + '[entry]\nmodule = "hetpilot"\nargs = ["train", "--epochs", "2"]\n'
                   'ranks_per_host = 1\nhosts = 2\nrestart_budget = 3\nworkdir = "/srv/x"\n'
                   '[entry.env]\nNCCL_DEBUG = "WARN"\n')
    req = job_request_from_toml(job)
    assert req.HasField("entry") and req.entry.module == "hetpilot"
    assert list(req.entry.args) == ["train", "--epochs", "2"] and req.entry.hosts == 2
    assert (req.entry.ranks_per_host, req.entry.restart_budget) == (1, 3)
    assert dict(req.entry.env) == {"NCCL_DEBUG": "WARN"} and req.entry.workdir == "/srv/x"
    job.write_text(head + '[entry]\ncommand = ["./train.sh", "--fast"]\n')
    assert list(job_request_from_toml(job).entry.command) == ["./train.sh", "--fast"]
    job.write_text(head)
    assert not job_request_from_toml(job).HasField("entry")
    bad = {
        'entry = "pkg.mod:main"': "entry: must be a table",
        '[entry]\nargs = ["x"]': "entry: set exactly one of module",
        '[entry]\nmodule = "m"\ncommand = ["x"]': "entry: set exactly one of module",
        '[entry]\nmodule = "pkg.mod:main"': "entry.module: must be a dotted module name",
        '[entry]\ncommand = "train.sh"': "entry.command: must be a list of strings",
        '[entry]\ncommand = ["x", 3]': "entry.command[1]: must be a string",
        '[entry]\ncommand = ["--nproc-per-node=8", "x"]': "entry.command[0]: must not start",
        '[entry]\nmodule = "-m"': "entry.module: must be a dotted module name",
        '[entry]\nmodule = "m"\nargs = "--x"': "entry.args: must be a list of strings",
        '[entry]\nmodule = "m"\nranks_per_host = 1.5': "entry.ranks_per_host: must be an integer",
        '[entry]\nmodule = "m"\nhosts = -1': "entry.hosts: must be an integer in [0, 1024]",
        '[entry]\nmodule = "m"\nrestart_budget = true': "entry.restart_budget: must be an int",
        '[entry]\nmodule = "m"\nworkdir = "rel"': "entry.workdir: must be an absolute path",
        '[entry]\nmodule = "m"\nnproc = 2': "entry: unknown key(s) nproc",
        '[entry]\nmodule = "m"\n[entry.env]\nHETPILOT_JOB_ID = "x"': "entry.env.HETPILOT_JOB_ID",
        '[entry]\nmodule = "m"\n[entry.env]\nX = 1': "entry.env.X: must be a string",
        '[entry]\nmodule = "m"\nenv = ["A=1"]': "entry.env: must be a table",
    }
    for text, message in bad.items():
        job.write_text(head + text + "\n")
        with pytest.raises(InputError) as err:
            job_request_from_toml(job)
        assert f"{job}.{message}" in str(err.value), (text, str(err.value))
    # on the command line: exit 2, one line naming the field, before any call
    job.write_text(head + '[entry]\nmodule = "m"\nhosts = "two"\n')
    out = subprocess.run([sys.executable, "-m", "hetpilot", "submit", str(job), "--daemon",
                          "127.0.0.1:1"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HETPILOT_TOKEN": "t" * 8})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "entry.hosts" in out.stderr


def test_hetpilot_train_finds_a_launched_job_in_its_environment(monkeypatch: Any) -> None:
    def args(**kw: object) -> argparse.Namespace:
        base: dict[str, object] = dict(plan=None, daemon=None, job="", token_file=None,
                                       ca_file="", cert_file="", key_file="", device_id=None)
        base.update(kw)
        return argparse.Namespace(**base)

    for key in ("HETPILOT_JOB_ID", "HETPILOT_ADDRESS", "HETPILOT_TOKEN_FILE",
                "HETPILOT_CA_FILE", "HETPILOT_DEVICE_ID", "HETPILOT_DEVICE_IDS"):
        monkeypatch.delenv(key, raising=False)
    assert "one of --plan and --daemon" in (launched_defaults(args()) or "")
    monkeypatch.setenv("HETPILOT_JOB_ID", "j1")
    assert "HETPILOT_ADDRESS" in (launched_defaults(args()) or "")
    monkeypatch.setenv("HETPILOT_ADDRESS", "head:7070")
    monkeypatch.setenv("HETPILOT_TOKEN_FILE", "/run/t")
    monkeypatch.setenv("HETPILOT_CA_FILE", "/etc/ca.pem")
    a = args()
    assert launched_defaults(a) is None
    assert (a.daemon, a.job, a.token_file, a.ca_file, a.cert_file) == (
        "head:7070", "j1", "/run/t", "/etc/ca.pem", "")
    a = args(plan="p.json")  # a plan file wins: the environment is not used
    assert launched_defaults(a) is None and a.daemon is None
    a = args(daemon="other:1", job="j2", token_file="/x")  # flags win
    assert launched_defaults(a) is None and (a.daemon, a.job, a.token_file) == (
        "other:1", "j2", "/x")
    monkeypatch.setenv("HETPILOT_DEVICE_IDS", "gpu7:2,gpu7:5")
    assert [_device_id(args(), r, r) for r in (0, 1)] == ["gpu7:2", "gpu7:5"]
    assert _device_id(args(device_id="x:{local_rank}"), 0, 1) == "x:1"
