"""One process per state directory: an ``flock`` on a file in it, released by the
kernel however the holder ends, with the holder's pid written in it so that a refused
second process can say who holds it. The agent and the daemon each hold one."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import IO

__all__ = ["LockHeld", "release", "take"]

log = logging.getLogger(__name__)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is the pid it wrote ("unknown" if none)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by pid {holder}")
        self.path = path
        self.holder = holder


def take(path: Path, mode: int = 0o600) -> IO[str]:
    """Open ``path`` (made with ``mode``), hold its lock and write our pid; the open file,
    which holds the lock until it is closed or the process ends. Not inherited by child
    processes (Python's descriptors are close-on-exec), so a launch that outlives its
    agent never keeps the next agent out. :class:`LockHeld` if another process holds it;
    OSError if the file cannot be opened. A full disk leaves the pid unwritten and the
    lock held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    handle = os.fdopen(fd, "r+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = handle.read().strip()[:20] or "unknown"
        handle.close()
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise LockHeld(path, holder) from None
    os.ftruncate(handle.fileno(), 0)
    try:
        os.pwrite(handle.fileno(), f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        log.warning("%s: pid not written (%s); the lock holds", path, exc.strerror)
    return handle


def release(handle: IO[str]) -> None:
    """Clear the pid and let the lock go (closing the file releases it)."""
    with contextlib.suppress(OSError):
        os.ftruncate(handle.fileno(), 0)
    handle.close()
