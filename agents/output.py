"""A launch's output on its agent's disk: one copy, at most ``cap`` bytes.

The runner (:mod:`hetpilot.agents.runner`) appends everything torchrun and the ranks
print to ``<dir>/<offset>.log`` segments, each named by the offset of its first byte
in the launch's whole output (16 digits). A new segment starts every ``cap / 4``
bytes; once the segments hold more than ``cap`` bytes, the oldest are removed. The
agent reads by offset (:class:`OutputReader`): output it has not sent yet that was
dropped comes back as one marker line in its place, so the daemon's copy says where
and how much is missing ("[hetpilot] N bytes of output dropped ...").
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["DEFAULT_CAP", "MIN_CAP", "OutputReader", "OutputWriter", "marker"]

DEFAULT_CAP = 256 * 1024 * 1024
"""The agent's ``[launch] output_bytes`` default."""
MIN_CAP = 64 * 1024
_SUFFIX = ".log"


def _name(offset: int) -> str:
    return f"{offset:016d}{_SUFFIX}"


def marker(dropped: int, cap: int) -> bytes:
    """The line that stands for ``dropped`` bytes of output removed on the agent."""
    return (f"\n[hetpilot] {dropped} bytes of output dropped here on the agent before "
            f"they were sent (launch output cap: [launch] output_bytes = {cap})\n").encode()


class OutputReader:
    """The segments of one launch's output (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)

    def segments(self) -> list[tuple[int, Path, int]]:
        """(offset, path, size) of each segment, oldest first."""
        out = []
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        for name in names:
            if not name.endswith(_SUFFIX) or not name[:-len(_SUFFIX)].isdigit():
                continue
            path = self.dir / name
            try:
                size = os.lstat(path).st_size
            except OSError:
                continue
            out.append((int(name[:-len(_SUFFIX)]), path, size))
        return sorted(out)

    def end(self) -> int:
        """Bytes the launch has written in all (its whole output's size)."""
        segs = self.segments()
        return segs[-1][0] + segs[-1][2] if segs else 0

    def on_disk(self) -> int:
        return sum(size for _, _, size in self.segments())

    def read(self, offset: int, limit: int, cap: int = 0) -> tuple[int, bytes]:
        """Up to ``limit`` bytes from ``offset`` as (offset, data). Output dropped from
        ``offset`` on comes back as :func:`marker` ending where the kept output starts
        (so ``offset + len(data)`` is where to read next)."""
        segs = self.segments()
        if not segs or offset >= segs[-1][0] + segs[-1][2]:
            return offset, b""
        prefix = b""
        if offset < segs[0][0]:  # dropped before it was read
            gap = segs[0][0] - offset
            line = marker(gap, cap)
            prefix = line if len(line) <= gap else line[:gap]
            offset = segs[0][0] - len(prefix)
            limit = max(limit - len(prefix), 1)
            start = segs[0][0]
        else:
            start = offset
        data = b""
        for base, path, size in segs:
            if len(data) >= limit:
                break
            if start >= base + size:
                continue
            if start < base:  # a segment removed while we listed: stop at the gap
                break
            want = min(limit - len(data), base + size - start)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                break
            with os.fdopen(fd, "rb") as fh:
                fh.seek(start - base)
                got = fh.read(want)
            data += got
            start += len(got)
            if len(got) < want:
                break
        if not data and not prefix:
            return offset, b""
        return offset, prefix + data

    def read_bytes(self) -> bytes:
        """Everything still on disk, oldest first."""
        end = self.end()
        segs = self.segments()
        return self.read(segs[0][0], end - segs[0][0])[1] if segs else b""

    def tail(self, n: int) -> bytes:
        """The last ``n`` bytes on disk (for an exit's reason)."""
        end = self.end()
        segs = self.segments()
        if not segs:
            return b""
        start = max(end - n, segs[0][0])
        return self.read(start, n)[1]


class OutputWriter:
    """Appends a launch's output to its segments, keeping at most ``cap`` bytes (the
    runner's side; see the module docstring). A write the disk refuses (full) is
    dropped and counted, never raised: the launch goes on."""

    def __init__(self, directory: Path, cap: int = DEFAULT_CAP) -> None:
        self.dir = Path(directory)
        self.cap = max(int(cap), MIN_CAP)
        self.segment_bytes = self.cap // 4
        self.lost = 0
        """Bytes the disk refused."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self._segs = [(base, size) for base, _, size in OutputReader(self.dir).segments()]
        self._fd = -1

    @property
    def end(self) -> int:
        return self._segs[-1][0] + self._segs[-1][1] if self._segs else 0

    def write(self, data: bytes) -> None:
        while data:
            full = self._fd < 0 or self._segs[-1][1] >= self.segment_bytes
            if full and not self._new_segment():
                self.lost += len(data)
                return
            base, size = self._segs[-1]
            piece = data[:self.segment_bytes - size]
            try:
                n = os.write(self._fd, piece)
            except OSError:  # full: this output is lost, later output may fit
                self.lost += len(data)
                return
            self._segs[-1] = (base, size + n)
            data = data[n:]
            self._trim()

    def _new_segment(self) -> bool:
        end = self.end
        try:
            fd = os.open(self.dir / _name(end), os.O_WRONLY | os.O_CREAT | os.O_APPEND
                         | os.O_NOFOLLOW, 0o600)
        except OSError:
            return False
        self.close()
        self._fd = fd
        if not self._segs or self._segs[-1][0] != end:
            self._segs.append((end, 0))
        return True

    def _trim(self) -> None:
        while len(self._segs) > 1 and sum(s for _, s in self._segs) > self.cap:
            base, _ = self._segs.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / _name(base))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
