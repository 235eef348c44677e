"""Launches on one host: the job ranks an agent starts on the daemon's orders.

A launch order (``ReportAck.start``, :mod:`hetpilot.daemon.launches`) becomes
one process tree in its own session::

    python -m hetpilot.agents.runner --exit <dir>/exit --output <dir>/output \\
        --output-bytes CAP --parent AGENT_PID [--uid U --gid G --groups ...] -- \\
      python -m hetpilot.agents.torchrun --nnodes N --nproc-per-node P \\
        --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id LAUNCH \\
        --rdzv-conf is_host=true|false --max-restarts R \\
        --log-dir <work>/ranks [--local-addr ADDR] --no-python \\
      python -m hetpilot.agents.rankio <work>/env.json -- \\
        (python -u -m MODULE | COMMAND...) ARGS...

Who runs it (``run_as``). ``"owner"`` (the default): the runner stays the agent's
user (root) and starts torchrun, and so the ranks, as the order's ``unix_user``
(the job owner's, from the daemon's owner tokens file): its uid, gid,
supplementary groups and HOME. A launch without one, or on an agent that cannot
switch users (not root, no CAP_SETUID/CAP_SETGID), or for a user unknown here or
root, is not started: it ends with 127 and a reason naming why, and the daemon
fails its job with it. ``"agent"``: every launch runs as the agent's own user (a
host whose owners trust each other).

Two directories per launch. ``<state_dir>/launches/<id>/`` is the agent's (0700,
inside ``launches/`` 0700): ``launch.json`` (the record), ``exit`` (written by
:mod:`hetpilot.agents.runner`), ``runner.log`` (the runner's own errors) and
``output/`` (everything torchrun and its ranks print, once, capped at
``output_bytes``: :mod:`hetpilot.agents.output`; each rank's lines carry
``[rank<R>]:``, its global rank, from :mod:`hetpilot.agents.rankio`).
``<state_dir>/work/<id>/`` is the ranks' (owned by their user, 0700, inside
``work/`` 0711, which no one else may list): ``trainer.token`` and ``env.json``
(0600, removed when the launch ends), ``ranks/`` (torchrun's files) and the
ranks' working directory unless the job names one (which the user must be able
to enter). The state directory itself is 0711.

The environment of the runner and torchrun is the agent's without its
``HETPILOT_*`` variables and torchrun's own, plus ``HETPILOT_JOB_ID``,
``HETPILOT_LAUNCH_ID``, ``HETPILOT_ADDRESS`` (the daemon, as this agent reaches
it), ``HETPILOT_TOKEN_FILE`` (the job's trainer token: in a file, never on a
command line), ``HETPILOT_DEVICE_IDS`` (``host:index`` of each local rank,
comma-separated), ``HETPILOT_CA_FILE`` (and, when the ranks run as the agent's
user, ``CERT_FILE``/``KEY_FILE``: the agent's TLS files, if any),
``CUDA_VISIBLE_DEVICES`` (CUDA devices), ``PYTHONUNBUFFERED=1`` and, for an
owner's user, her ``HOME``, ``USER`` and ``LOGNAME``. The job's ``env`` reaches
the ranks only (rankio sets it), never the runner or torchrun, and cannot
replace the variables above or torchrun's.

Limits: each launch gets a cgroup of its own (:mod:`hetpilot.agents.cgroups`) with
the agent's ``[launch]`` ``memory_max`` and ``tasks_max``; the runner joins it before
it starts torchrun. When the launch ends, whatever is left in it is killed and it is
removed; a launch that failed after a limit ended some of its processes says which
(first line of its reason). Where no usable hierarchy exists the agent says so at
start and launches without limits, or refuses every launch naming why when
``require_limits`` is set.

Tied to the agent: the runner gets a signal from the kernel when the agent ends
and ends the launch's processes within a few seconds
(:mod:`hetpilot.agents.runner`); a launch never outlives its agent.

Idempotent: a launch id is started at most once in the agent's life. Its
directory is made before anything starts, and a restarted agent reads every
directory back: a launch still running (its runner still ending it) is watched
until it ends; one that ended is reported with the status its runner saved (255
when none was: it died with SIGKILL or the host), and any of its processes still
alive are killed.

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
``.trash-<id>`` and deleted, and so is its work directory (a restart finishes a
deletion it cut short).

Stopping: SIGTERM to the launch's process group (runner and torchrun; torchrun
stops its ranks) and to each rank's own group (torchrun starts ranks in their
own sessions); after ``stop_grace_s``, SIGKILL to all of them. The ranks are
found as the launch's descendants in ``/proc`` and remembered with their start
time, so they are killed even after torchrun is gone, and a reused pid never is.
A launch's ranks that outlive its torchrun are killed too.

torchrun is torch's own, under :mod:`hetpilot.agents.torchrun`: its rendezvous loads
no pickle but a rendezvous state, so whoever reaches the c10d store's port cannot run
code as the launch's user through it.

The records, tombstones and lock are :mod:`hetpilot.agents.launchstate`'s; the
command lines and environments :mod:`hetpilot.agents.launchcmd`'s.

Everything here runs on the agent's event loop and never blocks long (Popen,
small file reads and writes, one ``/proc`` scan a second while launches run).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .cgroups import LaunchGroups, Limits
from .config import RUN_AS
from .launchcmd import (
    job_env,
    port_in_use,
    rank_command,
    runner_command,
    runner_env,
    torchrun_command,
)
from .launchstate import EXIT_UNKNOWN, LaunchState, Tombstones, delete_dir
from .output import DEFAULT_CAP
from .owner import User, cannot_enter, owner_user, private_dirs, write_private
from .procs import descendants, process_table
from .procs import proc_stat as _proc_stat
from .procs import signal_process as _signal

__all__ = ["EXIT_UNKNOWN", "LaunchState", "Launcher", "descendants", "port_in_use",
           "process_table"]

log = logging.getLogger("hetpilot.agent")

CANNOT_START = 127
MAX_CHUNK = 512 * 1024
"""Output bytes of one launch per report."""
MAX_REPORT_BYTES = 1024 * 1024
"""Output bytes of all launches per report."""
MIN_SHARE = 64 * 1024
"""The least one launch's share of a report's output (when many launches have output)."""
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
AGENT_GONE_GRACE_S = 3.0
"""Once its agent is gone, a launch's processes get SIGTERM, then SIGKILL this much later
(at most: the agent's stop grace when shorter)."""


class Launcher:
    """The launches of one agent (see the module docstring)."""

    def __init__(self, state_dir: Path, *, host: str, daemon: str, python: str = "",
                 stop_grace_s: float = 10.0, local_addr: str = "",
                 tls: Mapping[str, str] | None = None,
                 retention_s: float = 86400.0, run_as: str = "owner",
                 output_bytes: int = DEFAULT_CAP, limits: Limits | None = None,
                 require_limits: bool = False, cgroups: LaunchGroups | None = None) -> None:
        if run_as not in RUN_AS:
            raise ValueError(f"run_as: must be one of {', '.join(RUN_AS)}, got {run_as!r}")
        base = Path(state_dir).absolute()
        self.root = base / "launches"  # the agent's: records, exit statuses, output
        self.work = base / "work"  # the ranks': one directory each, their user's
        private_dirs(base, self.root, self.work)
        self.run_as = run_as
        self.output_cap = output_bytes
        self.host = host
        self.daemon = daemon
        self.python = python or sys.executable
        self.stop_grace_s = stop_grace_s
        self.retention_s = retention_s
        self.local_addr = local_addr
        self.tls = {k: os.path.abspath(v) for k, v in (tls or {}).items() if v}
        self._launches: dict[str, LaunchState] = {}
        self._removed = Tombstones(self.root)
        self._refused: dict[str, tuple[str, int, str]] = {}
        """Launch ids not started for a busy rendezvous port: (job id, port, reason)."""
        self._scanned = 0.0
        self._cleaned = 0.0
        self._rotation = 0
        """Which launch with output waiting the next report starts with."""
        self.require_limits = require_limits
        self.cgroups = cgroups if cgroups is not None else LaunchGroups(base, limits or Limits())
        """Each launch's cgroup and limits (:mod:`hetpilot.agents.cgroups`)."""
        self._load()
        self.cgroups.sweep(s.launch_id for s in self.running())
        said = self.cgroups.status()
        if self.cgroups.why_not() and (self.cgroups.limits.controllers() or require_limits):
            log.warning("%s: %s", said, "launches are refused" if require_limits
                        else "launches run without them")
        else:
            log.info("%s", said)

    # -- state ------------------------------------------------------------------

    def _load(self) -> None:
        """Every launch this host's agents started before (in any order of restarts)."""
        for directory in self.work.iterdir():
            if directory.name.startswith(".trash-") and directory.is_dir():
                shutil.rmtree(directory, ignore_errors=True)  # a removal cut short
        if not self.root.is_dir():
            return
        for directory in sorted(self.root.iterdir()):
            if directory.name.startswith(".trash-") and directory.is_dir():
                shutil.rmtree(directory, ignore_errors=True)  # a removal cut short
                continue
            if not directory.is_dir() or not _SAFE_ID.fullmatch(directory.name):
                continue
            if directory.name in self._removed:  # cut short before its rename
                delete_dir(directory)
                delete_dir(self.work / directory.name)
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
                code = saved_exit(state)
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
        directory.mkdir(mode=0o700)
        work = self.work / launch_id
        state = LaunchState(launch_id=launch_id, job_id=order.job_id, dir=directory, work=work)
        self._launches[launch_id] = state
        state.save()  # before anything starts: a crash from here on never starts it again
        devices = list(order.devices)
        first = order.module or (order.command[0] if order.command else "")
        if not first or first.startswith("-"):  # never one of torchrun's own options
            self._ended(state, CANNOT_START, f"entry {first[:60]!r} is not a module or a "
                                             "command (empty, or starts with '-')")
            return True
        who = self.identity(order)
        if isinstance(who, str):
            self._ended(state, CANNOT_START, f"not started on {self.host}: {who}")
            return True
        state.user = who.name if who is not None else ""
        if work.exists():  # the rest of a launch directory never recorded: not ours
            shutil.rmtree(work, ignore_errors=True)
        work.mkdir(mode=0o700)
        token = work / "trainer.token"
        write_private(token, order.trainer_token + "\n")
        env_file = work / "env.json"
        write_private(env_file, json.dumps(job_env(order)))
        (work / "ranks").mkdir(mode=0o700)
        if who is not None:  # the ranks' files are their user's; the directory last
            for path in (token, env_file, work / "ranks", work):
                os.chown(path, who.uid, who.gid, follow_symlinks=False)
        cwd = order.workdir or str(work)
        why = cannot_enter(Path(cwd), who) if who is not None else (
            "" if os.path.isdir(cwd) else "is not a directory")
        if why:
            self._ended(state, CANNOT_START, f"workdir {cwd} on {self.host}: {why}")
            return True
        cgroups = self._cgroup(state)
        if isinstance(cgroups, str):
            self._ended(state, CANNOT_START, f"not started on {self.host}: {cgroups}")
            return True
        command = [*runner_command(self.python, directory, output_cap=self.output_cap,
                                   grace_s=min(self.stop_grace_s, AGENT_GONE_GRACE_S),
                                   who=who, cgroups=cgroups), "--", *self.torchrun(order, work)]
        env = runner_env(order, host=self.host, daemon=self.daemon, token=token,
                         devices=devices, device_kinds=device_kinds, tls=self.tls, who=who)
        try:
            with open(directory / "runner.log", "ab") as out:  # the runner's own errors
                state.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                              start_new_session=True)
        except OSError as exc:
            self._ended(state, CANNOT_START, f"cannot start {self.python}: {exc}")
            return True
        state.pid = state.proc.pid
        stat_ = _proc_stat(state.pid)
        state.start_ticks = stat_[1] if stat_ is not None else 0
        self._save(state)  # it runs: a full disk does not undo that
        log.info("launch %s (job %s): started %d rank(s) on device(s) %s as %s, rendezvous "
                 "%s%s (pid %d)", launch_id, order.job_id, len(devices), ",".join(devices),
                 f"user {who.name}" if who is not None else "the agent's user",
                 order.rdzv_endpoint, " (hosting the store)" if order.rdzv_host else "",
                 state.pid)
        return True

    def _cgroup(self, state: LaunchState) -> list[Path] | str:
        """The launch's cgroup directories, made with the limits the hierarchy can hold
        (none where there is no usable one); or why it cannot start (``require_limits``
        and the limits cannot be had)."""
        why = self.cgroups.why_not()
        if why and self.require_limits:
            return f"[launch] require_limits is set and {why}"
        if not self.cgroups.hierarchy.bases:
            return []
        try:
            return self.cgroups.create(state.launch_id)
        except OSError as exc:
            why = f"cannot make its cgroup: {exc.strerror or exc}"
            if self.require_limits:
                return f"[launch] require_limits is set and {why}"
            log.warning("launch %s (job %s): %s: started without per-launch limits",
                        state.launch_id, state.job_id, why)
            return []

    def identity(self, order: Any) -> User | str | None:
        """Who the launch's ranks run as: the order's unix user (a :class:`User`), the
        agent's own (None, ``run_as = "agent"``), or why they cannot run at all."""
        return None if self.run_as == "agent" else owner_user(order.unix_user)

    def torchrun(self, order: Any, work: Path) -> list[str]:
        return torchrun_command(self.python, order, work, self.local_addr,
                                self.rank_command(order, work))

    def rank_command(self, order: Any, work: Path) -> list[str]:
        return rank_command(self.python, order, work)

    def stop(self, launch_id: str) -> bool:
        """SIGTERM the launch's processes (SIGKILL after the grace period); True when it
        was running and is stopping now."""
        state = self._launches.get(launch_id)
        if state is None or not state.running or state.stopped:
            return False
        state.stopped = True
        self._refresh_trees(force=True)
        for pid, ticks in [(state.pid, state.start_ticks), *state.tree.items()]:
            _signal(pid, ticks, signal.SIGTERM)
        state.kill_at = time.monotonic() + self.stop_grace_s
        self._save(state)  # after the signals: a full disk never keeps a launch running
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
        for state in [s for s in self._launches.values() if s.unsaved and not s.running]:
            self._save(state)  # an ended launch's record the disk refused
        self.clean()
        if self.cgroups.pending():
            self.cgroups.tidy()
        now = time.monotonic()
        for state in self.running():
            code: int | None = None
            if state.proc is not None:
                rc = state.proc.poll()
                if rc is not None:
                    saved = saved_exit(state)
                    code = saved if saved is not None else rc
            elif _proc_stat(state.pid) is None or (
                    (_proc_stat(state.pid) or (0, 0))[1] != state.start_ticks):
                saved = saved_exit(state)
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
            if set(found) - set(state.tree) or state.unsaved:
                state.tree.update(found)
                self._save(state)

    @staticmethod
    def _save(state: LaunchState) -> None:
        """Write the launch's record; on a disk that refuses it (full: another owner's
        files may fill it), keep going and write it again at the next scan."""
        try:
            state.save()
        except OSError as exc:
            if not state.unsaved:
                log.warning("launch %s (job %s): cannot write its record (%s): kept in "
                            "memory, written again once the disk takes it", state.launch_id,
                            state.job_id, exc.strerror or exc)
            state.unsaved = True
        else:
            state.unsaved = False

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
                self._removed.add(state.launch_id)
            except OSError as exc:  # not recorded: not removed (it could start again)
                log.warning("launch %s: cannot record its removal: %s", state.launch_id, exc)
                return []
            delete_dir(state.dir)
            if state.work is not None:
                delete_dir(state.work)
            del self._launches[state.launch_id]
            log.info("launch %s (job %s): directory removed (ended and acknowledged %.0f s "
                     "ago; launch_retention_s %g)", state.launch_id, state.job_id,
                     now - state.done_unix, self.retention_s)
        return [s.launch_id for s in due]

    def _kill(self, state: LaunchState) -> None:
        for pid, ticks in [(state.pid, state.start_ticks), *state.tree.items()]:
            _signal(pid, ticks, signal.SIGKILL)

    def _ended(self, state: LaunchState, code: int, reason: str = "") -> None:
        state.exit_code = code
        if state.proc is not None:
            state.proc = None
        limit = self.cgroups.end(state.launch_id)  # what a limit did; nothing left in it
        leftover = {p: t for p, t in state.tree.items()
                    if (_proc_stat(p) or (0, -1))[1] == t}
        if leftover:  # ranks outliving their torchrun (killed, or wedged): not for long
            log.warning("launch %s (job %s): %d process(es) outlived it: SIGKILL",
                        state.launch_id, state.job_id, len(leftover))
            for pid, ticks in leftover.items():
                _signal(pid, ticks, signal.SIGKILL)
        if code != 0:
            said = state.reason  # the runner's (the agent that started it ended)
            state.reason = reason or ("stopped on the daemon's order" if state.stopped
                                      else "; ".join(x for x in (said, last_lines(state)) if x))
            if limit and not state.stopped:
                state.reason = f"{limit}\n{state.reason}"
        for secret in ("trainer.token", "env.json"):
            with contextlib.suppress(OSError):
                if state.work is not None:
                    (state.work / secret).unlink(missing_ok=True)
        self._save(state)
        log.info("launch %s (job %s): exited with code %d%s", state.launch_id, state.job_id,
                 code, " (stopped on order)" if state.stopped else "")

    # -- reports ----------------------------------------------------------------

    def statuses(self) -> list[LaunchState]:
        """Launches to report: all but those the daemon has fully acknowledged."""
        return [s for s in self._launches.values() if not s.done]

    def chunks(self) -> list[tuple[str, int, bytes]]:
        """New output to ship: (launch id, offset, bytes), at most MAX_REPORT_BYTES. Each
        launch with output waiting gets an even share of the report (MIN_SHARE at
        least), and each report starts one launch further: however much other owners'
        launches print, a launch's output leaves with the next reports."""
        pending = [s for s in self.statuses() if s.output_bytes() > s.shipped]
        if not pending:
            return []
        start = self._rotation % len(pending)
        self._rotation += 1
        share = max(MIN_SHARE, min(MAX_CHUNK, MAX_REPORT_BYTES // len(pending)))
        out: list[tuple[str, int, bytes]] = []
        budget = MAX_REPORT_BYTES
        for state in pending[start:] + pending[:start]:
            if budget <= 0:
                break
            offset, data = state.output.read(state.shipped, min(share, budget),
                                             self.output_cap)
            if data:
                out.append((state.launch_id, offset, data))
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
                self._save(state)


def saved_exit(state: LaunchState) -> int | None:
    """The status the runner saved (its reason, if any, goes to ``state.reason``)."""
    try:
        code, _, reason = (state.dir / "exit").read_text().partition("\n")
        value = int(code.strip())
    except (OSError, ValueError):
        return None
    if reason.strip():
        state.reason = reason.strip()[:1000]
    return value


def last_lines(state: LaunchState) -> str:
    """The last lines of the launch's output: its ranks' lines when there are any
    (torchrun's own summary of a failure says little more)."""
    lines = [line for line in state.output.tail(32768).decode("utf-8", "replace")
             .splitlines() if line.strip()]
    ranks = [line for line in lines if line.startswith("[rank")]
    tail = (ranks or lines)[-8:]
    return "\n".join(line[:240] for line in tail)[-1900:] or "no output"
