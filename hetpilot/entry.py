"""A job's entry point: what the agents start for it (``[entry]`` in a job file,
``JobEntry`` on the wire, ``JobRecord.entry`` in the daemon's store).

One shape, checked the same way by the client (before it sends, exit 2) and by
the daemon (INVALID_ARGUMENT), each error naming its field:

.. code-block:: toml

    [entry]
    module = "hetpilot"            # python -m MODULE ARGS...  (or:)
    # command = ["./train.sh"]     # an executable and its arguments, run as it is
    args = ["train", "--model", "mypkg.models:job", "--epochs", "3"]
    ranks_per_host = 1             # ranks per host, one device each; default: every device
    hosts = 2                      # hosts; default: every host that can, once one can
    restart_budget = 2             # torchrun --max-restarts (per host); default 0
    workdir = "/shared/project"    # absolute; default: the launch's own directory
    [entry.env]                    # extra environment of the ranks
    NCCL_DEBUG = "WARN"

Why this shape: a module (``python -m``, torchrun ``-m``) is what a Python
training script usually is, and ``module = "hetpilot"`` with ``args =
["train", ...]`` runs ``hetpilot train`` itself, which finds the job, the
daemon and its token in the environment the agent gives it; ``command`` covers
everything else (a shell script, another interpreter). torchrun's own options
are the daemon's to choose (rendezvous, node count, ranks per node from the
devices), except the restart budget, which is the job's. So the first word after
torchrun's options (``module``, ``command[0]``) never starts with '-': torchrun
would parse ``command = ["--nproc-per-node=8", ...]`` as its own option.

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from hetpilot.planner.errors import ValidationError

__all__ = ["ENTRY_KEYS", "MAX_HOSTS", "MAX_RANKS_PER_HOST", "MAX_RESTARTS", "Entry"]

ENTRY_KEYS = ("module", "command", "args", "ranks_per_host", "hosts", "restart_budget",
              "env", "workdir")
MAX_RANKS_PER_HOST = 64
"""As many as a host may register devices."""
MAX_HOSTS = 1024
MAX_RESTARTS = 100
MAX_ARGS = 256
MAX_ARG_CHARS = 4096
MAX_ENV = 64
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
RESERVED_ENV_PREFIX = "HETPILOT_"
"""Names the agent sets for the ranks (job id, daemon address, token file, devices)."""


def _text(value: object, path: str, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ValidationError(path, f"must be a string, got {type(value).__name__}")
    if not empty and not value:
        raise ValidationError(path, "must not be empty")
    if len(value) > MAX_ARG_CHARS:
        raise ValidationError(path, f"at most {MAX_ARG_CHARS} characters, got {len(value)}")
    if "\x00" in value:
        raise ValidationError(path, "must not contain NUL characters")
    return value


def _strings(value: object, path: str, *, empty_items: bool = True) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValidationError(path, f"must be a list of strings, got {type(value).__name__}")
    if len(value) > MAX_ARGS:
        raise ValidationError(path, f"at most {MAX_ARGS} items, got {len(value)}")
    return tuple(_text(v, f"{path}[{i}]", empty=empty_items) for i, v in enumerate(value))


def _count(value: object, path: str, low: int, high: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValidationError(path, f"must be an integer in [{low}, {high}]{meaning}, "
                                    f"got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A checked entry point (:meth:`from_dict` checks; the constructor does not)."""

    module: str = ""
    """``python -m module args...``; exactly one of module and command is set."""
    command: tuple[str, ...] = ()
    """An executable and its arguments (torchrun ``--no-python``)."""
    args: tuple[str, ...] = ()
    ranks_per_host: int = 0
    """Ranks per host, each on one of the host's first devices; 0: one per device."""
    hosts: int = 0
    """Hosts to launch on, once that many can; 0: every host that can, once one can."""
    restart_budget: int = 0
    """torchrun ``--max-restarts``."""
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "entry") -> Entry:
        """Check ``data`` (a job file's ``[entry]`` table, or the daemon's decoded
        ``JobEntry``) and build the entry; ValidationError names the bad field."""
        if not isinstance(data, Mapping):
            raise ValidationError(path, f"must be a table, got {type(data).__name__}")
        unknown = sorted(set(data) - set(ENTRY_KEYS))
        if unknown:
            raise ValidationError(path, f"unknown key(s) {', '.join(map(str, unknown))}; "
                                        f"known: {', '.join(ENTRY_KEYS)}")
        module = data.get("module", "")
        command = data.get("command", ())
        if bool(module) == bool(command):
            raise ValidationError(path, "set exactly one of module (python -m MODULE) and "
                                        "command (an executable and its arguments)")
        if module:
            module = _text(module, f"{path}.module")
            if not _MODULE.fullmatch(module):
                raise ValidationError(f"{path}.module", f"must be a dotted module name "
                                                        f"(mypkg.train), got {module[:60]!r}")
        cmd = _strings(command, f"{path}.command", empty_items=False) if command else ()
        if cmd and cmd[0].startswith("-"):  # torchrun would take it as one of its own options
            raise ValidationError(f"{path}.command[0]", f"must not start with '-' (torchrun "
                                  f"would read it as its own option), got {cmd[0][:60]!r}")
        env: dict[str, str] = {}
        raw_env = data.get("env", {})
        if not isinstance(raw_env, Mapping):
            raise ValidationError(f"{path}.env", f"must be a table of strings, got "
                                                 f"{type(raw_env).__name__}")
        if len(raw_env) > MAX_ENV:
            raise ValidationError(f"{path}.env", f"at most {MAX_ENV} variables, got "
                                                 f"{len(raw_env)}")
        for name, value in raw_env.items():
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                raise ValidationError(f"{path}.env", f"bad variable name {str(name)[:60]!r} "
                                                     "(letters, digits, _)")
            if name.startswith(RESERVED_ENV_PREFIX):
                raise ValidationError(f"{path}.env.{name}", f"{RESERVED_ENV_PREFIX}* names "
                                      "are the agent's (job id, daemon, token, devices)")
            env[name] = _text(value, f"{path}.env.{name}", empty=True)
        workdir = _text(data.get("workdir", ""), f"{path}.workdir", empty=True)
        if workdir and not workdir.startswith("/"):
            raise ValidationError(f"{path}.workdir", f"must be an absolute path, got "
                                                     f"{workdir[:60]!r}")
        return cls(
            module=module, command=cmd, args=_strings(data.get("args", ()), f"{path}.args"),
            ranks_per_host=_count(data.get("ranks_per_host", 0), f"{path}.ranks_per_host",
                                  0, MAX_RANKS_PER_HOST, " (0: one per device)"),
            hosts=_count(data.get("hosts", 0), f"{path}.hosts", 0, MAX_HOSTS,
                         " (0: every host that can)"),
            restart_budget=_count(data.get("restart_budget", 0), f"{path}.restart_budget", 0,
                                  MAX_RESTARTS, ""),
            env=env, workdir=workdir)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (lists, dict), the keys :meth:`from_dict` reads."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else (
                dict(value) if isinstance(value, Mapping) else value)
        return out

    def describe(self) -> str:
        """One line: what runs on each host."""
        what = (f"python -m {self.module}" if self.module else " ".join(self.command))
        return " ".join([what, *self.args])
