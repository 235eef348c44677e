"""What the agent's tenancy tests (and bench/agent_tenancy.py) make on this machine as
root, and remove after: unix users with unique names, a small file system, a state
directory others may pass through. Each says why it cannot, for a skip."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PROBE", "fill", "shared_dir", "small_fs", "unix_users", "why_no_users"]

PROBE = """
import json, os, sys
targets, rank = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for what, path in targets.items():
    try:
        if os.path.isdir(path):
            out[what] = "listed %d entries" % len(os.listdir(path))
        else:
            with open(path, "rb") as fh:
                out[what] = "READ %d bytes" % len(fh.read())
    except OSError as exc:
        out[what] = "denied (%s)" % type(exc).__name__
try:
    os.kill(rank, 0)
    out["signal A's rank (kill -0)"] = "ALLOWED"
except OSError as exc:
    out["signal A's rank (kill -0)"] = "denied (%s)" % type(exc).__name__
print("PROBE " + json.dumps(out), flush=True)
"""
"""Another owner's rank: ``python -c PROBE TARGETS_JSON RANK_PID`` tries to read (or
list) each target and to signal that pid, and prints one line, ``PROBE {what: result}``."""


def why_no_users() -> str:
    """Why this process cannot make unix users that run this Python ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (useradd, and an agent that switches users)"
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        return "no useradd/userdel on this machine"
    return ""


@contextlib.contextmanager
def unix_users(count: int) -> Iterator[list[str]]:
    """``count`` new users (with homes), removed with ``userdel -r`` after. Folders above
    this Python that others cannot pass through are opened (o+x) for the while and put
    back after."""
    names = [f"hp{uuid.uuid4().hex[:10]}" for _ in range(count)]
    made: list[str] = []
    opened: list[tuple[Path, int]] = []
    try:
        for name in names:
            subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True,
                           capture_output=True)
            made.append(name)
        why = _why_user_cannot_run_python(names[0])
        if why:
            # Most often a folder above the interpreter or the checkout is 0700 (root's
            # home): let others pass through it (o+x, not list) for the test only.
            opened.extend(_open_for_passage())
            why = _why_user_cannot_run_python(names[0])
        if why:
            import pytest

            pytest.skip(f"a new user cannot run this Python ({sys.executable}): {why}")
        yield names
    finally:
        for name in made:  # -f: even if a process of the test is still ending
            subprocess.run(["userdel", "-r", "-f", name], capture_output=True)
        for folder, mode in reversed(opened):
            with contextlib.suppress(OSError):
                os.chmod(folder, mode)


def _why_user_cannot_run_python(user: str) -> str:
    import pwd

    gid = pwd.getpwnam(user).pw_gid  # as the agent switches: uid, gid and groups
    try:
        probe = subprocess.run([sys.executable, "-c", "import hetpilot.agents.rankio"],
                               user=user, group=gid, extra_groups=[], capture_output=True,
                               cwd="/")
    except OSError as exc:
        return str(exc)
    return probe.stderr.decode(errors="replace").strip()[-200:] if probe.returncode else ""


def _open_for_passage() -> list[tuple[Path, int]]:
    """Add o+x to every folder above this Python and the hetpilot package that lacks it;
    returns (folder, old mode) to put back."""
    import hetpilot

    opened: list[tuple[Path, int]] = []
    leaves = {Path(sys.executable).resolve(), Path(sys.executable).absolute(),
              Path(sys.prefix).resolve(), Path(hetpilot.__file__).resolve()}
    for leaf in leaves:
        for folder in reversed(leaf.parents):
            mode = folder.stat().st_mode & 0o7777
            if not mode & stat.S_IXOTH and all(f != folder for f, _ in opened):
                os.chmod(folder, mode | stat.S_IXOTH)
                opened.append((folder, mode))
    return opened


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A new directory under /tmp that other users may pass through (0711), not list."""
    path = Path(tempfile.mkdtemp(prefix="hetpilot-", dir="/tmp"))
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def small_fs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -t tmpfs -o size=4m``) on a new directory in
    ``where``, unmounted after; skips the test when it cannot be made."""
    import pytest

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a small file system")
    point = where / "smallfs"
    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0711", "tmpfs",
                           str(point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def fill(mnt: Path) -> Path:
    """Take every free byte of the file system at ``mnt`` with one new file; return it
    (remove it to give the space back)."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            while True:
                try:
                    os.write(fd, b"\xa5" * chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return filler
