"""``python -m hetpilot.agents.runner EXIT_FILE -- COMMAND...``: what an agent
starts for each launch (:mod:`hetpilot.agents.launcher`).

It runs COMMAND (torchrun) in its own process group and session, the one the
agent started it in, waits for it and writes its exit status to EXIT_FILE
(atomically) before exiting with it. That file is why the status survives an
agent restart: launches run on while their agent restarts, and the agent that
comes back reads how a launch it did not start itself ended.

Signals the agent sends go to the whole process group, so COMMAND gets them
directly; the runner itself ignores SIGTERM, SIGINT and SIGHUP (its handler
does nothing) so that it is still there to write the status when COMMAND ends.
SIGKILL ends it without a file; the agent sends that only after its own stop
grace, and then knows how the launch ended (stopped).

Exit status in the file: COMMAND's, negative for a signal (-15: SIGTERM), 127
when it could not be started. No torch, no grpc here: it starts in 50 ms.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["main", "write_exit"]


def write_exit(path: str, code: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(f"{code}\n")
    os.replace(tmp, path)


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m hetpilot.agents.runner EXIT_FILE -- COMMAND...", file=sys.stderr)
        return 2
    exit_file, command = argv[0], list(argv[2:])
    try:
        proc = subprocess.Popen(command)
    except OSError as exc:
        print(f"hetpilot: cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
        write_exit(exit_file, 127)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)  # COMMAND got it too: wait for it
    code = proc.wait()
    write_exit(exit_file, code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
