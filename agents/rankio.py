"""``python -m hetpilot.agents.rankio ENV_FILE -- COMMAND...``: how torchrun starts
each rank of a launch (:mod:`hetpilot.agents.launcher`).

It gives the rank, and nothing above it, the job's ``[entry.env]`` (read from
ENV_FILE, a JSON object in the launch's work directory): the agent's runner and
torchrun start with the agent's clean environment, so a job's ``PYTHONPATH`` or
``LD_PRELOAD`` reaches its own processes only. It runs COMMAND with stdout and stderr
into one pipe and copies each line to its own stdout (torchrun's, which the runner
keeps) prefixed with ``[rank<RANK>]:``, the global rank (what torchrun's ``--tee``
did, without the per-rank files it kept as a second copy).

torchrun signals a rank's whole process group, so COMMAND gets each signal itself;
this process ignores SIGTERM, SIGINT and SIGHUP, copies what is left, and ends as
COMMAND ended (the same exit code, or the same signal). No torch, no grpc here.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]

MAX_LINE = 64 * 1024
"""A longer line is cut into pieces of this size, each prefixed."""
LINGER_S = 1.0
"""How long output is still copied after COMMAND ended, when something else holds
its pipe open."""


def _pump(fd: int, out: int, prefix: bytes, proc: subprocess.Popen[bytes]) -> None:
    """Copy ``fd`` to ``out`` line by line with ``prefix`` until its end, or until a
    moment after ``proc`` ended (a process it left behind may hold the pipe open: the
    rank is over when COMMAND is)."""
    pending = b""
    ended_at: float | None = None
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                break
            pending += data
            lines = pending.split(b"\n")
            pending = lines.pop()
            while len(pending) > MAX_LINE:
                lines.append(pending[:MAX_LINE])
                pending = pending[MAX_LINE:]
            if lines:
                _write(out, b"".join(prefix + line + b"\n" for line in lines))
        if ended_at is None and proc.poll() is not None:
            ended_at = time.monotonic()
        if ended_at is not None and not ready and time.monotonic() - ended_at > LINGER_S:
            break
    if pending:
        _write(out, prefix + pending + b"\n")


def _write(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except BrokenPipeError:  # nobody keeps the output any more: go on without it
            return


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m hetpilot.agents.rankio ENV_FILE -- COMMAND...", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if argv[0]:
        try:
            with open(argv[0]) as fh:
                extra = json.load(fh)
        except (OSError, ValueError) as exc:
            print(f"hetpilot: cannot read the job's environment {argv[0]}: {exc}",
                  file=sys.stderr, flush=True)
            return 127
        env.update({str(k): str(v) for k, v in extra.items()})
    prefix = f"[rank{os.environ.get('RANK', '?')}]:".encode()
    read, write = os.pipe()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)  # COMMAND got it too: wait for it
    try:
        proc = subprocess.Popen(list(argv[2:]), stdin=subprocess.DEVNULL, stdout=write,
                                stderr=write, env=env)  # exec resets the handlers
    except OSError as exc:
        os.close(write)
        _write(1, prefix + f"hetpilot: cannot start {argv[2]}: {exc}\n".encode())
        return 127
    os.close(write)
    _pump(read, 1, prefix, proc)
    code = proc.wait()
    if code < 0:  # end as COMMAND did: by its signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
