"""What an agent keeps on disk about its launches: each launch's record
(``launches/<id>/launch.json``), the tombstones of the launches whose directories
were removed, and the lock that keeps a second agent off the state directory.
:mod:`hetpilot.agents.launcher` says how launches use them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetpilot import pidlock

from .output import OutputReader

__all__ = [
    "EXIT_UNKNOWN",
    "TOMBSTONES",
    "LaunchState",
    "StateDirInUse",
    "Tombstones",
    "delete_dir",
    "lock_state_dir",
]

EXIT_UNKNOWN = 255
"""Reported when the exit status was lost (:mod:`hetpilot.agents.launcher`)."""
TOMBSTONES = ".removed"
"""Ids of the launches whose directories were removed (one per line)."""
MAX_TOMBSTONES = 100_000
"""Beyond this many, the oldest half is forgotten (the daemon never orders a launch
again once it was reported)."""


@dataclass
class LaunchState:
    """One launch as the agent knows it (``launch.json`` holds the persisted fields)."""

    launch_id: str
    job_id: str
    dir: Path
    """``launches/<id>``: the agent's record, the exit status, the output (the agent's
    user only)."""
    work: Path | None = None
    """``work/<id>``: the ranks' own directory (owned by the launch's user, 0700): the
    trainer token, the job's environment, torchrun's files; None for old records."""
    user: str = ""
    """The unix user the ranks run as ("": the agent's own)."""
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
    unsaved: bool = False
    """A change not yet in ``launch.json`` (the disk refused it): saved again later."""

    _PERSISTED = ("launch_id", "job_id", "user", "pid", "start_ticks", "exit_code", "reason",
                  "stopped", "done", "done_unix")

    @property
    def output(self) -> OutputReader:
        """The launch's output (:mod:`hetpilot.agents.output`)."""
        return OutputReader(self.dir / "output")

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def output_bytes(self) -> int:
        """Bytes of output the launch has written (its logical size: some may be
        dropped from the disk past the cap)."""
        return self.output.end()

    def save(self) -> None:
        data = {k: getattr(self, k) for k in self._PERSISTED}
        data["work"] = str(self.work) if self.work is not None else ""
        data["tree"] = {str(k): v for k, v in self.tree.items()}
        tmp = self.dir / "launch.json.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.dir / "launch.json")

    @classmethod
    def load(cls, directory: Path) -> LaunchState:
        data = json.loads((directory / "launch.json").read_text())
        state = cls(dir=directory, **{k: data[k] for k in cls._PERSISTED if k in data})
        state.work = Path(data["work"]) if data.get("work") else None
        state.tree = {int(k): int(v) for k, v in data.get("tree", {}).items()}
        return state


class StateDirInUse(OSError):
    """Another live agent process holds the state directory."""


def lock_state_dir(state_dir: Path) -> Any:
    """Hold ``<state_dir>/agent.lock`` for this process (:mod:`hetpilot.pidlock`);
    :class:`StateDirInUse` if another process holds it.

    Two agents on one state directory would both start each ordered launch (each
    knows only the launch ids it read at its start) and report each other's as
    unknown."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        return pidlock.take(state_dir / "agent.lock")
    except pidlock.LockHeld as held:
        raise StateDirInUse(
            f"state dir {state_dir}: another hetpilot agent (pid {held.holder}) uses it; stop "
            "that agent, or give this one another --state-dir (and --host)") from None



class Tombstones:
    """The ids of the launches whose directories were removed (``launches/.removed``,
    appended to before the removal), so that a restarted agent neither adopts nor
    starts them again."""

    def __init__(self, root: Path) -> None:
        self.path = root / TOMBSTONES
        try:
            lines = self.path.read_text().split()
        except FileNotFoundError:
            lines = []
        self._ids = set(lines)
        self._count = len(lines)

    def __contains__(self, launch_id: str) -> bool:
        return launch_id in self._ids

    def add(self, launch_id: str) -> None:
        """Record ``launch_id`` (OSError when it cannot be: then it must not be removed)."""
        if self._count >= MAX_TOMBSTONES:  # keep the newest half
            lines = self.path.read_text().split()[-MAX_TOMBSTONES // 2:]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(f"{i}\n" for i in lines))
            os.replace(tmp, self.path)
            self._ids = set(lines)
            self._count = len(lines)
        with open(self.path, "a") as fh:
            fh.write(f"{launch_id}\n")
        self._ids.add(launch_id)
        self._count += 1


def delete_dir(directory: Path) -> None:
    """Rename ``directory`` to ``.trash-<name>`` and delete it (a restart finishes a
    deletion cut short by removing what is left of the trash)."""
    trash = directory.with_name(f".trash-{directory.name}")
    try:
        os.replace(directory, trash)
    except OSError:
        trash = directory
    shutil.rmtree(trash, ignore_errors=True)
