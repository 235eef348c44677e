"""The state database's file under an open SQLite connection: which SQLite errors
are storage faults (:func:`storage_error`), whether the file is still the one the
store opened (:meth:`DatabaseFile.check`), and the WAL checkpoints the store runs
itself (:meth:`DatabaseFile.checkpoint`).

Note [checkpoints on a full disk]: a checkpoint copies the WAL's pages into the
database file in page order, so page 1, whose header counts the pages, first. When
the disk fills part way, the file's header counts pages the file does not have yet,
while the WAL still holds every one of them: reads, the next checkpoint and the
next start (which reads the WAL) are all right, and nothing is lost. SQLite's own
automatic checkpoint fails silently, so a store relying on it could not tell that
state from a file truncated under it; that is why the store turns it off
(``wal_autocheckpoint=0``) and checkpoints itself. While a checkpoint is
unfinished the file is checked against the size it had then, not against its
header, and each commit retries the checkpoint until one completes.

Note [a lost file]: SQLite keeps answering from its cache and WAL after the file
under it is deleted, replaced, truncated or overwritten, and its checkpoint would
write pages into whatever is there now. So every write checks the file first (one
stat and a 100-byte read). A lost file is never checkpointed into or closed (a
close checkpoints), and its WAL stays where it is with the last writes; a marker
next to it (``state.db.lost``, the reason) makes the next start refuse the pair
instead of reading that WAL as the WAL of whatever file is at the path then.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import DamagedStore, StorageError, StorageFull, StorageUnavailable

__all__ = ["CHECKPOINT_PAGES", "RESTORE", "DatabaseFile", "faults_raised", "one_line",
           "primary_code", "refuse_lost", "storage_error"]

log = logging.getLogger("hetpilot.daemon.store")

RESTORE = "move it aside and restore a backup, or start with an empty state dir"
CHECKPOINT_PAGES = 1000
"""The store checkpoints once the WAL holds this many pages (SQLite's own default)."""

#: Primary SQLite result codes that mean the storage failed rather than the statement
#: (a constraint, an SQL error): these become StorageFull / StorageUnavailable.
_FAULT_CODES = frozenset({
    sqlite3.SQLITE_PERM, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_NOMEM,
    sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_NOTADB})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SQLITE_HEADER = b"SQLite format 3\x00"


def primary_code(exc: sqlite3.Error) -> int | None:
    """SQLite's primary result code (the low byte of an extended one: SQLITE_IOERR for
    SQLITE_IOERR_WRITE); None for errors of the sqlite3 module itself (a closed database)."""
    code = exc.sqlite_errorcode
    return None if code is None else code & 0xFF


def storage_error(exc: BaseException) -> StorageError | None:
    """``exc`` as a StorageError, chained by the caller; None when it is no storage fault
    (a bug, a constraint violation, a missing job): that propagates unchanged."""
    if isinstance(exc, OSError):
        full = exc.errno in _FULL_ERRNOS
    elif isinstance(exc, sqlite3.Error):
        code = primary_code(exc)
        if code not in _FAULT_CODES:
            return None
        full = code == sqlite3.SQLITE_FULL
    else:
        return None
    if full:
        return StorageFull(f"state store full: {exc}")
    return StorageUnavailable(f"state store unavailable: {exc}")


@contextmanager
def faults_raised() -> Iterator[None]:
    """Re-raise a storage fault as StorageFull / StorageUnavailable, anything else as it is."""
    try:
        yield
    except (sqlite3.Error, OSError) as exc:
        fault = storage_error(exc)
        if fault is None:
            raise
        raise fault from exc


def one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _short_of_header(header: bytes, size: int) -> bool:
    """Whether a file of ``size`` bytes is shorter than the database its 100-byte header
    describes (page size, bytes 16-17, times the page count, bytes 28-31; the count is
    valid when the change counter, bytes 24-27, equals bytes 92-95)."""
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    return header[24:28] == header[92:96] and size < page_size * pages


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".lost")


def refuse_lost(path: Path) -> None:
    """Raise DamagedStore when a daemon found ``path`` lost while it ran (see Note [a
    lost file]): its WAL holds writes that the file at the path now may not match."""
    marker = _marker(path)
    try:
        reason = one_line(marker.read_text(errors="replace"), 300)
    except FileNotFoundError:
        return
    except OSError as exc:
        reason = f"unreadable: {exc}"
    raise DamagedStore(
        f"{path} was lost while a daemon ran ({reason}); its WAL {path.name}-wal, which "
        f"holds the last writes, was left as it was. Inspect both, then remove {marker} "
        f"to start with them, or {RESTORE}")


class DatabaseFile:
    """The file of one open connection: its checks and checkpoints (module docstring).
    Not thread-safe: the store calls it under its lock."""

    def __init__(self, path: Path, checkpoint_pages: int = CHECKPOINT_PAGES) -> None:
        self.path = path
        self.checkpoint_pages = checkpoint_pages
        self._fd: int | None = os.open(path, os.O_RDONLY)
        self._identity = _identity(os.fstat(self._fd))
        self.lost: str | None = None
        """Why the file can no longer take writes, once it was found lost."""
        self.unfinished_size: int | None = None
        """The file's size when a checkpoint last stopped part way; None once one completes."""
        self._commits = 0
        self._shm: int | None = None
        """The WAL index (``-shm``), read for the count of frames in the WAL."""

    def check(self) -> str | None:
        """Why the file can no longer take writes, or None: it was deleted or replaced
        (another file at its path), truncated (shorter than its header says, or than it
        was when a checkpoint stopped) or overwritten (no SQLite header). Once found
        lost it stays lost until a restart, which checks the file as at any start."""
        if self.lost is not None or self._fd is None:
            return self.lost
        problem = None
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            problem = "was deleted"
        else:
            if _identity(now) != self._identity:
                problem = "was replaced by another file"
            else:
                header = os.pread(self._fd, 100, 0)
                if header[:16] != _SQLITE_HEADER:
                    problem = ("was truncated" if now.st_size < 16 else
                               "was overwritten (no SQLite header)")
                elif len(header) < 100:
                    problem = "was truncated"
                elif self.unfinished_size is not None:
                    if now.st_size < self.unfinished_size:
                        problem = "was truncated"
                elif _short_of_header(header, now.st_size):
                    problem = "was truncated"
        if problem is not None:
            self.lost = (f"{self.path} {problem} while the daemon ran; what it held is "
                         "only in memory and its WAL now, and writes are refused. Stop "
                         f"the daemon, then {RESTORE}")
            log.error("%s", self.lost)
        return self.lost

    def committed(self, db: sqlite3.Connection) -> None:
        """After each commit: checkpoint once the WAL holds ``checkpoint_pages`` pages (as
        SQLite's own would), and after every commit while one is unfinished."""
        self._commits += 1
        frames = self._wal_frames()
        if frames is None:  # no WAL index to read: a commit writes a page at least
            frames = self._commits
        if frames >= self.checkpoint_pages or self.unfinished_size is not None:
            try:
                self.checkpoint(db)
            except sqlite3.Error:  # the write committed: it must not look failed
                log.exception("%s: checkpoint failed", self.path)

    def _wal_frames(self) -> int | None:
        """The committed frames in the WAL: ``mxFrame`` of the WAL index header (bytes
        16-19 of the ``-shm`` file, native byte order, valid once byte 12 is 1; SQLite's
        file format, section "WAL-index format"). None when it cannot be read."""
        try:
            if self._shm is None:
                self._shm = os.open(self.path.with_name(self.path.name + "-shm"), os.O_RDONLY)
            header = os.pread(self._shm, 20, 0)
        except OSError:
            return None
        if len(header) < 20 or header[12] != 1:
            return None
        return int.from_bytes(header[16:20], sys.byteorder)

    def checkpoint(self, db: sqlite3.Connection, mode: str = "PASSIVE") -> bool:
        """Copy the WAL into the file (``mode``: PASSIVE, or TRUNCATE to leave an empty
        WAL); whether every frame was copied. One that fails for want of room or on an
        I/O error is logged and left unfinished: the WAL keeps the pages."""
        self._commits = 0
        try:
            busy, frames, copied = db.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        except sqlite3.Error as exc:
            if storage_error(exc) is None:
                raise
            size = os.fstat(self._fd).st_size if self._fd is not None else 0
            if self.unfinished_size is None:
                log.warning("%s: a checkpoint stopped part way (%s); the WAL keeps every "
                            "page and the next commit tries again", self.path, exc)
            self.unfinished_size = max(size, self.unfinished_size or 0)
            return False
        done = not busy and frames == copied
        if done and self.unfinished_size is not None:
            log.info("%s: the checkpoint completed", self.path)
            self.unfinished_size = None
        return done

    def close(self, db: sqlite3.Connection) -> None:
        """Checkpoint (an unfinished one is left to the next start) and close ``db``; a
        lost file gets neither (Note [a lost file]) but its marker."""
        try:
            if self.check() is None:
                self.checkpoint(db, "TRUNCATE")
                db.close()
            else:
                self._abandon(db)
        finally:
            for fd in (self._fd, self._shm):
                if fd is not None:
                    os.close(fd)
            self._fd = self._shm = None

    def _abandon(self, db: sqlite3.Connection) -> None:
        """Leave ``db`` open for good (the process's exit releases its descriptor without
        the checkpoint a close runs) and write the marker the next start refuses."""
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(db))  # never deallocated: never closed
        marker = _marker(self.path)
        try:
            marker.write_text(f"{self.lost}\n")
        except OSError as exc:
            log.warning("%s: not written (%s); before the next start, move %s-wal aside "
                        "(it would be read as the WAL of the file at %s)", marker, exc,
                        self.path, self.path)
        else:
            log.warning("%s written: the next start refuses %s and its WAL until an "
                        "operator removes it", marker, self.path)
