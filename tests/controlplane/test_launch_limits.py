"""Per-launch memory and process limits (:mod:`hetpilot.agents.cgroups`): real cgroups,
real launches (the runner, :mod:`hetpilot.agents.rankio` and the ranks are real;
torchrun is a stand-in that starts the rank command as rank 0 in its own session, as
torchrun does). A rank forking past ``tasks_max`` and one allocating past
``memory_max`` fail their launch with a reason naming the limit; nothing is left in a
launch's cgroup once it ended and the cgroup is gone; a starting agent removes the
cgroups its launches left. The cgroup tests need root and a usable hierarchy (v2 with
memory and pids, or v1 memory and pids) and skip naming why elsewhere; the config and
discovery tests run anywhere."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hetpilot.agents.cgroups import (
    Hierarchy,
    LaunchGroups,
    Limits,
    find_hierarchy,
    parse_mountinfo,
    parse_proc_cgroup,
)
from hetpilot.agents.config import ConfigError, load_agent_config
from hetpilot.agents.launcher import Launcher
from hetpilot.agents.procs import proc_stat
from hetpilot.v1 import agent_pb2, job_pb2, job_pb2_grpc

from .conftest import CLUSTER_TOKEN, OWNER_MD, start_daemon
from .helpers import submit_request, wait_until
from .sandbox import shared_dir, unix_users, why_no_users

pytestmark = pytest.mark.timeout(120)

TORCHRUN = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], env=dict(os.environ, RANK="0"), start_new_session=True)
sys.exit(child.wait())
"""
FORKER = """
import os, signal
kids = []
try:
    while True:
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        kids.append(pid)
except OSError as exc:
    open("kids", "w").write(" ".join(map(str, kids)))
    print(f"fork refused after {len(kids)} children: {exc}", flush=True)
    raise SystemExit(3)
"""
HOG = """
import os, signal, time
kid = os.fork()
if kid == 0:  # a bystander of the launch, killed with it
    signal.pause()
    os._exit(0)
open("kids", "w").write(str(kid))
print("allocating", flush=True)
block = b"x" * (512 << 20)
print("survived", len(block), flush=True)
"""
SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"
MEMORY = 128 << 20
TASKS = 16


class StandIn(Launcher):
    def torchrun(self, order: Any, work: Path) -> list[str]:
        return [sys.executable, "-c", TORCHRUN, *self.rank_command(order, work)]


def _why_no_cgroups() -> str:
    if os.geteuid() != 0:
        return "needs root to make cgroups"
    return LaunchGroups(Path("/nonexistent"), Limits(MEMORY, TASKS)).why_not()


needs_cgroups = pytest.mark.skipif(bool(_why_no_cgroups()), reason=_why_no_cgroups() or "-")


def _order(launch_id: str, code: str, **kw: Any) -> Any:
    return agent_pb2.LaunchOrder(launch_id=launch_id, job_id=f"job-{launch_id}", nnodes=1,
                                 devices=["0"], rdzv_endpoint="127.0.0.1:1",
                                 command=[sys.executable, "-c", code],
                                 trainer_token="hpj_secret", **kw)


def _launcher(state: Path, **kw: Any) -> Launcher:
    kw.setdefault("limits", Limits(MEMORY, TASKS))
    return StandIn(state, host="h", daemon="127.0.0.1:1", stop_grace_s=1.0,
                   run_as=kw.pop("run_as", "agent"), **kw)


def _ended(launcher: Launcher, launch_id: str) -> Any:
    launcher.poll()
    state = launcher.get(launch_id)
    return state is not None and not state.running and state


def _gone(pids: list[int]) -> bool:
    return all(proc_stat(p) is None for p in pids)


def _run(launcher: Launcher, launch_id: str, code: str, workdir: Path) -> Any:
    """Start ``code`` as the launch's rank and wait for the launch to end."""
    assert launcher.start(_order(launch_id, code, workdir=str(workdir)), {})
    dirs = launcher.cgroups.dirs(launch_id)
    assert dirs and all(d.is_dir() for d in dirs)  # made before the runner started
    return wait_until(f"launch {launch_id} to end", lambda: _ended(launcher, launch_id), 90)


@needs_cgroups
def test_a_rank_forking_past_tasks_max_fails_its_launch_naming_the_limit(
        tmp_path: Path) -> None:
    launcher = _launcher(tmp_path / "agent")
    dirs = launcher.cgroups.dirs("LF")
    state = _run(launcher, "LF", FORKER, tmp_path)
    assert state.exit_code == 3, state.reason
    assert state.reason.splitlines()[0].startswith("launch reached tasks_max 16 ("), state.reason
    assert b"fork refused after" in state.output.read_bytes()
    kids = [int(p) for p in (tmp_path / "kids").read_text().split()]
    assert 5 <= len(kids) < TASKS  # the runner, torchrun, rankio and the rank count too
    # nothing of the launch is left, and its cgroup (and its agent's scope) is gone
    wait_until("its processes gone", lambda: (launcher.poll(), _gone(kids))[1])
    wait_until("its cgroup removed", lambda: (launcher.poll(),
                                              not any(d.exists() for d in dirs))[1])
    assert not any(d.parent.exists() for d in dirs)
    assert launcher.cgroups.pending() == []


@needs_cgroups
def test_a_rank_allocating_past_memory_max_is_oom_killed_and_named(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path / "agent")
    dirs = launcher.cgroups.dirs("LM")
    state = _run(launcher, "LM", HOG, tmp_path)
    out = state.output.read_bytes()
    assert b"allocating" in out and b"survived" not in out
    assert state.exit_code != 0
    first = state.reason.splitlines()[0]
    assert first.startswith("launch exceeded memory_max 128 MiB (OOM kill: "), state.reason
    kid = int((tmp_path / "kids").read_text())
    wait_until("the bystander gone", lambda: (launcher.poll(), _gone([kid]))[1])
    wait_until("its cgroup removed", lambda: (launcher.poll(),
                                              not any(d.exists() for d in dirs))[1])
    # a launch within its limits succeeds and says nothing of them
    ok = _run(launcher, "LOK", "print('small', flush=True)", tmp_path)
    assert ok.exit_code == 0 and ok.reason == ""


@needs_cgroups
def test_a_starting_agent_kills_and_removes_cgroups_its_launches_left(tmp_path: Path) -> None:
    state_dir = tmp_path / "agent"
    groups = LaunchGroups(state_dir.absolute(), Limits(MEMORY, TASKS))
    dirs = groups.create("Lold")  # as an agent killed with its launch still in it left it
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        for d in dirs:
            (d / "cgroup.procs").write_text(str(sleeper.pid))
        other = LaunchGroups(tmp_path / "other-agent", Limits(MEMORY, TASKS))
        theirs = other.create("Lold")  # another agent's launch of the same id: not touched
        launcher = _launcher(state_dir)
        assert sleeper.wait(timeout=30) == -9
        wait_until("the stale cgroup removed", lambda: (launcher.poll(),
                                                        not any(d.exists() for d in dirs))[1])
        assert all(d.is_dir() for d in theirs)
        assert other.end("Lold") == "" and not any(d.exists() for d in theirs)
    finally:
        sleeper.kill()
        sleeper.wait()


@needs_cgroups
def test_a_running_launch_keeps_its_cgroup_across_an_agent_restart(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path / "agent")
    assert launcher.start(_order("LR", SLEEPER, workdir=str(tmp_path)), {})
    state = launcher.get("LR")
    wait_until("the rank", lambda: b"[rank0]:ready\n" in state.output.read_bytes())
    dirs = launcher.cgroups.dirs("LR")
    members = {int(p) for d in dirs for p in (d / "cgroup.procs").read_text().split()}
    assert state.pid in members and len(members) >= 4  # runner, torchrun, rankio, rank
    again = _launcher(tmp_path / "agent")  # adopts it: its cgroup stays
    assert all(d.is_dir() for d in dirs) and again.get("LR").running
    assert again.stop("LR")
    wait_until("the launch to end", lambda: _ended(again, "LR"))
    wait_until("its cgroup removed", lambda: (again.poll(),
                                              not any(d.exists() for d in dirs))[1])
    assert _gone(sorted(members))
    launcher.poll()  # the first launcher's child is reaped


@needs_cgroups
@pytest.mark.skipif(bool(why_no_users()), reason=why_no_users() or "-")
def test_an_owners_rank_cannot_leave_its_launchs_cgroup() -> None:
    escape = ("import sys\n"
              "for d in sys.argv[1:]:\n"
              "    try:\n"
              "        open(d + '/cgroup.procs', 'w').write('0')\n"
              "        print('LEFT', d, flush=True)\n"
              "    except OSError as exc:\n"
              "        print('DENIED', type(exc).__name__, flush=True)\n")
    with shared_dir() as base, unix_users(1) as (alice,):
        launcher = _launcher(base / "agent", run_as="owner")
        bases = list(launcher.cgroups.hierarchy.bases)
        order = _order("LE", escape, unix_user=alice)
        order.args.extend(str(b) for b in bases)
        assert launcher.start(order, {})
        state = wait_until("the launch to end", lambda: _ended(launcher, "LE"), 90)
        assert state.exit_code == 0, state.reason
        lines = state.output.read_bytes().decode().splitlines()
        assert [x for x in lines if "LEFT" in x] == []
        assert len([x for x in lines if "DENIED PermissionError" in x]) == len(bases)
        assert pwd.getpwnam(alice).pw_uid != 0


@needs_cgroups
def test_a_job_whose_rank_forks_past_tasks_max_fails_naming_it(tmp_path: Path) -> None:
    """With a real daemon, agent (its [launch] config) and torchrun: the job FAILS with
    a reason naming the limit, and the agent said once at start where its launches'
    cgroups go."""
    d = start_daemon(tmp_path / "state", rdzv_port_min=29891, rdzv_port_max=29899)
    token = tmp_path / "cluster.token"
    token.write_text(CLUSTER_TOKEN + "\n")
    token.chmod(0o600)
    config = tmp_path / "agent.toml"
    config.write_text('[launch]\nrun_as = "agent"\ntasks_max = 64\nmemory_max = "2G"\n')
    log = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPILOT_")}
    argv = [sys.executable, "-m", "hetpilot", "agent", "--daemon", d.address, "--host", "hosta",
            "--probe-listen", "127.0.0.1:0", "--token-file", str(token), "--state-dir",
            str(tmp_path / "agent"), "--emulate", "tflops=2,memory_gb=8,count=1",
            "--config", str(config)]
    with open(log, "wb") as out:
        agent = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        jobs = job_pb2_grpc.JobServiceStub(d.channel())
        entry = job_pb2.JobEntry(command=[sys.executable, "-c", FORKER], ranks_per_host=1,
                                 hosts=1, workdir=str(tmp_path))
        job_id = jobs.SubmitJob(submit_request(entry=entry), metadata=OWNER_MD,
                                timeout=10).job_id
        info = wait_until("the job to end", lambda: (j := jobs.GetJob(
            job_pb2.GetJobRequest(job_id=job_id), metadata=OWNER_MD, timeout=10)).state
            not in (job_pb2.JOB_STATE_PENDING, job_pb2.JOB_STATE_RUNNING) and j, timeout=90)
        assert info.state == job_pb2.JOB_STATE_FAILED
        assert info.reason.startswith("host hosta: launch reached tasks_max 64 ("), info.reason
        assert "; torchrun exited with code " in info.reason.splitlines()[0], info.reason
        said = [line for line in log.read_text().splitlines() if "per-launch cgroups" in line]
        assert len(said) == 1 and "(memory_max 2 GiB, tasks_max 64)" in said[0], said
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        d.stop()


def _v2_only() -> Hierarchy:
    """This machine's cgroup v2 hierarchy alone (with whatever controllers it offers)."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    return find_hierarchy(None, "\n".join(m for m in mounts if " - cgroup2 " in m))


def _why_no_v2() -> str:
    if os.geteuid() != 0:
        return "needs root to make cgroups"
    h = _v2_only()
    return "" if h.version == 2 and h.bases else f"no writable cgroup v2 here: {h.why_not}"


@pytest.mark.skipif(bool(_why_no_v2()), reason=_why_no_v2() or "-")
def test_in_cgroup_v2_a_launch_is_emptied_with_cgroup_kill_and_removed(tmp_path: Path) -> None:
    """cgroup v2 (with controllers or not: where v1 holds memory and pids, as on hosts in
    hybrid mode, it has none): the runner joins the launch's cgroup and whatever is in
    it when the launch ends is killed and the cgroup removed."""
    hierarchy = _v2_only()
    groups = LaunchGroups(tmp_path / "agent", Limits(), hierarchy=hierarchy)
    launcher = _launcher(tmp_path / "agent", cgroups=groups)
    assert launcher.start(_order("L2", SLEEPER, workdir=str(tmp_path)), {})
    state = launcher.get("L2")
    wait_until("the rank", lambda: b"[rank0]:ready\n" in state.output.read_bytes())
    [directory] = groups.dirs("L2")
    members = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    assert state.pid in members and len(members) >= 4
    assert launcher.stop("L2")
    wait_until("the launch to end", lambda: _ended(launcher, "L2"))
    wait_until("its cgroup removed", lambda: (launcher.poll(), not directory.exists())[1])
    assert _gone(members)
    # what a launch left behind (here: a process put in its cgroup) is killed
    [left] = groups.create("L3")
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        (left / "cgroup.procs").write_text(str(sleeper.pid))
        assert groups.end("L3") == ""
        assert sleeper.wait(timeout=30) == -9
        wait_until("its cgroup removed", lambda: (groups.tidy(), not left.exists())[1])
        assert not left.parent.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_require_limits_refuses_launches_where_no_hierarchy_is_usable(tmp_path: Path) -> None:
    none = Hierarchy(why_not="no cgroup v1 memory hierarchy; no cgroup v1 pids hierarchy")
    groups = LaunchGroups(tmp_path / "agent", Limits(MEMORY, TASKS), hierarchy=none)
    assert "not enforced: no usable cgroup hierarchy" in groups.status()
    strict = _launcher(tmp_path / "agent", cgroups=groups, require_limits=True)
    assert strict.start(_order("L1", SLEEPER, workdir=str(tmp_path)), {})
    state = strict.get("L1")
    assert state is not None and state.exit_code == 127 and state.pid == 0
    assert state.reason == ("not started on h: [launch] require_limits is set and no usable "
                            "cgroup hierarchy: no cgroup v1 memory hierarchy; no cgroup v1 "
                            "pids hierarchy"), state.reason
    # without require_limits it runs, without limits
    lax = _launcher(tmp_path / "agent2", cgroups=LaunchGroups(
        tmp_path / "agent2", Limits(MEMORY, TASKS), hierarchy=none))
    ran = _run_plain(lax, "L2", tmp_path)
    assert ran.exit_code == 0 and b"[rank0]:hi\n" in ran.output.read_bytes()


def _run_plain(launcher: Launcher, launch_id: str, workdir: Path) -> Any:
    assert launcher.start(_order(launch_id, "print('hi')", workdir=str(workdir)), {})
    return wait_until("the launch to end", lambda: _ended(launcher, launch_id), 90)


def test_limits_are_config_keys_checked_by_name(tmp_path: Path) -> None:
    def load(text: str) -> Any:
        path = tmp_path / "agent.toml"
        path.write_text(text)
        return load_agent_config(path, daemon="d:1").launching

    got = load('[launch]\nmemory_max = "64G"\ntasks_max = 512\nrequire_limits = true\n')
    assert got.limits() == Limits(memory_max=64 << 30, tasks_max=512) and got.require_limits
    assert load("[launch]\nmemory_max = 1073741824\n").limits() == Limits(1 << 30, 0)
    assert load('[launch]\nmemory_max = "1.5GiB"\n').limits().memory_max == 3 << 29
    assert load("").limits() == Limits()
    for text, said in (
            ('memory_max = "lots"', "launch.memory_max: not a size"),
            ("memory_max = -5", "launch.memory_max: must not be negative"),
            ("memory_max = 1000", "launch.memory_max: must be at least 32M"),
            ("memory_max = true", "launch.memory_max: must be"),
            ("tasks_max = 2", "launch.tasks_max: must be an integer in [8, 4194304]"),
            ('tasks_max = "many"', "launch.tasks_max: must be"),
            ('require_limits = "yes"', "launch.require_limits: must be"),
            ("require_limits = true", "launch.require_limits: set memory_max or tasks_max")):
        with pytest.raises(ConfigError, match=r"^" + said.replace("[", r"\[")):
            load(f"[launch]\n{text}\n")
    # the agent's command line: exit 2 naming the key
    path = tmp_path / "bad.toml"
    path.write_text('[launch]\ntasks_max = 3\n')
    done = subprocess.run([sys.executable, "-m", "hetpilot", "agent", "--daemon", "d:1",
                           "--config", str(path), "--state-dir", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "launch.tasks_max" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


PROC_V1 = """9:name=systemd:/
8:pids:/
4:memory:/process_api/abc
1:cpu,cpuacct:/
0::/
"""
MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / {root}/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 /kube/pod1 {root}/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_the_hierarchy_is_found_from_proc_self_cgroup_and_mountinfo(tmp_path: Path) -> None:
    """Discovery over a stand-in cgroup tree (plain directories): v1 memory and pids at
    the agent's own cgroups; v2 preferred once it offers both; a mount whose root is a
    container's cgroup maps its paths."""
    assert parse_proc_cgroup(PROC_V1) == {"name=systemd": "/", "pids": "/",
                                          "memory": "/process_api/abc", "cpu": "/",
                                          "cpuacct": "/", "": "/"}
    mounts = parse_mountinfo(MOUNTS.format(root=tmp_path))
    assert [(m.version, m.root) for m in mounts] == [(1, "/"), (1, "/"), (2, "/kube/pod1")]
    (tmp_path / "memory" / "process_api" / "abc").mkdir(parents=True)
    (tmp_path / "pids").mkdir()
    unified = tmp_path / "unified" / "agent"
    unified.mkdir(parents=True)
    (unified / "cgroup.controllers").write_text("cpu io\n")
    (unified / "cgroup.subtree_control").write_text("")
    proc = PROC_V1.replace("0::/", "0::/kube/pod1/agent")
    h = find_hierarchy(proc, MOUNTS.format(root=tmp_path))
    assert h.version == 1 and h.bases == {
        tmp_path / "memory" / "process_api" / "abc": {"memory"}, tmp_path / "pids": {"pids"}}
    assert "offers no memory or pids controller" in h.why_not
    (unified / "cgroup.controllers").write_text("cpu io memory pids\n")
    h = find_hierarchy(proc, MOUNTS.format(root=tmp_path))
    assert h.version == 2 and h.bases == {unified: {"memory", "pids"}}, h
    assert (unified / "cgroup.subtree_control").read_text() == "+memory +pids"
    none = find_hierarchy("0::/\n", "")
    assert none.bases == {} and none.why_not
    assert LaunchGroups(tmp_path, Limits(MEMORY), hierarchy=none).why_not().startswith(
        "no usable cgroup hierarchy")
