"""Launched jobs' output on the daemon: what each host's agent ships
(``AgentReport.logs``) is appended to ``state_dir/logs/<job>/<host>.log`` and
served by ``JobService.StreamLogs`` (``hetpilot logs``).

Bounded: when a host's file would pass half of ``log_bytes_per_host`` it
becomes ``<host>.log.1`` (replacing the one before) and a new file starts, so
a host keeps between half and all of its newest ``log_bytes_per_host`` bytes.

Exactly once, mostly: each chunk carries its offset in the launch's output on
the host, and the daemon remembers, per (launch, host), how far it has
written, so a chunk resent after a lost ack (a broken stream, an agent
restart) is written once. That memory is not persisted: a daemon restarted
between writing a chunk and its ack may write that chunk twice.

A write that fails (disk full) drops the chunk with a warning rather than
failing the agent's report stream, whose reports are also its heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from .decode import RateLimitedLog

__all__ = ["MAX_READ", "HostReader", "JobLogs", "LineFilter"]

log = logging.getLogger("hetpilot.daemon")

MAX_READ = 1024 * 1024
"""Bytes one read (one LogLines message) carries at most."""
MAX_PARTIAL = 64 * 1024
"""A line longer than this is sent in pieces rather than held back."""


class JobLogs:
    def __init__(self, root: Path, max_bytes_per_host: int) -> None:
        self.root = root
        self.rotate_at = max(1, max_bytes_per_host // 2)
        self._received: dict[tuple[str, str], int] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._warn = RateLimitedLog()

    def path(self, job_id: str, host: str) -> Path:
        """Where ``host``'s output of ``job_id`` is kept (ids and hosts are checked names:
        no slashes, no leading dot)."""
        return self.root / job_id / f"{host}.log"

    def received(self, launch_id: str, host: str) -> int | None:
        """Bytes of the launch's output on ``host`` written so far (None: none since the
        daemon started)."""
        return self._received.get((launch_id, host))

    def append(self, job_id: str, host: str, launch_id: str, offset: int, data: bytes) -> None:
        """Write what of ``data`` (the host's output from ``offset``) is new."""
        key = (launch_id, host)
        have = self._received.get(key)
        if have is not None:
            if offset + len(data) <= have:
                return  # resent: written already
            if offset < have:
                data, offset = data[have - offset:], have
        if not data:
            self._received[key] = max(have or 0, offset)
            return
        path = self.path(job_id, host)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(data) > self.rotate_at:
                os.replace(path, path.with_name(path.name + ".1"))
            with open(path, "ab") as fh:
                fh.write(data)
        except OSError as exc:
            self._warn.warn(f"logs:{job_id}", "job %s: output of host %s dropped: %s", job_id,
                            host, exc)
            return
        self._received[key] = offset + len(data)
        self.notify(job_id)

    def notify(self, job_id: str) -> None:
        """Wake the job's followers (new output, or the job or its launch changed)."""
        ev = self._events.pop(job_id, None)
        if ev is not None:
            ev.set()

    def event(self, job_id: str) -> asyncio.Event:
        """Set at the next :meth:`notify` of ``job_id``."""
        return self._events.setdefault(job_id, asyncio.Event())


class HostReader:
    """Reads one host's kept output from the start (the rotated file first), then what
    is appended, following rotations."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rotated = path.with_name(path.name + ".1")
        self._ino: int | None = None
        self._pos = 0

    @staticmethod
    def _ino_of(path: Path) -> int | None:
        try:
            return path.stat().st_ino
        except FileNotFoundError:
            return None

    def _read(self, path: Path, limit: int) -> bytes | None:
        """From our position in ``path`` if it is still our file; None if it is not."""
        try:
            with open(path, "rb") as fh:
                if os.fstat(fh.fileno()).st_ino != self._ino:
                    return None
                fh.seek(self._pos)
                data = fh.read(limit)
        except FileNotFoundError:
            return None
        self._pos += len(data)
        return data

    def read(self, limit: int = MAX_READ) -> bytes:
        """The next bytes (at most ``limit``); empty when there are none yet."""
        if self._ino is None:
            self._ino = self._ino_of(self.rotated) or self._ino_of(self.path)
            self._pos = 0
            if self._ino is None:
                return b""
        data = self._read(self.path, limit)
        if data is not None:
            return data
        data = self._read(self.rotated, limit)  # ours was rotated: its rest first
        if data:
            return data
        lost = data is None  # rotated twice since: what we had not read is gone
        self._ino, self._pos = self._ino_of(self.path), 0
        if self._ino is None:
            return b""
        rest = self._read(self.path, limit) or b""
        return (b"[hetpilot: older output of this host was dropped]\n" if lost else b"") + rest


class LineFilter:
    """Whole lines out of a byte stream; only one rank's lines (torchrun's
    ``[rank<R>]:`` prefix) when ``rank`` is given."""

    def __init__(self, rank: int | None = None) -> None:
        self.prefix = f"[rank{rank}]:".encode() if rank is not None else None
        self._partial = b""

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
