"""Ranks run as their job owner's unix user, and owners cannot read each other
(as root, with users made for the test and removed after; skipped elsewhere with
the reason). torchrun is played by a stand-in that starts the rank command the
launcher gives it as rank 0 (in its own session, as torchrun does); the runner,
the change of user, :mod:`hetpilot.agents.rankio` and the ranks are real."""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hetpilot.agents.launcher import Launcher
from hetpilot.agents.procs import descendants, proc_stat
from hetpilot.v1 import agent_pb2

from .helpers import wait_until
from .sandbox import PROBE, shared_dir, unix_users, why_no_users

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(why_no_users()), reason=why_no_users() or "-")]

TORCHRUN = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], env=dict(os.environ, RANK="0"), start_new_session=True)
open("pids", "w").write(f"{os.getpid()} {child.pid}")
sys.exit(child.wait())
"""
SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"
class StandIn(Launcher):
    def torchrun(self, order: Any, work: Path) -> list[str]:
        return [sys.executable, "-c", TORCHRUN, *self.rank_command(order, work)]


def _order(launch_id: str, user: str, code: str, *args: str, **kw: Any) -> Any:
    return agent_pb2.LaunchOrder(launch_id=launch_id, job_id=f"job-{launch_id}", nnodes=1,
                                 devices=["0"], rdzv_endpoint="127.0.0.1:1", unix_user=user,
                                 command=[sys.executable, "-c", code], args=list(args),
                                 trainer_token=f"hpj_{launch_id}_secret", **kw)


def _ids(pid: int) -> tuple[int, int, set[int]]:
    """(uid, gid, supplementary groups) of a process."""
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines())
    return (int(status["Uid"].split()[0]), int(status["Gid"].split()[0]),
            {int(g) for g in status["Groups"].split()})


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _ended(launcher: Launcher, launch_id: str) -> Any:
    launcher.poll()
    state = launcher.get(launch_id)
    return state is not None and not state.running and state


def test_ranks_run_as_their_owner_and_owners_cannot_read_each_other() -> None:
    with shared_dir() as base, unix_users(2) as (alice, bob):
        agent_token = base / "cluster.token"
        agent_token.write_text("cluster-token-89\n")
        os.chmod(agent_token, 0o600)
        launcher = StandIn(base / "agent", host="h", daemon="127.0.0.1:1", stop_grace_s=1.0)
        assert launcher.run_as == "owner"  # the default
        pw = pwd.getpwnam(alice)
        assert launcher.start(_order("LA", alice, SLEEPER, env={"SECRET": "alice-env-secret"}),
                              {})
        a = launcher.get("LA")
        assert a is not None and a.work is not None and a.user == alice
        torchrun, wrapper = [int(p) for p in wait_until(
            "alice's ranks", lambda: (a.work / "pids").exists() and  # type: ignore[union-attr]
            (a.work / "pids").read_text()).split()]  # type: ignore[union-attr]
        wait_until("alice's rank", lambda: b"[rank0]:ready\n" in a.output.read_bytes())
        [rank] = [p for p in descendants({wrapper: proc_stat(wrapper)[1]})]  # type: ignore[index]
        # torchrun and everything under it: alice's uid, gid, groups and HOME; the runner
        # stays root
        assert _ids(a.pid)[0] == 0
        for pid in (torchrun, wrapper, rank):
            uid, gid, groups = _ids(pid)
            assert (uid, gid) == (pw.pw_uid, pw.pw_gid)
            assert groups <= set(os.getgrouplist(alice, pw.pw_gid))
        env = _environ(rank)
        assert (env["HOME"], env["USER"], env["SECRET"]) == (pw.pw_dir, alice, "alice-env-secret")
        assert "SECRET" not in _environ(torchrun)  # [entry.env] is the ranks' only
        # her launch directory and token are hers alone; the agent's are root's
        for path, mode in ((a.work, 0o700), (a.work / "trainer.token", 0o600)):
            st = path.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (pw.pw_uid, mode), path
        for path, mode in ((launcher.root, 0o700), (a.dir, 0o700), (launcher.work, 0o711),
                           (base / "agent", 0o711)):
            st = path.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, mode), path

        # bob's rank tries alice's token, environment, output and record, and the agent's
        [segment] = a.output.segments()
        theirs = {p: p for p in (
            str(a.work / "trainer.token"), str(a.work / "env.json"), str(a.work),
            str(segment[1]), str(a.dir / "launch.json"), f"/proc/{rank}/environ",
            f"/proc/{torchrun}/environ", f"/proc/{os.getpid()}/environ", str(agent_token),
            str(launcher.root), str(launcher.work), str(base / "agent"))}
        theirs["signal A's rank (kill -0)"] = ""
        mine = str(launcher.work / "LB" / "trainer.token")  # its own: readable (the probe works)
        assert launcher.start(_order("LB", bob, PROBE, json.dumps({**theirs, "mine": mine}),
                                     str(rank)), {})
        b = wait_until("bob's probe to end", lambda: _ended(launcher, "LB"))
        assert b.exit_code == 0, b.reason
        [line] = [x for x in b.output.read_bytes().decode().splitlines() if "PROBE " in x]
        seen = json.loads(line.split("PROBE ", 1)[1])
        assert seen.pop("mine").startswith("READ "), seen
        assert seen == {p: "denied (PermissionError)" for p in theirs}
        # (command lines stay public on Linux: docs/operating.md says so)

        assert launcher.stop("LA")
        wait_until("alice's launch to end", lambda: _ended(launcher, "LA"))
        wait_until("her processes gone", lambda: all(proc_stat(p) is None
                                                     for p in (torchrun, wrapper, rank)))
        assert not (a.work / "trainer.token").exists()


def test_a_launch_that_cannot_run_as_its_owner_fails_saying_why(tmp_path: Path) -> None:
    with shared_dir() as base, unix_users(1) as (alice,):
        launcher = StandIn(base / "agent", host="h", daemon="127.0.0.1:1")
        cases = {
            "L1": (_order("L1", "", SLEEPER), "the job's owner has no unix_user"),
            "L2": (_order("L2", "nosuchuser42", SLEEPER), "'nosuchuser42' (the job owner's "
                                                          "unix_user) does not exist here"),
            "L3": (_order("L3", alice, SLEEPER, workdir="/root"), "may not use /root"),
        }
        for launch_id, (order, why) in cases.items():
            assert launcher.start(order, {})
            state = launcher.get(launch_id)
            assert state is not None and state.exit_code == 127 and state.pid == 0
            assert why in state.reason and "on h" in state.reason, state.reason
        # an agent that is not root cannot switch users: it refuses rather than run
        # alice's ranks as itself (run here as alice, on her own state dir)
        script = (f"import sys; sys.path[:0] = {sys.path!r}\n"
                  "from hetpilot.agents.launcher import Launcher\n"
                  "from hetpilot.v1 import agent_pb2\n"
                  "import os\n"
                  "l = Launcher(os.path.expanduser('~/agent'), host='h', daemon='d:1')\n"
                  "o = agent_pb2.LaunchOrder(launch_id='L9', job_id='j', command=['true'], "
                  f"unix_user={alice!r})\n"
                  "l.start(o, {}); print(l.get('L9').reason)\n")
        done = subprocess.run([sys.executable, "-c", script], user=alice,
                              group=pwd.getpwnam(alice).pw_gid, extra_groups=[],
                              capture_output=True, text=True, timeout=60, cwd="/",
                              env={**os.environ, "HOME": pwd.getpwnam(alice).pw_dir})
        assert done.returncode == 0, done.stderr
        assert "without CAP_SETUID and CAP_SETGID" in done.stdout
        assert 'run_as = "agent"' in done.stdout
        # a single-tenant host says so: then the agent's own user runs it
        single = StandIn(base / "agent2", host="h", daemon="d:1", run_as="agent")
        assert single.start(_order("L5", "", "print('hi')"), {})
        ended = wait_until("the launch to end", lambda: _ended(single, "L5"))
        assert ended.exit_code == 0 and b"[rank0]:hi\n" in ended.output.read_bytes()
