"""``python -m hetpilot.agents.runner --exit FILE --output DIR [options] -- COMMAND...``:
what an agent starts for each launch (:mod:`hetpilot.agents.launcher`).

It joins the launch's cgroups (``--cgroup``, made by the agent with the launch's
limits: :mod:`hetpilot.agents.cgroups`) before anything else, so COMMAND and the
ranks are in them from their first instruction. It runs COMMAND (torchrun) in its
own process group and session, the one the agent started it in, as the launch's user
(``--uid``/``--gid``/``--groups``, when the agent runs ranks as their owners, with
umask 0077; the runner itself stays the agent's user, so the ranks can neither
signal it nor touch what it writes). It keeps everything COMMAND and the ranks print in one capped copy
(:class:`~hetpilot.agents.output.OutputWriter`, ``--output``, ``--output-bytes``),
waits for COMMAND and writes its exit status to FILE before exiting with it: that
file is how an agent that restarted learns how a launch ended.

Tied to its agent. The kernel sends the runner SIGUSR2 when the agent ends
(PR_SET_PDEATHSIG: kill -9, a crash, systemd stopping it); the runner then sends
SIGTERM to COMMAND's group and to every process below it, SIGKILL ``--grace``
seconds later, writes the status (with the reason) and exits. It is a child
subreaper, so ranks that lose their torchrun stay its descendants and are found;
COMMAND gets SIGTERM if the runner itself is killed. Ranks still running a moment
after COMMAND ended are killed too.

Signals the agent sends go to the whole process group, so COMMAND gets them
directly; the runner ignores SIGTERM, SIGINT and SIGHUP so that it is still there
to write the status when COMMAND ends.

Exit status file: COMMAND's status on the first line (negative for a signal, 127
when it could not be started), and a reason on the second when there is one. No
torch, no grpc here: it starts in 50 ms.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from .output import DEFAULT_CAP, OutputWriter
from .procs import (
    descendants,
    proc_stat,
    set_child_subreaper,
    set_parent_death_signal,
    signal_process,
)

__all__ = ["AGENT_GONE", "PRIVATE_UMASK", "main", "write_exit"]

AGENT_GONE = signal.SIGUSR2
"""The signal the kernel sends the runner when its agent ends."""
PRIVATE_UMASK = 0o077
"""The umask of a launch run as its owner's user (a job wanting more sets its own)."""
LINGER_S = 2.0
"""How long ranks may outlive their torchrun (printing their last lines)."""


def write_exit(path: str, code: int, reason: str = "") -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(f"{code}\n{reason}\n" if reason else f"{code}\n")
    os.replace(tmp, path)


def _args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hetpilot.agents.runner")
    parser.add_argument("--exit", required=True, help="file the exit status goes to")
    parser.add_argument("--output", required=True, help="directory of the output segments")
    parser.add_argument("--output-bytes", type=int, default=DEFAULT_CAP)
    parser.add_argument("--parent", type=int, default=0,
                        help="the agent's pid: if it is gone already, start nothing")
    parser.add_argument("--uid", type=int)
    parser.add_argument("--gid", type=int)
    parser.add_argument("--groups", default="", help="supplementary group ids, comma-separated")
    parser.add_argument("--cgroup", action="append", default=[], metavar="DIR",
                        help="a cgroup directory to join before starting anything (the "
                             "launch's, with its limits; once per hierarchy)")
    parser.add_argument("--grace", type=float, default=3.0,
                        help="seconds between SIGTERM and SIGKILL once the agent is gone")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no COMMAND after --")
    return args


class _Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = OutputWriter(args.output, args.output_bytes)
        self.agent_gone = False
        self.term_at: float | None = None
        self.me = {os.getpid(): (proc_stat(os.getpid()) or (0, 0))[1]}

    def start(self) -> tuple[subprocess.Popen[bytes], int]:
        a = self.args
        read, write = os.pipe()
        kw: dict[str, object] = {}
        if a.uid is not None:  # files the ranks make are their owner's only (umask
            # 0077), wherever they make them: /tmp and /dev/shm are shared by every owner
            kw.update(user=a.uid, group=a.gid, umask=PRIVATE_UMASK,
                      extra_groups=[int(g) for g in a.groups.split(",") if g])
        try:
            # preexec_fn runs after the change of user, which would clear the setting
            proc = subprocess.Popen(a.command, stdin=subprocess.DEVNULL, stdout=write,
                                    stderr=write, preexec_fn=_torchrun_death_signal,
                                    **kw)  # type: ignore[call-overload]
        finally:
            os.close(write)
        return proc, read

    def tree(self) -> dict[int, int]:
        return descendants(self.me)

    def pump(self, fd: int, timeout: float) -> bool:
        """Copy what ``fd`` has (waiting up to ``timeout``); False at its end."""
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            return True
        if not ready:
            return True
        data = os.read(fd, 1 << 16)
        if not data:
            return False
        self.out.write(data)
        return True

    def end_tree(self, sig: int) -> None:
        for pid, ticks in self.tree().items():
            signal_process(pid, ticks, sig)

    def run(self) -> tuple[int, str]:
        try:
            proc, fd = self.start()
        except OSError as exc:
            self.out.write(f"hetpilot: cannot start {self.args.command[0]}: {exc}\n".encode())
            return 127, ""
        code: int | None = None
        open_ = True
        ended_at = 0.0
        while True:
            if self.agent_gone and self.term_at is None:
                self.term_at = time.monotonic() + self.args.grace
                self.end_tree(signal.SIGTERM)
            if self.term_at is not None and time.monotonic() >= self.term_at:
                self.end_tree(signal.SIGKILL)
                self.term_at = float("inf")
            if open_:
                open_ = self.pump(fd, 0.2)
            else:
                time.sleep(0.05)
            if code is None:
                code = self._reap(proc)
                if code is not None:
                    ended_at = time.monotonic()
            else:
                self._reap(proc)
            if code is not None:
                if not open_ and not self.tree():
                    break
                if time.monotonic() - ended_at > LINGER_S:  # ranks outliving torchrun
                    self.end_tree(signal.SIGKILL)
                    while open_:
                        open_ = self.pump(fd, 0.2)
                    self._reap(proc)
                    break
        os.close(fd)
        return code, ("stopped: the agent that started it ended" if self.agent_gone else "")

    @staticmethod
    def _reap(proc: subprocess.Popen[bytes]) -> int | None:
        """Reap every child that ended (orphaned ranks are ours too); torchrun's status
        once it ended."""
        code = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == proc.pid:
                code = os.waitstatus_to_exitcode(status)
                proc.returncode = code
        if code is None and proc.returncode is not None:
            code = proc.returncode
        return code


def _leave_cgroups(directories: Sequence[str]) -> None:
    """Remove the launch's cgroups, empty now that its tree has ended, when the agent that
    made them is gone and cannot (the next agent on the state dir would sweep them):
    move this process to each parent, then remove the directory. Best effort: cgroup v2
    refuses a process in a parent that delegates controllers, and the sweep stays."""
    for directory in directories:
        parent = os.path.dirname(directory.rstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
            os.rmdir(directory)
        except OSError:
            pass


def _torchrun_death_signal() -> None:
    set_parent_death_signal(signal.SIGTERM)


def main(argv: Sequence[str]) -> int:
    args = _args(argv)
    runner = _Runner(args)
    signal.signal(AGENT_GONE, lambda signum, frame: setattr(runner, "agent_gone", True))
    set_parent_death_signal(AGENT_GONE)
    if args.parent and os.getppid() != args.parent:  # the agent ended before we armed
        write_exit(args.exit, 127, "not started: the agent that ordered it had ended")
        return 127
    for directory in args.cgroup:  # before anything starts: all of it inherits the cgroup
        try:
            with open(os.path.join(directory, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
        except OSError as exc:
            write_exit(args.exit, 127, f"not started: cannot join its cgroup {directory}: "
                                       f"{exc.strerror or exc}")
            return 127
    set_child_subreaper()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)  # COMMAND got it too: wait for it
    code, reason = runner.run()
    if runner.agent_gone:
        _leave_cgroups(args.cgroup)
    if runner.out.lost:
        reason = (reason + "; " if reason else "") + \
            f"{runner.out.lost} bytes of output lost (the disk refused them)"
    runner.out.close()
    write_exit(args.exit, code, reason)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
