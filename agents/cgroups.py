"""Per-launch cgroups: the kernel's bound on one launch's memory and processes.

The agent makes one cgroup per launch under its own cgroup (``<own>/hetpilot-<scope>/
<launch id>``, where ``scope`` is a hash of the agent's state directory, so two agents
on one machine never touch each other's), writes the ``[launch]`` limits into it, and
the launch's runner joins it before it starts anything (:mod:`hetpilot.agents.runner`,
``--cgroup``): torchrun and every rank inherit it and cannot leave it (its files are
root's). When the launch ends the agent reads whether a limit ended it, kills whatever
is left in it (cgroup v2 ``cgroup.kill``; v1: SIGKILL to each process in
``cgroup.procs`` until it is empty) and removes it. An agent that starts removes the
cgroups of its scope whose launches no longer run.

Hierarchies, found from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``:

- cgroup v2 (unified): the agent's cgroup must offer ``memory`` and ``pids`` (its
  ``cgroup.controllers``; systemd gives them with ``Delegate=``). They are enabled
  in its ``cgroup.subtree_control``; a cgroup with processes cannot enable them, so
  the agent first moves itself into a leaf, ``<own>/hetpilot-agent``.
- cgroup v1: the ``memory`` and ``pids`` hierarchies, each at the agent's own cgroup
  in it (``/proc/self/cgroup``), writable.

The one offering more of ``memory`` and ``pids`` is used (v2 on a tie); a launch needs
the controllers of the limits it sets. Limits: v2 ``memory.max`` (and
``memory.swap.max`` 0, so swap does not stretch it) and ``pids.max``; v1
``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` when swap is accounted,
else ``memory.swappiness`` 0) and ``pids.max``. What ended a launch: v2
``memory.events`` ``oom_kill`` and ``pids.events`` ``max``; v1 ``memory.oom_control``
``oom_kill`` (``memory.failcnt`` on kernels without it) and ``pids.events`` ``max``.

Everything here is small file reads and writes in cgroupfs: it runs on the agent's
event loop. No torch, no grpc.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CONTROLLERS", "Hierarchy", "LaunchGroups", "Limits", "find_hierarchy",
           "format_bytes", "parse_mountinfo", "parse_proc_cgroup", "scope_name"]

log = logging.getLogger("hetpilot.agent")

CONTROLLERS = ("memory", "pids")
AGENT_LEAF = "hetpilot-agent"
"""Where the agent moves itself in a v2 cgroup whose children need controllers."""
KILL_ROUNDS = 50
"""SIGKILL rounds over ``cgroup.procs`` (v1) per try; processes forked meanwhile are
caught by the next round, and ``pids.max`` bounds how many there can be."""
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")


@dataclass(frozen=True)
class Limits:
    """A launch's limits (0: none)."""

    memory_max: int = 0
    """Bytes of memory (anonymous and page cache, every process of the launch)."""
    tasks_max: int = 0
    """Processes and threads of the launch together, its runner's included."""

    def controllers(self) -> tuple[str, ...]:
        """The controllers these limits need."""
        return tuple(c for c, v in (("memory", self.memory_max), ("pids", self.tasks_max))
                     if v)

    def __str__(self) -> str:
        said = [f"memory_max {format_bytes(self.memory_max)}" if self.memory_max else "",
                f"tasks_max {self.tasks_max}" if self.tasks_max else ""]
        return ", ".join(s for s in said if s) or "no limits"


def format_bytes(n: int) -> str:
    """``64 MiB``, ``1.5 GiB``, ``100 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def scope_name(state_dir: Path) -> str:
    """The cgroup that holds one agent's launches: ``hetpilot-<hash of its state dir>``
    (an agent's state dir is its own: :func:`~hetpilot.agents.launchstate.lock_state_dir`)."""
    digest = hashlib.sha256(str(Path(state_dir).absolute()).encode()).hexdigest()[:12]
    return f"hetpilot-{digest}"


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup``: controller -> cgroup path ("" is the v2 hierarchy's)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, names, path = parts
        if not names:
            out[""] = path
        for name in names.split(","):
            if name:
                out[name] = path
    return out


@dataclass(frozen=True)
class Mount:
    point: Path
    root: str
    """The cgroup the mount shows at its top (not "/" inside some containers)."""
    version: int
    options: frozenset[str]


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup mounts of ``/proc/<pid>/mountinfo``."""
    out: list[Mount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        out.append(Mount(point=Path(point), root=fields[3], version=2 if tail[0] == "cgroup2"
                         else 1, options=frozenset(tail[2].split(","))))
    return out


def _inside(mount: Mount, path: str) -> Path | None:
    """The directory of cgroup ``path`` under ``mount`` (None: the mount does not show
    it)."""
    root = mount.root.rstrip("/")
    if root and path != root and not path.startswith(root + "/"):
        return None
    rest = path[len(root):].lstrip("/")
    return mount.point / rest if rest else mount.point


@dataclass
class Hierarchy:
    """Where one agent's launch cgroups go: each base directory (the agent's own cgroup
    in a hierarchy) and the controllers it offers; or why there is none."""

    version: int = 0
    bases: dict[Path, frozenset[str]] = field(default_factory=dict)
    why_not: str = ""
    """Why nothing usable was found ("" when ``bases`` is set)."""

    def controllers(self) -> frozenset[str]:
        return frozenset().union(*self.bases.values()) if self.bases else frozenset()

    def describe(self) -> str:
        if not self.bases:
            return f"none ({self.why_not})"
        return f"cgroup v{self.version}: " + "; ".join(
            f"{base} ({', '.join(sorted(c)) or 'no controllers'})"
            for base, c in self.bases.items())


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _v2(mount: Mount, own: str) -> tuple[Path | None, frozenset[str], str]:
    """The agent's v2 cgroup directory, the controllers its children can have, why not."""
    base = _inside(mount, own)
    if base is None or not base.is_dir():
        return None, frozenset(), f"cgroup v2 at {mount.point} does not show the agent's " \
                                  f"cgroup {own}"
    if not os.access(base, os.W_OK):
        return None, frozenset(), f"cgroup v2 {base} is not writable by the agent"
    offered = frozenset(_read(base / "cgroup.controllers").split()) & set(CONTROLLERS)
    enabled = frozenset(_read(base / "cgroup.subtree_control").split()) & offered
    missing = offered - enabled
    if missing:
        why = _enable_v2(base, missing)
        if why:
            return base, enabled, why
        enabled = offered
    lacking = set(CONTROLLERS) - offered
    return base, enabled, (f"cgroup v2 {base} offers no {' or '.join(sorted(lacking))} "
                           "controller (systemd: Delegate=memory pids)" if lacking else "")


def _enable_v2(base: Path, controllers: Iterable[str]) -> str:
    """Enable ``controllers`` for the children of ``base``, moving this process into a
    leaf of it first if it must; why not ("" when done)."""
    text = " ".join(f"+{c}" for c in sorted(controllers))
    try:
        (base / "cgroup.subtree_control").write_text(text)
        return ""
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            return f"cannot enable {text} in {base}/cgroup.subtree_control: {exc.strerror}"
    try:  # processes in base (this agent): into a leaf of it, then again
        leaf = base / AGENT_LEAF
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
        (base / "cgroup.subtree_control").write_text(text)
        log.info("moved the agent into %s to enable %s for its launches", leaf, text)
        return ""
    except OSError as exc:
        return (f"cannot enable {text} in {base}/cgroup.subtree_control: {exc.strerror} "
                "(other processes share the agent's cgroup: run it in a cgroup of its own, "
                "e.g. a systemd unit with Delegate=memory pids)")


def find_hierarchy(proc_cgroup: str | None = None, mountinfo: str | None = None) -> Hierarchy:
    """Where this process can make launch cgroups (see the module docstring)."""
    own = parse_proc_cgroup(_read(Path("/proc/self/cgroup")) if proc_cgroup is None
                            else proc_cgroup)
    mounts = parse_mountinfo(_read(Path("/proc/self/mountinfo")) if mountinfo is None
                             else mountinfo)
    whys: list[str] = []
    v2 = Hierarchy(version=2)
    mount2 = next((m for m in mounts if m.version == 2), None)
    if mount2 is not None and "" in own:
        base, enabled, why = _v2(mount2, own[""])
        if base is not None:
            v2.bases[base] = enabled
        if why:
            whys.append(why)
    v1 = Hierarchy(version=1)
    for name in CONTROLLERS:
        mount = next((m for m in mounts if m.version == 1 and name in m.options), None)
        if mount is None or name not in own:
            whys.append(f"no cgroup v1 {name} hierarchy")
            continue
        base = _inside(mount, own[name])
        if base is None or not base.is_dir():
            whys.append(f"cgroup v1 {name} at {mount.point} does not show the agent's "
                        f"cgroup {own[name]}")
        elif not os.access(base, os.W_OK):
            whys.append(f"cgroup v1 {name} {base} is not writable by the agent")
        else:
            v1.bases[base] = v1.bases.get(base, frozenset()) | {name}
    best = max((v2, v1), key=lambda h: (len(h.controllers()), bool(h.bases), h.version == 2))
    if not best.bases:
        return Hierarchy(why_not="; ".join(whys) or "no cgroup file system mounted")
    best.why_not = "; ".join(whys)
    return best


def _procs(directory: Path) -> list[int]:
    return [int(p) for p in _read(directory / "cgroup.procs").split() if p.isdigit()]


def _events(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value.strip())
    return out


class LaunchGroups:
    """The cgroups of one agent's launches (see the module docstring)."""

    def __init__(self, state_dir: Path, limits: Limits | None = None,
                 hierarchy: Hierarchy | None = None) -> None:
        self.scope = scope_name(state_dir)
        self.limits = limits or Limits()
        self.hierarchy = hierarchy if hierarchy is not None else find_hierarchy()
        self._pending: dict[str, float] = {}
        """Launches whose cgroups are not removed yet (still emptying): first try."""

    def why_not(self) -> str:
        """Why launches cannot get a cgroup with the limits ("" when they can)."""
        if not self.hierarchy.bases:
            return f"no usable cgroup hierarchy: {self.hierarchy.why_not}"
        lacking = set(self.limits.controllers()) - self.hierarchy.controllers()
        if lacking:
            return (f"no cgroup {' or '.join(sorted(lacking))} controller for {self.limits}: "
                    f"{self.hierarchy.why_not or self.hierarchy.describe()}")
        return ""

    def status(self) -> str:
        """One line for the agent's log: where the launches' cgroups go and what they
        bound, or why they get none."""
        why = self.why_not()
        if why:
            return f"per-launch limits ({self.limits}) not enforced: {why}"
        return (f"per-launch cgroups ({self.limits}) in {self.hierarchy.describe()}, "
                f"under {self.scope}/")

    def dirs(self, launch_id: str) -> list[Path]:
        """The directories of ``launch_id``'s cgroup (one per hierarchy base)."""
        return [base / self.scope / launch_id for base in self.hierarchy.bases]

    def create(self, launch_id: str) -> list[Path]:
        """Make ``launch_id``'s cgroup with the limits; the directories its runner joins
        (empty when there is no hierarchy). OSError when it cannot be made (then nothing
        of it is left)."""
        if not self.hierarchy.bases:
            return []
        if not _SAFE.fullmatch(launch_id) or ".." in launch_id:
            raise OSError(errno.EINVAL, f"bad launch id {launch_id!r}")
        made: list[Path] = []
        try:
            for base, controllers in self.hierarchy.bases.items():
                scope = base / self.scope
                if not scope.is_dir():
                    scope.mkdir()
                    if self.hierarchy.version == 2 and controllers:
                        (scope / "cgroup.subtree_control").write_text(
                            " ".join(f"+{c}" for c in sorted(controllers)))
                directory = scope / launch_id
                directory.mkdir()
                made.append(directory)
                self._write_limits(directory, controllers)
        except OSError:
            for directory in made:
                self._remove(directory)
            raise
        return made

    def _write_limits(self, directory: Path, controllers: frozenset[str]) -> None:
        memory, tasks = self.limits.memory_max, self.limits.tasks_max
        if memory and "memory" in controllers:
            if self.hierarchy.version == 2:
                (directory / "memory.max").write_text(str(memory))
                if (directory / "memory.swap.max").exists():
                    (directory / "memory.swap.max").write_text("0")
            else:
                (directory / "memory.limit_in_bytes").write_text(str(memory))
                if (directory / "memory.memsw.limit_in_bytes").exists():
                    (directory / "memory.memsw.limit_in_bytes").write_text(str(memory))
                elif (directory / "memory.swappiness").exists():  # no swap accounting
                    with contextlib.suppress(OSError):
                        (directory / "memory.swappiness").write_text("0")
        if tasks and "pids" in controllers:
            (directory / "pids.max").write_text(str(tasks))

    def exceeded(self, launch_id: str) -> str:
        """Which limit ended processes of ``launch_id`` ("" when none did)."""
        said: list[str] = []
        v2 = self.hierarchy.version == 2
        for directory in self.dirs(launch_id):
            if self.limits.memory_max:
                if v2:
                    kills = _events(directory / "memory.events").get("oom_kill", 0)
                    hits = 0
                else:
                    oom = _events(directory / "memory.oom_control")
                    kills = oom.get("oom_kill", 0)
                    hits = 0 if "oom_kill" in oom else \
                        int(_read(directory / "memory.failcnt").strip() or 0)
                if kills:
                    said.append(f"launch exceeded memory_max {format_bytes(self.limits.memory_max)}"
                                f" (OOM kill: {kills} process(es) killed by the kernel)")
                elif hits:
                    said.append(f"launch reached memory_max "
                                f"{format_bytes(self.limits.memory_max)} {hits} time(s)")
            if self.limits.tasks_max:
                refused = _events(directory / "pids.events").get("max", 0)
                if refused:
                    said.append(f"launch reached tasks_max {self.limits.tasks_max} "
                                f"({refused} fork(s) or thread(s) refused by the kernel)")
        return "; ".join(dict.fromkeys(said))

    def end(self, launch_id: str) -> str:
        """``launch_id`` ended: which limit ended it (:meth:`exceeded`), then SIGKILL to
        whatever is left in its cgroup and remove it (or, while processes are still
        going, at a later :meth:`tidy`)."""
        dirs = [d for d in self.dirs(launch_id) if d.is_dir()]
        if not dirs:
            return ""
        said = self.exceeded(launch_id)
        if not self._empty(launch_id):
            self._pending.setdefault(launch_id, time.monotonic())
        return said

    def _empty(self, launch_id: str) -> bool:
        """Kill what is left in ``launch_id``'s cgroup and remove it; True when gone."""
        gone = True
        for directory in self.dirs(launch_id):
            if not directory.is_dir():
                continue
            left = self.kill(directory)
            if left:
                log.info("launch %s: %d process(es) still in %s after SIGKILL", launch_id,
                         left, directory)
            if not self._remove(directory):
                gone = False
        if gone:
            for base in self.hierarchy.bases:  # the scope goes with its last launch
                with contextlib.suppress(OSError):
                    (base / self.scope).rmdir()
        return gone

    def kill(self, directory: Path) -> int:
        """SIGKILL every process in the cgroup ``directory``; how many were still
        there after the last round."""
        killer = directory / "cgroup.kill"
        if self.hierarchy.version == 2 and killer.exists():
            with contextlib.suppress(OSError):
                killer.write_text("1")
        left: list[int] = []
        for _ in range(KILL_ROUNDS):
            left = _procs(directory)
            if not left:
                return 0
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        return len(left)

    @staticmethod
    def _remove(directory: Path) -> bool:
        try:
            directory.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

    def pending(self) -> list[str]:
        """Launches whose cgroups are still being emptied."""
        return list(self._pending)

    def tidy(self) -> None:
        """Try again to empty and remove the cgroups of launches that ended."""
        for launch_id, since in list(self._pending.items()):
            if self._empty(launch_id):
                del self._pending[launch_id]
            elif time.monotonic() - since > 30.0:
                log.warning("launch %s: its cgroup still holds processes %.0f s after it "
                            "ended (SIGKILL sent; uninterruptible?)", launch_id,
                            time.monotonic() - since)
                self._pending[launch_id] = time.monotonic()

    def sweep(self, running: Mapping[str, object] | Iterable[str]) -> list[str]:
        """Kill and remove the cgroups of this agent's scope whose launches are not in
        ``running`` (left by an agent that ended); their launch ids."""
        keep = set(running)
        found: set[str] = set()
        for base in self.hierarchy.bases:
            scope = base / self.scope
            with contextlib.suppress(OSError):
                found.update(p.name for p in scope.iterdir()
                             if p.is_dir() and p.name not in keep)
        for launch_id in sorted(found):
            log.warning("launch %s: its cgroup outlived it (an earlier agent's): killing "
                        "what is in it and removing it", launch_id)
            if not self._empty(launch_id):
                self._pending.setdefault(launch_id, time.monotonic())
        return sorted(found)
