"""What one owner's rank can do to another owner's launch and to the agent from inside
(issue 37; bench/rank_attacks.py runs the whole campaign with real torchrun): files it
makes in shared folders are its owner's only, links it leaves in its launch folder
are never followed by the root agent, a disk it fills never loses a stop order, and
connections it holds to the agent's probe port never take the agent's file
descriptors. As root where users or a small file system are needed (made for the
test and removed after; skipped elsewhere with the reason)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from hetpilot.agents.launcher import Launcher, _proc_stat
from hetpilot.agents.launchstate import LaunchState
from hetpilot.agents.netprobe import MAX_CONNECTIONS, measure, start_probe_server

from .helpers import wait_until
from .sandbox import fill, shared_dir, small_fs, unix_users, why_no_users
from .test_launcher import FakeTorchrun, _pids
from .test_launcher import _order as agent_order
from .test_tenancy import StandIn
from .test_tenancy import _order as owner_order

pytestmark = pytest.mark.timeout(120)
needs_users = pytest.mark.skipif(bool(why_no_users()), reason=why_no_users() or "-")


def _ended(launcher: Launcher, launch_id: str) -> object:
    launcher.poll()
    state = launcher.get(launch_id)
    return state is not None and not state.running and state


MAKES_FILES = """
import json, os, stat, sys
made = {}
for path in sys.argv[1:]:
    with open(path, "w") as fh:  # Python's default: 0666 less the umask
        fh.write("secret")
    made[path] = stat.S_IMODE(os.stat(path).st_mode)
print("MADE " + json.dumps(made), flush=True)
"""


@needs_users
def test_files_a_rank_makes_in_tmp_and_dev_shm_are_its_owners_only() -> None:
    with shared_dir() as base, unix_users(1) as (alice,):
        launcher = StandIn(base / "agent", host="h", daemon="127.0.0.1:1")
        paths = [f"/tmp/{alice}-file", f"/dev/shm/{alice}-file"]
        old = os.umask(0o022)  # what a hand-started agent often has
        try:
            assert launcher.start(owner_order("LA", alice, MAKES_FILES, *paths), {})
        finally:
            os.umask(old)
        try:
            a = wait_until("alice's rank", lambda: _ended(launcher, "LA"))
            assert a.exit_code == 0, a.reason
            [line] = [x for x in a.output.read_bytes().decode().splitlines() if "MADE " in x]
            assert json.loads(line.split("MADE ", 1)[1]) == {p: 0o600 for p in paths}
        finally:
            for path in paths:
                Path(path).unlink(missing_ok=True)


LEAVES_LINKS = """
import os, sys
canary, folder = sys.argv[1:3]
for name in ("trainer.token", "env.json"):
    os.unlink(name)
    os.symlink(canary, name)
os.symlink(folder, "ranks/to-roots-folder")
os.symlink(folder, "to-roots-folder")
print("left", flush=True)
"""


@needs_users
def test_links_a_rank_leaves_in_its_folder_are_never_followed_by_the_agent() -> None:
    with shared_dir() as base, unix_users(1) as (bob,):
        folder = base / "roots"
        folder.mkdir(mode=0o700)
        canary = folder / "secret"
        canary.write_text("root's\n")
        launcher = StandIn(base / "agent", host="h", daemon="127.0.0.1:1", retention_s=0.0)
        assert launcher.start(owner_order("LB", bob, LEAVES_LINKS, str(canary), str(folder)),
                              {})
        b = wait_until("bob's rank", lambda: _ended(launcher, "LB"))
        assert b.exit_code == 0 and b"[rank0]:left\n" in b.output.read_bytes(), b.reason
        # the launch ended (its token and environment unlinked); the daemon has all of
        # it: retention 0 removes its folders
        launcher.acked([("LB", False)], launcher.chunks())
        assert launcher.clean(force=True) == ["LB"]
        assert not (launcher.work / "LB").exists() and not b.dir.exists()
        assert canary.read_text() == "root's\n" and sorted(os.listdir(folder)) == ["secret"]
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == 0


def test_a_stop_order_on_a_full_state_disk_still_stops_the_launch(tmp_path: Path) -> None:
    """Another owner's files can fill the agent's state disk (docs/operating.md): the
    record the agent cannot write then must not keep a launch running."""
    with small_fs(tmp_path, "4m") as disk:
        launcher = FakeTorchrun(disk / "agent", host="h", daemon="127.0.0.1:1",
                                stop_grace_s=1.0, run_as="agent")
        assert launcher.start(agent_order(), {})
        state = launcher.get("L1")
        assert state is not None and state.work is not None
        pids = _pids(state.work)
        filler = fill(disk)
        launcher.poll()  # finds the rank (a new process to record): the disk refuses
        assert launcher.stop("L1")
        ended = wait_until("the launch to end", lambda: _ended(launcher, "L1"))
        assert ended.stopped and ended.exit_code != 0
        wait_until("its processes gone", lambda: all(_proc_stat(p) is None for p in pids))
        filler.unlink()  # space returns: the record catches up
        launcher.poll()
        saved = LaunchState.load(state.dir)
        assert (saved.stopped, saved.exit_code) == (True, ended.exit_code)


async def _closed_by_the_agent(reader: asyncio.StreamReader, wait_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), wait_s) == b""
    except TimeoutError:
        return False  # still held open by the agent


def test_connections_past_the_cap_are_closed_at_once_by_the_probe_server() -> None:
    """A rank holding thousands of connections to the (root) agent's probe port would
    take its file descriptors (a service's soft limit is 1024) from its launches."""
    async def run() -> None:
        fds = len(os.listdir("/proc/self/fd"))
        server = await start_probe_server("127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        held = [await asyncio.open_connection("127.0.0.1", port)
                for _ in range(MAX_CONNECTIONS + 20)]
        closed = await asyncio.gather(*(_closed_by_the_agent(r, 1.0) for r, _ in held))
        assert sum(closed) == 20 and not any(closed[:MAX_CONNECTIONS])
        # what this process holds: the test's own ends, and the cap's on the agent's side
        assert len(os.listdir("/proc/self/fd")) - fds <= len(held) + MAX_CONNECTIONS + 4
        for _, writer in held:
            writer.close()
        server.close()

    asyncio.run(run())


def test_a_probe_connection_is_served_for_connection_s_at_most() -> None:
    async def run() -> None:
        server = await start_probe_server("127.0.0.1", 0, max_connections=2,
                                          connection_s=1.0)
        port = server.sockets[0].getsockname()[1]
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        with pytest.raises((OSError, asyncio.IncompleteReadError)):  # both slots taken
            await measure(f"127.0.0.1:{port}", nbytes=100_000)
        for reader, _ in held:  # idle: ended by the agent after connection_s
            assert await _closed_by_the_agent(reader, 30.0)
        gbps, rtt = await measure(f"127.0.0.1:{port}", nbytes=100_000)  # served again
        assert gbps > 0 and rtt > 0
        for _, writer in held:
            writer.close()
        server.close()

    asyncio.run(run())


def test_a_pickle_written_into_a_launchs_rendezvous_store_runs_no_code(
        tmp_path: Path) -> None:
    """torch's c10d store has no authentication and torchrun loads its rendezvous state
    from it with pickle: whoever reaches the port (another owner's rank) and reads the
    run id (the launch id, on torchrun's public command line) ran code as the job's
    owner. With real torchrun: the launch's torchrun refuses the pickle and ends."""
    import base64
    import pickle
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    launcher = Launcher(tmp_path / "agent", host="h", daemon="127.0.0.1:1", run_as="agent",
                        stop_grace_s=2.0)
    assert launcher.start(agent_order(nnodes=1, devices=["0"], rdzv_host=True,
                                      rdzv_endpoint=f"127.0.0.1:{port}", module="",
                                      args=[], command=[sys.executable, "-c", SLEEPS]), {})
    state = launcher.get("L1")
    assert state is not None
    wait_until("the rank", lambda: b"[rank0]:ready" in state.output.read_bytes(), timeout=90)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=timedelta(seconds=10))
    store.set("torch.rendezvous.L1", base64.b64encode(pickle.dumps(Payload())))
    ended = wait_until("torchrun to load it", lambda: marker.exists() or
                       _ended(launcher, "L1"), timeout=60)
    assert not marker.exists(), "the pickle ran code in the launch's torchrun"
    assert ended.exit_code != 0
    assert b"posix.system is not part of a rendezvous state" in ended.output.read_bytes()


SLEEPS = "import time; print('ready', flush=True); time.sleep(120)"


def test_torchruns_own_rendezvous_state_still_loads() -> None:
    import datetime
    import pickle

    from hetpilot.agents.torchrun import load_state
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    state = rdzv._RendezvousState()
    node = rdzv._NodeDesc("h", 1, 0)
    state.round, state.complete, state.deadline = 2, True, datetime.datetime.now()
    state.participants[node] = 0
    state.wait_list.add(node)
    state.last_heartbeats[node] = datetime.datetime.now(datetime.UTC)
    loaded = load_state(pickle.dumps(state))
    assert vars(loaded) == vars(state)
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.eval is not part"):
        load_state(pickle.dumps(eval))  # a global no state names


FLOODS = "import sys\nfor _ in range(2048):\n    sys.stdout.write('x' * 1023 + '\\n')\n"


def test_other_launches_floods_never_hold_back_a_launchs_output(tmp_path: Path) -> None:
    """Two launches (another owner's jobs) with megabytes of output waiting and one with
    a line: that line leaves with the next report, not after theirs."""
    launcher = StandIn(tmp_path / "agent", host="h", daemon="127.0.0.1:1", run_as="agent")
    for launch_id, code in (("F1", FLOODS), ("F2", FLOODS), ("Q", "print('hello')")):
        assert launcher.start(owner_order(launch_id, "", code), {})
    for launch_id in ("F1", "F2", "Q"):
        ended = wait_until(f"{launch_id} to end", lambda i=launch_id: _ended(launcher, i))
        assert ended.exit_code == 0, ended.reason
    reports = 0
    while True:
        reports += 1
        chunks = launcher.chunks()
        assert sum(len(c[2]) for c in chunks) <= 1024 * 1024
        if any(launch_id == "Q" for launch_id, _, _ in chunks):
            break
        launcher.acked([], chunks)
    assert reports == 1, f"the quiet launch's line waited {reports} reports"
