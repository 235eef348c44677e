"""Launched jobs' output on the daemon: what each host's agent ships
(``AgentReport.logs``) is appended to ``state_dir/logs/<job>/<host>.log`` and
served by ``JobService.StreamLogs`` (``hetpilot logs``).

Bounded: when a host's file would pass half of ``log_bytes_per_host`` it
becomes ``<host>.log.1`` (replacing the one before) and a new file starts, so
a host keeps between half and all of its newest ``log_bytes_per_host`` bytes.

Exactly once, across daemon restarts: each chunk carries its offset in the
launch's output on the host, and ``<host>.idx`` (JSON, replaced atomically)
records at which offset ``<host>.log`` (and ``<host>.log.1``) start, with the
files' inodes. How far the daemon has written is therefore ``base + size of
<host>.log``, read back from the disk after a restart: a chunk the agent
resends because its ack was lost (a broken stream, a daemon killed between the
write and the ack) is recognised by its offset and written once, and a write
cut short is completed by the resent chunk. The index changes only when a file
is rotated; a daemon killed between the rotation and the index update is
recognised by the inodes (the index then names ``<host>.log.1``).

The offsets also let a reader resume: :class:`HostReader` reads from an
absolute offset (``StreamLogsRequest.resume_from``), whichever file holds it.

Retention (:meth:`JobLogs.remove`): the daemon removes an ended job's files
``log_retention_hours`` after it ended (:mod:`hetpilot.daemon.launches`).

A write that fails (disk full) drops the chunk with a warning rather than
failing the agent's report stream, whose reports are also its heartbeats; the
next chunk then starts a new file at its own offset (readers see a line saying
output was dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .decode import RateLimitedLog

__all__ = ["DROPPED", "MAX_READ", "HostIndex", "HostReader", "JobLogs", "LineFilter",
           "read_index"]

log = logging.getLogger("hetpilot.daemon")

MAX_READ = 1024 * 1024
"""Bytes one read (one LogLines message) carries at most."""
MAX_PARTIAL = 64 * 1024
"""A line longer than this is sent in pieces rather than held back."""
DROPPED = b"[hetpilot: older output of this host was dropped]\n"
"""What a reader gets where output it had not read is no longer kept."""


@dataclass(frozen=True)
class HostIndex:
    """Where one host's kept output lies: ``<host>.log`` holds the output from offset
    ``base`` on, ``<host>.log.1`` (when ``rotated_base`` >= 0) from ``rotated_base``
    up to ``base``."""

    launch_id: str
    base: int
    ino: int
    rotated_base: int = -1
    rotated_ino: int = 0

    def to_json(self) -> str:
        return json.dumps({"launch_id": self.launch_id, "base": self.base, "ino": self.ino,
                           "rotated_base": self.rotated_base,
                           "rotated_ino": self.rotated_ino})


def _index_path(path: Path) -> Path:
    return path.with_name(path.name[:-len(".log")] + ".idx")


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def read_index(path: Path) -> HostIndex | None:
    """The index of the host file ``path`` as it is on disk (None: none, or unreadable)."""
    try:
        data = json.loads(_index_path(path).read_text())
        return HostIndex(launch_id=str(data.get("launch_id", "")), base=int(data["base"]),
                         ino=int(data["ino"]), rotated_base=int(data.get("rotated_base", -1)),
                         rotated_ino=int(data.get("rotated_ino", 0)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("%s: unreadable (%s): rebuilt from the files", _index_path(path), exc)
        return None


def _write_index(path: Path, index: HostIndex) -> None:
    target = _index_path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(index.to_json())
    os.replace(tmp, target)


def _touch(path: Path) -> int:
    """Create ``path`` if it is missing; its inode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


@dataclass
class _Stream:
    index: HostIndex
    received: int
    """Offset after the last byte written: ``index.base`` + the size of ``<host>.log``."""


class JobLogs:
    def __init__(self, root: Path, max_bytes_per_host: int) -> None:
        self.root = root
        self.rotate_at = max(1, max_bytes_per_host // 2)
        self._streams: dict[tuple[str, str], _Stream] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._warn = RateLimitedLog()

    def path(self, job_id: str, host: str) -> Path:
        """Where ``host``'s output of ``job_id`` is kept (ids and hosts are checked names:
        no slashes, no leading dot)."""
        return self.root / job_id / f"{host}.log"

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def jobs(self) -> list[str]:
        """The jobs with output kept (their directories)."""
        try:
            return sorted(p.name for p in self.root.iterdir()
                          if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return []

    def _stream(self, job_id: str, host: str) -> _Stream | None:
        """What is written of ``host``'s output of ``job_id`` (read from the disk after a
        restart, repairing an index a rotation left behind)."""
        key = (job_id, host)
        stream = self._streams.get(key)
        if stream is not None:
            return stream
        path = self.path(job_id, host)
        rotated = path.with_name(path.name + ".1")
        index = read_index(path)
        cur, rot = _stat(path), _stat(rotated)
        if index is None and cur is None and rot is None:
            return None
        if index is not None and cur is not None and cur.st_ino == index.ino:
            pass  # as written
        elif index is not None and rot is not None and rot.st_ino == index.ino:
            # rotated, then stopped before the index was written: .log.1 began at base
            index = HostIndex(launch_id=index.launch_id, base=index.base + rot.st_size,
                              ino=_touch(path), rotated_base=index.base,
                              rotated_ino=rot.st_ino)
            _write_index(path, index)
        else:
            # no index (files of an older daemon) or one naming files that are gone:
            # the kept files are taken as the output from where the index says, else 0
            start = index.rotated_base if index is not None and index.rotated_base >= 0 \
                else index.base if index is not None else 0
            if rot is not None:
                index = HostIndex(launch_id=index.launch_id if index else "",
                                  base=start + rot.st_size, ino=_touch(path),
                                  rotated_base=start, rotated_ino=rot.st_ino)
            else:
                index = HostIndex(launch_id=index.launch_id if index else "", base=start,
                                  ino=_touch(path))
            _write_index(path, index)
        now = _stat(path)
        stream = self._streams[key] = _Stream(
            index=index, received=index.base + (now.st_size if now is not None else 0))
        return stream

    def received(self, job_id: str, host: str) -> int | None:
        """Offset in ``host``'s output of ``job_id`` up to which it is written (None:
        nothing written)."""
        try:
            stream = self._stream(job_id, host)
        except OSError:
            return None
        return stream.received if stream is not None else None

    def append(self, job_id: str, host: str, launch_id: str, offset: int, data: bytes) -> None:
        """Write what of ``data`` (the host's output from ``offset``) is new."""
        path = self.path(job_id, host)
        try:
            stream = self._stream(job_id, host)
            if stream is not None:
                have = stream.received
                if offset + len(data) <= have:
                    return  # resent: written already
                if offset < have:
                    data, offset = data[have - offset:], have
            if not data:
                return
            if stream is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                index = HostIndex(launch_id=launch_id, base=offset, ino=_touch(path))
                _write_index(path, index)
                stream = self._streams[(job_id, host)] = _Stream(index=index, received=offset)
            size = stream.received - stream.index.base
            if offset > stream.received or (size and size + len(data) > self.rotate_at):
                # full, or output missing before this chunk (a write that failed): the
                # current file is complete; a new one starts at this chunk's offset
                self._rotate(path, stream, offset)
            with open(path, "ab") as fh:
                fh.write(data)
            stream.received = offset + len(data)
        except OSError as exc:
            self._warn.warn(f"logs:{job_id}", "job %s: output of host %s dropped: %s", job_id,
                            host, exc)
            self._streams.pop((job_id, host), None)  # read back from the disk next time
            return
        self.notify(job_id)

    @staticmethod
    def _rotate(path: Path, stream: _Stream, offset: int) -> None:
        old = stream.index
        if stream.received > old.base:
            os.replace(path, path.with_name(path.name + ".1"))
            rotated_base, rotated_ino = old.base, old.ino
        else:  # empty: only moves to the new offset
            rotated_base, rotated_ino = old.rotated_base, old.rotated_ino
            path.unlink(missing_ok=True)
        index = HostIndex(launch_id=old.launch_id, base=offset, ino=_touch(path),
                          rotated_base=rotated_base, rotated_ino=rotated_ino)
        _write_index(path, index)
        stream.index, stream.received = index, offset

    def remove(self, job_id: str) -> bool:
        """Delete the job's kept output (retention); True when there was some."""
        directory = self.job_dir(job_id)
        for key in [k for k in self._streams if k[0] == job_id]:
            del self._streams[key]
        if not directory.exists():
            return False
        trash = self.root / f".removing-{job_id}"
        try:
            os.replace(directory, trash)  # atomic: readers see all of it or nothing
        except OSError:
            trash = directory
        shutil.rmtree(trash, ignore_errors=True)
        self.notify(job_id)
        return True

    def clean_leftovers(self) -> None:
        """Finish removals a stopped daemon left half done."""
        with contextlib.suppress(OSError):
            for p in self.root.iterdir():
                if p.name.startswith(".removing-"):
                    shutil.rmtree(p, ignore_errors=True)

    def reader(self, job_id: str, host: str, start: int | None = None) -> HostReader:
        return HostReader(self.path(job_id, host), start)

    def notify(self, job_id: str) -> None:
        """Wake the job's followers (new output, or the job or its launch changed)."""
        ev = self._events.pop(job_id, None)
        if ev is not None:
            ev.set()

    def notify_all(self) -> None:
        for job_id in list(self._events):
            self.notify(job_id)

    def event(self, job_id: str) -> asyncio.Event:
        """Set at the next :meth:`notify` of ``job_id``."""
        return self._events.setdefault(job_id, asyncio.Event())


class HostReader:
    """Reads one host's kept output from an offset in it (``start``; None: the oldest
    kept), following rotations; :attr:`offset` is where the next byte comes from. Runs
    in a worker thread: it reads the index from the disk and checks each file's inode
    against it, so a rotation between the two is noticed and the read retried."""

    def __init__(self, path: Path, start: int | None = None) -> None:
        self.path = path
        self.rotated = path.with_name(path.name + ".1")
        self.offset: int | None = start

    @staticmethod
    def _read(path: Path, ino: int, at: int, limit: int) -> bytes | None:
        """``limit`` bytes from ``at`` in ``path`` if it is still the file ``ino``."""
        try:
            with open(path, "rb") as fh:
                if os.fstat(fh.fileno()).st_ino != ino:
                    return None
                fh.seek(at)
                return fh.read(limit)
        except FileNotFoundError:
            return None

    def _index(self) -> HostIndex | None:
        index = read_index(self.path)
        if index is not None:
            return index
        cur, rot = _stat(self.path), _stat(self.rotated)  # an older daemon's files
        if rot is not None:
            return HostIndex(launch_id="", base=rot.st_size, ino=cur.st_ino if cur else -1,
                             rotated_base=0, rotated_ino=rot.st_ino)
        return HostIndex(launch_id="", base=0, ino=cur.st_ino) if cur is not None else None

    def read(self, limit: int = MAX_READ) -> bytes:
        """The next bytes (at most ``limit``); empty when there are none yet."""
        prefix = b""
        for _ in range(4):
            index = self._index()
            if index is None:
                return prefix
            oldest = index.rotated_base if index.rotated_base >= 0 else index.base
            if self.offset is None:
                self.offset = oldest
            if self.offset < oldest:  # no longer kept
                prefix, self.offset = DROPPED, oldest
            if self.offset >= index.base:
                data = self._read(self.path, index.ino, self.offset - index.base, limit)
            else:
                data = self._read(self.rotated, index.rotated_ino,
                                  self.offset - index.rotated_base, limit)
                if data == b"":  # the rotated file ends short of base: a gap
                    prefix, self.offset = DROPPED, index.base
                    continue
            if data is None:
                continue  # rotated meanwhile: read the new index
            self.offset += len(data)
            return prefix + data
        return prefix


class LineFilter:
    """Whole lines out of a byte stream; only one rank's lines (torchrun's
    ``[rank<R>]:`` prefix) when ``rank`` is given."""

    def __init__(self, rank: int | None = None) -> None:
        self.prefix = f"[rank{rank}]:".encode() if rank is not None else None
        self._partial = b""

    @property
    def pending(self) -> int:
        """Bytes fed but held back (the start of a line not ended yet)."""
        return len(self._partial)

    def feed(self, data: bytes, final: bool = False) -> bytes:
        buf = self._partial + data
        if final or len(buf) - buf.rfind(b"\n") > MAX_PARTIAL:
            whole, self._partial = buf, b""
        else:
            cut = buf.rfind(b"\n") + 1
            whole, self._partial = buf[:cut], buf[cut:]
        if self.prefix is None or not whole:
            return whole
        return b"".join(line for line in whole.splitlines(keepends=True)
                        if line.startswith(self.prefix))
