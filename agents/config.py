"""Agent configuration: frozen keyword-only dataclasses from one TOML file."""

from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hetpilot.tomlconfig import ConfigError, build, read_tables, table

from .cgroups import Limits

__all__ = ["AgentConfig", "ConfigError", "EmulatedDevice", "LaunchConfig", "load_agent_config",
           "parse_emulate"]

RUN_AS = ("owner", "agent")


def _check(name: str, value: Any, *, positive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ConfigError(f"{name}: must be a {'positive' if positive else 'non-negative'} "
                          f"number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EmulatedDevice:
    """A fake device for CPU-only test clusters; reported with emulated=true."""

    tflops: float
    """Declared sustained TFLOP/s."""
    memory_gb: float
    """Declared memory, decimal GB."""
    price_per_hour: float = 0.0
    power_watts: float = 0.0
    count: int = 1
    """How many such devices the host declares."""

    def __post_init__(self) -> None:
        _check("emulate.tflops", self.tflops)
        _check("emulate.memory_gb", self.memory_gb)
        _check("emulate.price_per_hour", self.price_per_hour, positive=False)
        _check("emulate.power_watts", self.power_watts, positive=False)
        if not isinstance(self.count, int) or not 1 <= self.count <= 64:
            raise ConfigError(f"emulate.count: must be an integer in [1, 64], got {self.count!r}")


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
MIN_MEMORY_MAX = 32 * 1024 * 1024
MIN_TASKS_MAX = 8


def parse_size(name: str, value: Any) -> int:
    """Bytes from an integer or a string such as ``"64G"``, ``"512MiB"`` or ``"1.5G"``
    (K, M, G, T: powers of 1024, as systemd's ``MemoryMax=``); 0 or ``"max"``: no limit.
    ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name}: must be bytes (an integer) or a size such as \"64G\", "
                          f"got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("max", "infinity", ""):
            return 0
        match = _SIZE.fullmatch(text)
        if match is None:
            raise ConfigError(f"{name}: not a size (bytes, or a number with K, M, G or T, "
                              f"e.g. \"64G\"), got {value!r}")
        scale = 1024 ** " KMGT".index(match.group(2).upper() or " ")
        value = int(float(match.group(1)) * scale)
    if value < 0:
        raise ConfigError(f"{name}: must not be negative, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """``[launch]``: how this host runs the ranks it launches."""

    run_as: str = "owner"
    """``"owner"``: each launch's ranks run as its job owner's unix user (the daemon's
    owner tokens file names it); the agent must run as root (or hold CAP_SETUID and
    CAP_SETGID), and a launch whose owner has none fails naming why. ``"agent"``:
    every launch runs as the agent's own user, for hosts whose owners trust each
    other (they can read each other's tokens, output and environment)."""
    output_bytes: int = 256 * 1024 * 1024
    """Output of one launch kept on this host; past it the oldest is dropped (a marker
    line says how much, where). The daemon keeps its own copy (``log_bytes_per_host``)."""

    memory_max: int | str = 0
    """Memory of one launch (every process of it, page cache included), enforced by the
    kernel in a cgroup of its own: bytes, or ``"64G"``-style (1024-based); 0: none. A
    launch past it has a process OOM-killed, and its job fails naming the limit."""
    tasks_max: int = 0
    """Processes and threads of one launch together (its runner, torchrun, the ranks and
    all their threads), enforced in its cgroup; a fork past it fails. 0: none."""
    require_limits: bool = False
    """Refuse every launch (its job fails naming why) when the host has no usable
    cgroup hierarchy for the limits set; false: launch without them, and say so once
    at start."""

    def __post_init__(self) -> None:
        memory = parse_size("launch.memory_max", self.memory_max)
        if memory and memory < MIN_MEMORY_MAX:
            raise ConfigError(f"launch.memory_max: must be at least 32M (or 0: none), got "
                              f"{self.memory_max!r}")
        object.__setattr__(self, "memory_max", memory)
        if isinstance(self.tasks_max, bool) or not isinstance(self.tasks_max, int) or (
                self.tasks_max and not MIN_TASKS_MAX <= self.tasks_max <= 4_194_304):
            raise ConfigError(f"launch.tasks_max: must be an integer in [{MIN_TASKS_MAX}, "
                              f"4194304] (or 0: none), got {self.tasks_max!r}")
        if self.require_limits is not True and self.require_limits is not False:
            raise ConfigError(f"launch.require_limits: must be true or false, got "
                              f"{self.require_limits!r}")
        if self.require_limits and not (memory or self.tasks_max):
            raise ConfigError("launch.require_limits: set memory_max or tasks_max too (it "
                              "requires the limits they set)")
        if self.run_as not in RUN_AS:
            raise ConfigError(f"launch.run_as: must be \"owner\" or \"agent\", got "
                              f"{self.run_as!r}")
        if not isinstance(self.output_bytes, int) or self.output_bytes < 65536:
            raise ConfigError(f"launch.output_bytes: must be an integer >= 65536, got "
                              f"{self.output_bytes!r}")

    def limits(self) -> Limits:
        """The per-launch limits (:mod:`hetpilot.agents.cgroups`)."""
        return Limits(memory_max=int(self.memory_max), tasks_max=self.tasks_max)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    daemon: str = ""
    """host:port of the daemon."""
    host: str = field(default_factory=socket.gethostname)
    """This host's name in the cluster (device ids are "<host>:<index>")."""
    probe_listen: str = "0.0.0.0:7071"
    """TCP probe server address peers measure bandwidth and RTT against; port 0: OS picks."""
    probe_advertise: str = ""
    """Address peers dial; defaults to probe_listen with the host name when it binds 0.0.0.0."""
    token: str = ""
    """Cluster bearer token (inline, tests only)."""
    token_file: str = ""
    """File holding the cluster token; used when token is empty."""
    ca_file: str = ""
    """PEM CA of the daemon's certificate; TLS is on when set."""
    cert_file: str = ""
    """Client certificate for mutual TLS."""
    key_file: str = ""
    price_per_hour: float = 0.0
    """Price of each real device of this host (measured devices carry no price)."""
    power_watts: float = 0.0
    reprobe_interval_s: float = 300.0
    """How often the matmul probe re-measures each device."""
    link_probe_interval_s: float = 30.0
    """How often peers' bandwidth and RTT are measured."""
    link_probe_bytes: int = 4_000_000
    """Bytes sent per bandwidth probe."""
    call_timeout_s: float = 5.0
    """Deadline of every unary call and of each report's ack."""
    max_backoff_s: float = 10.0
    """Reconnect backoff cap (starts at 0.2 s, doubles, with jitter)."""
    job_pattern: str = r"hetpilot(\.trainer| train\b)"
    """Regex over process command lines: the job's own processes (trainer ranks),
    whose CPU time a CPU host does not count as co-located load
    (:mod:`.cpustat`); empty: only the agent itself."""
    emulate: tuple[EmulatedDevice, ...] = ()
    """Declared fake devices; when set, no hardware is probed."""
    emulate_file: str = ""
    """EMULATED conditions file (:mod:`hetpilot.emulation`), re-read before every report:
    its TFLOP/s replace the emulated devices' and its host links replace measured ones.
    Off when empty (the default)."""
    launch: bool = True
    """Start job ranks when the daemon orders it (jobs submitted with an entry point),
    as ``[launch]`` says. False (``--no-launch``): the daemon never launches on this
    host."""
    launching: LaunchConfig = field(default_factory=LaunchConfig)
    """The ``[launch]`` table."""
    state_dir: str = ""
    """Where launches keep their records and output (``launches/<id>/``); default
    ``$STATE_DIRECTORY`` (systemd's StateDirectory=), else
    ``$XDG_STATE_HOME/hetpilot/agent-<host>`` (``~/.local/state/...``)."""
    launch_python: str = ""
    """Interpreter that runs the launch runner, torchrun (``-m hetpilot.agents.torchrun``)
    and module entry points (it needs hetpilot and torch); default: the agent's own."""
    stop_grace_s: float = 10.0
    """A stopped launch gets SIGTERM, then SIGKILL after this many seconds."""
    launch_retention_s: float = 86400.0
    """A launch's directory (``launches/<id>/``: output, the ranks' own files) is removed
    this long after it ended and the daemon acknowledged its exit and all of its output
    (the daemon keeps that output, see its ``log_retention_hours``); 0: at once. Never
    while it runs or before the daemon has it all."""

    def __post_init__(self) -> None:
        if self.daemon and ":" not in self.daemon:
            raise ConfigError(f"daemon: must be host:port, got {self.daemon!r}")
        if ":" not in self.probe_listen:
            raise ConfigError(f"probe_listen: must be host:port, got {self.probe_listen!r}")
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"host: must be a non-empty name without spaces, got {self.host!r}")
        for name in ("reprobe_interval_s", "link_probe_interval_s", "call_timeout_s",
                     "max_backoff_s", "stop_grace_s"):
            _check(name, getattr(self, name))
        _check("launch_retention_s", self.launch_retention_s, positive=False)
        _check("price_per_hour", self.price_per_hour, positive=False)
        _check("power_watts", self.power_watts, positive=False)
        try:
            re.compile(self.job_pattern)
        except re.error as exc:
            raise ConfigError(f"job_pattern: not a regular expression: {exc}") from None
        if not 1000 <= self.link_probe_bytes <= 64_000_000:
            raise ConfigError("link_probe_bytes: must be in [1000, 64e6]")

    def resolved_state_dir(self) -> Path:
        """The state directory (see ``state_dir``)."""
        if self.state_dir:
            return Path(self.state_dir)
        systemd = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
        if systemd:
            return Path(systemd)
        base = os.environ.get("XDG_STATE_HOME", "")
        if not base:
            try:
                base = str(Path.home() / ".local" / "state")
            except RuntimeError:  # no home directory known: somewhere writable still
                base = "/var/tmp"
        return Path(base) / "hetpilot" / f"agent-{self.host}"

    def cluster_token(self) -> str:
        if self.token or not self.token_file:
            return self.token
        from hetpilot.channel import read_token_file

        try:
            return read_token_file(self.token_file, "token_file")
        except ValueError as exc:  # not UTF-8, empty, not a header value
            raise ConfigError(str(exc)) from None


def parse_emulate(text: str) -> EmulatedDevice:
    """``tflops=50,memory_gb=24[,price_per_hour=1][,power_watts=300][,count=2]``."""
    values: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in {f.name for f in fields(EmulatedDevice)}:
            raise ConfigError(f"--emulate: bad item {part!r}; "
                              "want tflops=..,memory_gb=..[,price_per_hour=..,power_watts=..,count=..]")
        try:
            values[key] = int(raw) if key == "count" else float(raw)
        except ValueError:
            raise ConfigError(f"--emulate: {key} must be a number, got {raw!r}") from None
    try:
        return EmulatedDevice(**values)
    except TypeError as exc:
        raise ConfigError(f"--emulate: {exc}") from None


def load_agent_config(path: str | Path | None = None, **overrides: Any) -> AgentConfig:
    """Read ``[agent]``, ``[launch]`` and ``[[emulate]]`` from a TOML file; overrides win
    (``run_as`` and ``output_bytes`` override ``[launch]``)."""
    data = read_tables(path, {"agent", "emulate", "launch"})
    top = table(data, "agent")
    if "launching" in top:
        raise ConfigError("agent.launching: unknown key (give [launch] as its own table)")
    launch = table(data, "launch")
    for key in ("run_as", "output_bytes"):
        if overrides.get(key) is not None:
            launch[key] = overrides[key]
        overrides.pop(key, None)
    top["launching"] = build(LaunchConfig, launch, "launch")
    if "emulate" in top:
        raise ConfigError("agent.emulate: give each device as its own [[emulate]] table")
    entries = data.get("emulate", [])
    if not isinstance(entries, list):
        raise ConfigError(f"emulate: must be [[emulate]] tables, got {entries!r}")
    emulate = tuple(build(EmulatedDevice, e, f"emulate[{i}]") for i, e in enumerate(entries))
    if emulate:
        top["emulate"] = emulate
    top.update({k: v for k, v in overrides.items() if v is not None and v != ()})
    return build(AgentConfig, top, "agent")  # type: ignore[no-any-return]
