"""Who a launch runs as, and the directories and files it may use: the job owner's
unix user (:class:`User`, from a launch order's ``unix_user``), the launch's private
directories and files, and whether a user can work in a directory
(:mod:`hetpilot.agents.launcher` uses them; docs/operating.md, "Who runs the ranks")."""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from .procs import can_switch_users

__all__ = ["User", "cannot_enter", "owner_user", "private_dirs", "write_private"]


@dataclass(frozen=True)
class User:
    """The unix user a launch's ranks run as."""

    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...] = ()
    """Supplementary groups (the user's, as ``initgroups`` would set them)."""


def private_dirs(base: Path, records: Path, work: Path) -> None:
    """The state directory (0711: a launch's user may pass through it to her launch's
    own directory, never list it), its records (0700: the agent's only) and the
    ranks' directories' parent (0711)."""
    base.mkdir(parents=True, exist_ok=True)
    for path, mode in ((base, 0o711), (records, 0o700), (work, 0o711)):
        path.mkdir(exist_ok=True)
        if stat.S_IMODE(path.stat().st_mode) != mode:
            os.chmod(path, mode)


def write_private(path: Path, text: str) -> None:
    """A new file only its owner reads (never through a link left in its place)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def cannot_enter(path: Path, who: User) -> str:
    """Why ``who`` could not work in directory ``path`` (search every directory on the
    way, read and search the last); "" when she can. The runner changes into it as
    root, so the kernel would not ask."""
    groups = {who.gid, *who.groups}
    parts = [*reversed(path.absolute().parents), path.absolute()]
    for i, part in enumerate(parts):
        try:
            st = os.stat(part)
        except OSError as exc:
            return exc.strerror or str(exc)
        if not stat.S_ISDIR(st.st_mode):
            return f"{part} is not a directory"
        need = 0o5 if i == len(parts) - 1 else 0o1
        mode = st.st_mode
        bits = (mode >> 6 if st.st_uid == who.uid else mode >> 3 if st.st_gid in groups
                else mode) & 0o7
        if bits & need != need:
            return f"user {who.name} may not {'enter' if need == 0o1 else 'use'} {part}"
    return ""


def owner_user(name: str) -> User | str:
    """The unix user ``name`` (a launch order's ``unix_user``) as a :class:`User`, or
    why a launch cannot run as her here."""
    if not name:
        return ("the job's owner has no unix_user (the daemon's owner tokens file) and "
                "this agent runs ranks as their owner's user ([launch] run_as = "
                "\"owner\"; \"agent\" runs every launch as the agent's own user, for "
                "hosts whose owners trust each other)")
    why = can_switch_users()
    if why:
        return (f"{why} (run the agent as root, see deploy/hetpilot-agent.service, or set "
                "[launch] run_as = \"agent\" for hosts whose owners trust each other)")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return f"unix user {name!r} (the job owner's unix_user) does not exist here"
    if pw.pw_uid == 0:
        return f"unix user {name!r} is root: ranks never run as root"
    return User(name=name, uid=pw.pw_uid, gid=pw.pw_gid, home=pw.pw_dir,
                groups=tuple(g for g in os.getgrouplist(name, pw.pw_gid) if g != pw.pw_gid))
