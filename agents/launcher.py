"""Launches on one host: the job ranks an agent starts on the daemon's orders.

A launch order (``ReportAck.start``, :mod:`hetpilot.daemon.launches`) becomes
one process tree in its own session::

    python -m hetpilot.agents.runner <dir>/exit -- \\
      python -m torch.distributed.run --nnodes N --nproc-per-node P \\
        --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id LAUNCH \\
        --rdzv-conf is_host=true|false --max-restarts R \\
        --log-dir <dir>/ranks --tee 3 [--local-addr ADDR] \\
        (-m MODULE | --no-python COMMAND...) ARGS...

under ``<state_dir>/launches/<launch_id>/``, which holds ``launch.json`` (the
record), ``output.log`` (everything torchrun and its ranks print: each rank's
lines carry ``[rank<R>]:``, its global rank, via
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), ``ranks/`` (torchrun's per-rank
files), ``trainer.token`` (0600, removed when the launch ends) and ``exit``
(written by :mod:`hetpilot.agents.runner`).

The ranks' environment is the agent's without its ``HETPILOT_*`` variables and
torchrun's own, plus the job's ``env``, plus ``HETPILOT_JOB_ID``,
``HETPILOT_LAUNCH_ID``, ``HETPILOT_ADDRESS`` (the daemon, as this agent reaches
it), ``HETPILOT_TOKEN_FILE`` (the job's trainer token: in a file, never on a
command line), ``HETPILOT_DEVICE_IDS`` (``host:index`` of each local rank,
comma-separated), ``HETPILOT_CA_FILE``/``CERT_FILE``/``KEY_FILE`` (the agent's
TLS files, if any), ``CUDA_VISIBLE_DEVICES`` (CUDA devices) and
``PYTHONUNBUFFERED=1`` (unless the job sets it).

Idempotent: a launch id is started at most once in the agent's life. Its
directory is made before anything starts, and a restarted agent reads every
directory back: a launch still running is adopted (watched by pid and start
time, stopped by process group), one that ended is reported with the status its
runner saved (255 when none was: it died with the agent's SIGKILL or the host).

Rendezvous port: on the host that runs the c10d store (``rdzv_host``) the port
of ``rdzv_endpoint`` is bound once (SO_REUSEADDR, as the store binds it) before
anything is made; if that fails the launch is not started and its id stays
unused: the next report says so (``LaunchStatus.rdzv_port_busy``, until an ack
takes it), and the daemon orders the launch again with another port.

Retention: a launch is *done* once it has exited and the daemon acknowledged
its exit and all of its output (``done_unix`` in ``launch.json``); its directory
is removed ``retention_s`` later (agent ``launch_retention_s``). Running, or
not acknowledged, it is never touched. Its id is first appended to
``launches/.removed`` (the tombstones, read back at start), so a restarted
agent neither adopts nor starts it again; the directory is renamed to
``.trash-<id>`` and deleted (a restart finishes a deletion it cut short).

Stopping: SIGTERM to the launch's process group (runner and torchrun; torchrun
stops its ranks) and to each rank's own group (torchrun starts ranks in their
own sessions); after ``stop_grace_s``, SIGKILL to all of them. The ranks are
found as the launch's descendants in ``/proc`` and remembered with their start
time, so they are killed even after torchrun is gone, and a reused pid never is.
A launch's ranks that outlive its torchrun are killed too.

Everything here runs on the agent's event loop and never blocks long (Popen,
small file reads and writes, one ``/proc`` scan a second while launches run).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EXIT_UNKNOWN", "LaunchState", "Launcher", "descendants", "port_in_use",
           "process_table"]

log = logging.getLogger("hetpilot.agent")

EXIT_UNKNOWN = 255
"""Reported when the exit status was lost (see the module docstring)."""
CANNOT_START = 127
MAX_CHUNK = 512 * 1024
"""Output bytes of one launch per report."""
MAX_REPORT_BYTES = 1024 * 1024
"""Output bytes of all launches per report."""
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "MASTER_ADDR", "MASTER_PORT")
PREFIX_TEMPLATE = "[rank${rank}]:"
"""torchrun's prefix of each rank's lines: the global rank (``hetpilot logs --rank``)."""
TOMBSTONES = ".removed"
"""Ids of the launches whose directories were removed (one per line)."""
MAX_TOMBSTONES = 100_000
"""Beyond this many, the oldest half is forgotten (the daemon never orders a launch
again once it was reported)."""


def port_in_use(port: int) -> str | None:
    """Why ``port`` cannot be listened on here (on every address, with SO_REUSEADDR, as
    torchrun's c10d store does), or None when it can."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((address, port))
                sock.listen(1)
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (errno.EAFNOSUPPORT,
                                                           errno.EADDRNOTAVAIL):  # no IPv6
                continue
            return exc.strerror or str(exc)
    return None


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) "
    try:
        if fields[0] == "Z":  # a zombie is gone for our purposes
            return None
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


_Table = tuple[dict[int, int], dict[int, list[tuple[int, int]]]]


def process_table() -> _Table:
    """One scan of /proc: (pid -> start ticks, parent pid -> [(child, start ticks)])."""
    children: dict[int, list[tuple[int, int]]] = {}
    live: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return live, children
    for name in names:
        if not name.isdigit():
            continue
        st = _proc_stat(int(name))
        if st is not None:
            live[int(name)] = st[1]
            children.setdefault(st[0], []).append((int(name), st[1]))
    return live, children


def descendants(roots: Mapping[int, int], table: _Table | None = None) -> dict[int, int]:
    """Every live descendant of ``roots`` (pid -> start ticks; a root whose start time
    differs is not ours), as pid -> start ticks (``table``: a scan already made)."""
    live, children = table if table is not None else process_table()
    found: dict[int, int] = {}
    todo = [pid for pid, ticks in roots.items() if live.get(pid) == ticks]
    while todo:
        for child, ticks in children.get(todo.pop(), ()):
            if child not in found:
                found[child] = ticks
                todo.append(child)
    return found


def _signal(pid: int, ticks: int, sig: int) -> None:
    """``sig`` to ``pid``'s process group (to ``pid`` if it leads none), if ``pid`` is
    still the process that started at ``ticks``."""
    st = _proc_stat(pid)
    if pid <= 1 or st is None or (ticks and st[1] != ticks):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
                return
        except ProcessLookupError:
            return
        os.kill(pid, sig)


@dataclass
class LaunchState:
    """One launch as the agent knows it (``launch.json`` holds the persisted fields)."""

    launch_id: str
    job_id: str
    dir: Path
    pid: int = 0
    start_ticks: int = 0
    exit_code: int | None = None
    reason: str = ""
    stopped: bool = False
    done: bool = False
    """Its exit and all of its output reached the daemon: no longer reported."""
    done_unix: float = 0.0
    """When it became done (wall clock): its directory goes ``retention_s`` later."""
    shipped: int = 0
    """Output bytes the daemon has acknowledged (not persisted: the daemon skips a
    resent chunk)."""
    proc: subprocess.Popen[bytes] | None = None
    kill_at: float | None = None
    tree: dict[int, int] = field(default_factory=dict)
    """Descendants seen (pid -> start ticks): the ranks, to stop even without torchrun."""

    _PERSISTED = ("launch_id", "job_id", "pid", "start_ticks", "exit_code", "reason",
                  "stopped", "done", "done_unix")

    @property
    def output(self) -> Path:
        return self.dir / "output.log"

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def output_bytes(self) -> int:
        try:
            return self.output.stat().st_size
        except OSError:
            return 0

    def save(self) -> None:
        data = {k: getattr(self, k) for k in self._PERSISTED}
        data["tree"] = {str(k): v for k, v in self.tree.items()}
        tmp = self.dir / "launch.json.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.dir / "launch.json")

    @classmethod
    def load(cls, directory: Path) -> LaunchState:
        data = json.loads((directory / "launch.json").read_text())
        state = cls(dir=directory, **{k: data[k] for k in cls._PERSISTED if k in data})
        state.tree = {int(k): int(v) for k, v in data.get("tree", {}).items()}
        return state


class StateDirInUse(OSError):
    """Another live agent process holds the state directory."""


def lock_state_dir(state_dir: Path) -> Any:
    """Hold ``<state_dir>/agent.lock`` (flock, released when this process ends) and
    write our pid into it; :class:`StateDirInUse` if another process holds it.

    Two agents on one state directory would both start each ordered launch (each
    knows only the launch ids it read at its start) and report each other's as
    unknown. The lock's file descriptor is not inherited by launches, which outlive
    the agent and must not keep its successor out."""
    state_dir.mkdir(parents=True, exist_ok=True)
    handle = open(state_dir / "agent.lock", "a+")  # noqa: SIM115 (held for the process)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.seek(0)
        holder = handle.read().strip()[:20] or "unknown"
        handle.close()
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise StateDirInUse(
            f"state dir {state_dir}: another hetpilot agent (pid {holder}) uses it; stop "
            "that agent, or give this one another --state-dir (and --host)") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


class Launcher:
    """The launches of one agent (see the module docstring)."""

    def __init__(self, state_dir: Path, *, host: str, daemon: str, python: str = "",
                 stop_grace_s: float = 10.0, local_addr: str = "",
                 tls: Mapping[str, str] | None = None,
                 retention_s: float = 86400.0) -> None:
        self.root = Path(state_dir).absolute() / "launches"  # the ranks' cwd is elsewhere
        self.host = host
        self.daemon = daemon
        self.python = python or sys.executable
        self.stop_grace_s = stop_grace_s
        self.retention_s = retention_s
        self.local_addr = local_addr
        self.tls = {k: os.path.abspath(v) for k, v in (tls or {}).items() if v}
        self._launches: dict[str, LaunchState] = {}
        self._removed: set[str] = set()
        self._tombstones = 0
        self._refused: dict[str, tuple[str, int, str]] = {}
        """Launch ids not started for a busy rendezvous port: (job id, port, reason)."""
        self._scanned = 0.0
        self._cleaned = 0.0
        self._load()

    # -- state ------------------------------------------------------------------

    def _load(self) -> None:
        """Every launch this host's agents started before (in any order of restarts)."""
        if not self.root.is_dir():
            return
        try:
            lines = (self.root / TOMBSTONES).read_text().split()
        except FileNotFoundError:
            lines = []
        self._removed = set(lines)
        self._tombstones = len(lines)
        for directory in sorted(self.root.iterdir()):
            if directory.name.startswith(".trash-") and directory.is_dir():
                shutil.rmtree(directory, ignore_errors=True)  # a removal cut short
                continue
            if not directory.is_dir() or not _SAFE_ID.fullmatch(directory.name):
                continue
            if directory.name in self._removed:  # cut short before its rename
                self._delete(directory)
                continue
            try:
                state = LaunchState.load(directory)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                # made, but its record is unreadable: known, so never started again
                state = LaunchState(launch_id=directory.name, job_id="unknown", dir=directory,
                                    exit_code=EXIT_UNKNOWN, done=True,
                                    reason=f"unreadable launch record: {exc}")
                log.warning("launch %s: %s", directory.name, state.reason)
            self._launches[state.launch_id] = state
            if state.done and not state.done_unix:  # (an older agent's record)
                state.done_unix = time.time()
            if state.running:
                code = self._saved_exit(state)
                if code is not None:
                    self._ended(state, code)
                elif state.pid and _proc_stat(state.pid) is not None and (
                        _proc_stat(state.pid) or (0, -1))[1] == state.start_ticks:
                    log.info("launch %s (job %s): still running (pid %d): watching it again",
                             state.launch_id, state.job_id, state.pid)
                    if state.stopped:  # it was being stopped: SIGKILL after a grace period
                        state.kill_at = time.monotonic() + self.stop_grace_s
                else:
                    self._ended(state, EXIT_UNKNOWN, "exit status lost: the agent restarted "
                                "while the launch ran and no status was saved")

    def __contains__(self, launch_id: str) -> bool:
        return launch_id in self._launches

    def get(self, launch_id: str) -> LaunchState | None:
        return self._launches.get(launch_id)

    def running(self) -> list[LaunchState]:
        return [s for s in self._launches.values() if s.running]

    @staticmethod
    def _saved_exit(state: LaunchState) -> int | None:
        try:
            return int((state.dir / "exit").read_text().strip())
        except (OSError, ValueError):
            return None

    # -- orders -----------------------------------------------------------------

    def start(self, order: Any, device_kinds: Mapping[str, str]) -> bool:
        """Start ``order`` (an ``agent_pb2.LaunchOrder``) unless its launch id was ever
        started here, or it would run the rendezvous store on a port in use here (then
        :meth:`refusals` says so until :meth:`acked`); True when it started something."""
        launch_id = order.launch_id
        if launch_id in self._launches:
            return False
        if launch_id in self._removed:
            log.warning("launch %s (job %s): ordered again after it ended and its directory "
                        "was removed: ignored", launch_id[:80], order.job_id[:80])
            return False
        if not _SAFE_ID.fullmatch(launch_id) or ".." in launch_id:
            log.warning("launch order with a bad id %r: ignored", launch_id[:80])
            return False
        if order.rdzv_host and self._port_busy(order):
            return False
        self._refused.pop(launch_id, None)
        try:
            return self._start(order, device_kinds)
        except OSError as exc:  # the state dir (full, read-only): report it as a failed start
            state = self._launches.get(launch_id)
            if state is None:
                state = self._launches[launch_id] = LaunchState(
                    launch_id=launch_id, job_id=order.job_id, dir=self.root / launch_id)
            if state.running and state.proc is None:
                self._ended(state, CANNOT_START, f"cannot start on {self.host}: {exc}")
            return True

    def _port_busy(self, order: Any) -> bool:
        """Whether the rendezvous port of ``order`` is in use here (noted for the daemon)."""
        try:
            port = int(order.rdzv_endpoint.rpartition(":")[2])
        except ValueError:
            return False  # torchrun says what is wrong with it
        if not 0 < port < 65536:
            return False
        why = port_in_use(port)
        if why is None:
            return False
        reason = (f"rendezvous port {port} is in use on {self.host} ({why}): "
                  "not started, for the daemon to try another port")
        if self._refused.get(order.launch_id, ("", 0, ""))[1] != port:
            log.warning("launch %s (job %s): %s", order.launch_id, order.job_id, reason)
        self._refused[order.launch_id] = (order.job_id, port, reason)
        return True

    def refusals(self) -> list[tuple[str, str, int, str]]:
        """Launches not started for a busy rendezvous port, to report:
        (launch id, job id, port, reason)."""
        return [(i, job, port, why) for i, (job, port, why) in self._refused.items()]

    def _start(self, order: Any, device_kinds: Mapping[str, str]) -> bool:
        launch_id = order.launch_id
        directory = self.root / launch_id
        if directory.exists():  # made by an earlier agent whose record is gone: never twice
            self._launches[launch_id] = LaunchState(
                launch_id=launch_id, job_id=order.job_id, dir=directory,
                exit_code=EXIT_UNKNOWN, reason="launch directory existed without a record")
            return False
        directory.mkdir(parents=True)
        state = LaunchState(launch_id=launch_id, job_id=order.job_id, dir=directory)
        self._launches[launch_id] = state
        state.save()  # before anything starts: a crash from here on never starts it again
        devices = list(order.devices)
        first = order.module or (order.command[0] if order.command else "")
        if not first or first.startswith("-"):  # never one of torchrun's own options
            self._ended(state, CANNOT_START, f"entry {first[:60]!r} is not a module or a "
                                             "command (empty, or starts with '-')")
            return True
        cwd = order.workdir or str(directory)
        if not os.path.isdir(cwd):
            self._ended(state, CANNOT_START, f"workdir {cwd} is not a directory on {self.host}")
            return True
        token = directory / "trainer.token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(order.trainer_token + "\n")
        command = [self.python, "-m", "hetpilot.agents.runner", str(directory / "exit"), "--",
                   *self.torchrun(order, directory)]
        env = self.environment(order, token, devices, device_kinds)
        try:
            with open(state.output, "ab") as out:
                state.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                              start_new_session=True)
        except OSError as exc:
            self._ended(state, CANNOT_START, f"cannot start {self.python}: {exc}")
            return True
        state.pid = state.proc.pid
        stat = _proc_stat(state.pid)
        state.start_ticks = stat[1] if stat is not None else 0
        state.save()
        log.info("launch %s (job %s): started %d rank(s) on device(s) %s, rendezvous %s%s "
                 "(pid %d, output %s)", launch_id, order.job_id, len(devices),
                 ",".join(devices), order.rdzv_endpoint,
                 " (hosting the store)" if order.rdzv_host else "", state.pid, state.output)
        return True

    def torchrun(self, order: Any, directory: Path) -> list[str]:
        cmd = [self.python, "-m", "torch.distributed.run", "--nnodes", str(order.nnodes),
               "--nproc-per-node", str(len(order.devices)), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", order.rdzv_endpoint, "--rdzv-id", order.launch_id,
               "--rdzv-conf", f"is_host={'true' if order.rdzv_host else 'false'}",
               "--max-restarts", str(order.max_restarts), "--log-dir", str(directory / "ranks"),
               "--tee", "3"]
        if self.local_addr:
            cmd += ["--local-addr", self.local_addr]
        if order.module:
            return [*cmd, "-m", order.module, *order.args]
        return [*cmd, "--no-python", *order.command, *order.args]

    def environment(self, order: Any, token: Path, devices: list[str],
                    device_kinds: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HETPILOT_", "TORCHELASTIC_")) and k not in _TORCHRUN_ENV}
        env["PYTHONUNBUFFERED"] = "1"
        env.update(order.env)
        env.update({
            "HETPILOT_JOB_ID": order.job_id, "HETPILOT_LAUNCH_ID": order.launch_id,
            "HETPILOT_ADDRESS": self.daemon, "HETPILOT_TOKEN_FILE": str(token),
            "HETPILOT_DEVICE_IDS": ",".join(f"{self.host}:{d}" for d in devices),
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": PREFIX_TEMPLATE})
        for key, value in self.tls.items():
            env[f"HETPILOT_{key.upper()}"] = value
        if devices and all(device_kinds.get(d) == "cuda" for d in devices):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        return env

    def stop(self, launch_id: str) -> bool:
        """SIGTERM the launch's processes (SIGKILL after the grace period); True when it
        was running and is stopping now."""
        state = self._launches.get(launch_id)
        if state is None or not state.running or state.stopped:
            return False
        state.stopped = True
        self._refresh_trees(force=True)
        state.save()
        for pid, ticks in [(state.pid, state.start_ticks), *state.tree.items()]:
            _signal(pid, ticks, signal.SIGTERM)
        state.kill_at = time.monotonic() + self.stop_grace_s
        log.info("launch %s (job %s): stopping on the daemon's order: SIGTERM to %d "
                 "process(es), SIGKILL in %g s", launch_id, state.job_id, 1 + len(state.tree),
                 self.stop_grace_s)
        return True

    # -- watching ---------------------------------------------------------------

    def poll(self) -> None:
        """Reap launches that ended, SIGKILL those past their stop grace, note the ranks
        of those running and remove the directories past their retention (once a
        second)."""
        self._refresh_trees()
        self.clean()
        now = time.monotonic()
        for state in self.running():
            code: int | None = None
            if state.proc is not None:
                rc = state.proc.poll()
                if rc is not None:
                    saved = self._saved_exit(state)
                    code = saved if saved is not None else rc
            elif _proc_stat(state.pid) is None or (
                    (_proc_stat(state.pid) or (0, 0))[1] != state.start_ticks):
                saved = self._saved_exit(state)
                code = saved if saved is not None else EXIT_UNKNOWN
            if code is None:
                if state.kill_at is not None and now >= state.kill_at:
                    log.warning("launch %s (job %s): still running %g s after SIGTERM: "
                                "SIGKILL", state.launch_id, state.job_id, self.stop_grace_s)
                    self._kill(state)
                    state.kill_at = None
                continue
            self._ended(state, code)

    def _refresh_trees(self, force: bool = False) -> None:
        running = [s for s in self.running() if s.pid]
        if not running or (not force and time.monotonic() - self._scanned < 1.0):
            return
        self._scanned = time.monotonic()
        table = process_table()
        for state in running:
            found = descendants({state.pid: state.start_ticks}, table)
            if set(found) - set(state.tree):
                state.tree.update(found)
                state.save()

    def clean(self, force: bool = False) -> list[str]:
        """Remove the directories of launches done ``retention_s`` ago (at most once a
        second unless ``force``); their ids."""
        if not force and time.monotonic() - self._cleaned < 1.0:
            return []
        self._cleaned = time.monotonic()
        now = time.time()
        due = [s for s in self._launches.values()
               if s.done and not s.running and now - s.done_unix >= self.retention_s]
        for state in due:
            try:
                self._tombstone(state.launch_id)
            except OSError as exc:  # not recorded: not removed (it could start again)
                log.warning("launch %s: cannot record its removal: %s", state.launch_id, exc)
                return []
            self._delete(state.dir)
            del self._launches[state.launch_id]
            log.info("launch %s (job %s): directory removed (ended and acknowledged %.0f s "
                     "ago; launch_retention_s %g)", state.launch_id, state.job_id,
                     now - state.done_unix, self.retention_s)
        return [s.launch_id for s in due]

    def _tombstone(self, launch_id: str) -> None:
        path = self.root / TOMBSTONES
        if self._tombstones >= MAX_TOMBSTONES:  # keep the newest half
            lines = path.read_text().split()[-MAX_TOMBSTONES // 2:]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(f"{i}\n" for i in lines))
            os.replace(tmp, path)
            self._removed = set(lines)
            self._tombstones = len(lines)
        with open(path, "a") as fh:
            fh.write(f"{launch_id}\n")
        self._removed.add(launch_id)
        self._tombstones += 1

    def _delete(self, directory: Path) -> None:
        trash = directory.with_name(f".trash-{directory.name}")
        try:
            os.replace(directory, trash)
        except OSError:
            trash = directory
        shutil.rmtree(trash, ignore_errors=True)

    def _kill(self, state: LaunchState) -> None:
        for pid, ticks in [(state.pid, state.start_ticks), *state.tree.items()]:
            _signal(pid, ticks, signal.SIGKILL)

    def _ended(self, state: LaunchState, code: int, reason: str = "") -> None:
        state.exit_code = code
        if state.proc is not None:
            state.proc = None
        leftover = {p: t for p, t in state.tree.items()
                    if (_proc_stat(p) or (0, -1))[1] == t}
        if leftover:  # ranks outliving their torchrun (killed, or wedged): not for long
            log.warning("launch %s (job %s): %d process(es) outlived it: SIGKILL",
                        state.launch_id, state.job_id, len(leftover))
            for pid, ticks in leftover.items():
                _signal(pid, ticks, signal.SIGKILL)
        if code != 0:
            state.reason = reason or ("stopped on the daemon's order" if state.stopped
                                      else self._why(state))
        with contextlib.suppress(OSError):
            (state.dir / "trainer.token").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            state.save()
        log.info("launch %s (job %s): exited with code %d%s", state.launch_id, state.job_id,
                 code, " (stopped on order)" if state.stopped else "")

    @staticmethod
    def _why(state: LaunchState) -> str:
        """The last lines of the launch's output: its ranks' lines when there are any
        (torchrun's own summary of a failure says little more)."""
        try:
            with open(state.output, "rb") as fh:
                fh.seek(max(0, state.output_bytes() - 32768))
                lines = [line for line in fh.read().decode("utf-8", "replace").splitlines()
                         if line.strip()]
        except OSError:
            lines = []
        ranks = [line for line in lines if line.startswith("[rank")]
        tail = (ranks or lines)[-8:]
        return "\n".join(line[:240] for line in tail)[-1900:] or "no output"

    # -- reports ----------------------------------------------------------------

    def statuses(self) -> list[LaunchState]:
        """Launches to report: all but those the daemon has fully acknowledged."""
        return [s for s in self._launches.values() if not s.done]

    def chunks(self) -> list[tuple[str, int, bytes]]:
        """New output to ship: (launch id, offset, bytes), at most MAX_REPORT_BYTES."""
        out: list[tuple[str, int, bytes]] = []
        budget = MAX_REPORT_BYTES
        for state in self.statuses():
            if budget <= 0:
                break
            size = state.output_bytes()
            if size <= state.shipped:
                continue
            try:
                with open(state.output, "rb") as fh:
                    fh.seek(state.shipped)
                    data = fh.read(min(MAX_CHUNK, budget, size - state.shipped))
            except OSError:
                continue
            if data:
                out.append((state.launch_id, state.shipped, data))
                budget -= len(data)
        return out

    def acked(self, statuses: list[tuple[str, bool]],
              chunks: list[tuple[str, int, bytes]],
              refusals: Sequence[tuple[str, int]] = ()) -> None:
        """The daemon took a report with these (launch id, running) states, chunks and
        (launch id, port) refusals: the output is shipped, the refusals told, and a
        launch whose exit and whole output it has is done."""
        for launch_id, port in refusals:
            if self._refused.get(launch_id, ("", 0, ""))[1] == port:
                del self._refused[launch_id]
        for launch_id, offset, data in chunks:
            state = self._launches.get(launch_id)
            if state is not None:
                state.shipped = max(state.shipped, offset + len(data))
        for launch_id, running in statuses:
            state = self._launches.get(launch_id)
            if state is not None and not running and not state.running and not state.done \
                    and state.shipped >= state.output_bytes():
                state.done = True
                state.done_unix = time.time()
                with contextlib.suppress(OSError):
                    state.save()
