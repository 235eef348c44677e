"""Processes of launches, as the kernel shows them: the /proc table, a launch's
descendants, signals that never hit a reused pid, and the prctl settings that tie a
launch's processes to their parent (no torch, no grpc: the runner imports this)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Mapping
from pathlib import Path

__all__ = ["can_switch_users", "descendants", "proc_stat", "process_table",
           "set_child_subreaper", "set_parent_death_signal", "signal_process"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_CAP_SETGID = 6
_CAP_SETUID = 7


def proc_stat(pid: int) -> tuple[int, int] | None:
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


Table = tuple[dict[int, int], dict[int, list[tuple[int, int]]]]


def process_table() -> Table:
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
        st = proc_stat(int(name))
        if st is not None:
            live[int(name)] = st[1]
            children.setdefault(st[0], []).append((int(name), st[1]))
    return live, children


def descendants(roots: Mapping[int, int], table: Table | None = None) -> dict[int, int]:
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


def signal_process(pid: int, ticks: int, sig: int) -> None:
    """``sig`` to ``pid``'s process group (to ``pid`` if it leads none), if ``pid`` is
    still the process that started at ``ticks`` (0: any)."""
    st = proc_stat(pid)
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


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that started it
    ends (PR_SET_PDEATHSIG); True when set. Call it after any change of user: a change
    of credentials clears it."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def set_child_subreaper() -> bool:
    """Orphaned descendants of this process become its children (not init's), so it
    can still find and end them (PR_SET_CHILD_SUBREAPER); True when set."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def can_switch_users() -> str:
    """Why this process cannot start processes as another user ("" when it can: root,
    or CAP_SETUID and CAP_SETGID in its effective set)."""
    try:
        status = Path("/proc/self/status").read_text()
        eff = int(next(line.split()[1] for line in status.splitlines()
                       if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        eff = -1 if os.geteuid() == 0 else 0
    need = (1 << _CAP_SETUID) | (1 << _CAP_SETGID)
    if eff & need == need:
        return ""
    return (f"the agent runs as uid {os.geteuid()} without CAP_SETUID and CAP_SETGID, "
            "so it cannot start ranks as their owner")
