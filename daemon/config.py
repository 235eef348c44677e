"""Daemon configuration: frozen keyword-only dataclasses loaded from one TOML file.

Command-line flags (``--listen``, ``--state-dir``) override the file. Secrets
are read from files named in the config (``*_file``) or given inline for
tests; nothing is read from the environment.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hetpilot.addresses import check_address, is_loopback
from hetpilot.channel import check_token
from hetpilot.tomlconfig import ConfigError, build, read_tables, table

from .owners import check_unix_user, read_owners

__all__ = ["AuthConfig", "ConfigError", "DaemonConfig", "TlsConfig", "load_daemon_config"]


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}: must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    cert_file: str = ""
    """PEM server certificate chain; TLS is off when empty."""
    key_file: str = ""
    """PEM private key of cert_file."""
    client_ca_file: str = ""
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    agents_by_certificate: bool = False
    """Mutual TLS only: an agent may register, report and heartbeat only as a host its
    client certificate names (common name or a DNS subject alternative name)."""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("tls: cert_file and key_file go together")
        if self.client_ca_file and not self.cert_file:
            raise ConfigError("tls.client_ca_file: needs cert_file and key_file")
        if self.agents_by_certificate and not self.client_ca_file:
            raise ConfigError("tls.agents_by_certificate: needs client_ca_file (mutual TLS)")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass(frozen=True, kw_only=True)
class AuthConfig:
    owner_tokens: dict[str, str] = field(default_factory=dict)
    """Job owner -> bearer token. Owners see and change only their own jobs."""
    owner_tokens_file: str = ""
    """TOML file of owners, merged into owner_tokens: ``owner = "token"`` lines, or a
    table per owner (``[alice]`` with ``token = "..."`` and ``unix_user = "alice"``,
    the user her ranks run as on launching hosts; :mod:`hetpilot.daemon.owners`)."""
    owner_unix_users: dict[str, str] = field(default_factory=dict)
    """Job owner -> the unix user her jobs' ranks run as (read from owner_tokens_file's
    tables, or given inline); an owner without one cannot launch on an agent that runs
    ranks as their owners."""
    cluster_token: str = ""
    """Bearer token of agents and trainers."""
    cluster_token_file: str = ""
    """File holding the cluster token (first line), used when cluster_token is empty."""
    allow_unauthenticated: bool = False
    """Development only: every caller is owner "anonymous" and a cluster member."""
    cluster_token_for_trainers: bool = False
    """Also accept the cluster token on TrainerService, for any job (how releases
    before per-job trainer tokens worked). Off: a trainer needs its job's token
    (``hetpilot job JOB --trainer-token``), good for that job only."""

    def __post_init__(self) -> None:
        for owner, token in self.owner_tokens.items():
            if not isinstance(token, str) or len(token) < 8:
                raise ConfigError(f"auth.owner_tokens.{owner}: token must be >= 8 characters")
            _check_header_safe(token, f"auth.owner_tokens.{owner}")
        for owner, user in self.owner_unix_users.items():
            check_unix_user(user, f"auth.owner_unix_users.{owner}")
        if len(set(self.owner_tokens.values())) != len(self.owner_tokens):
            raise ConfigError("auth.owner_tokens: two owners share a token")
        if self.cluster_token and len(self.cluster_token) < 8:
            raise ConfigError("auth.cluster_token: must be >= 8 characters")
        if self.cluster_token:
            _check_header_safe(self.cluster_token, "auth.cluster_token")

    def resolved(self) -> AuthConfig:
        """Read the token files into the inline fields."""
        owners = dict(self.owner_tokens)
        unix_users = dict(self.owner_unix_users)
        if self.owner_tokens_file:
            try:
                with open(self.owner_tokens_file, "rb") as fh:
                    read = tomllib.load(fh)
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"auth.owner_tokens_file: {exc}") from None
            tokens, users = read_owners(read, f"auth.owner_tokens_file {self.owner_tokens_file}")
            for owner, token in tokens.items():
                _check_header_safe(token, f"auth.owner_tokens_file {self.owner_tokens_file}: "
                                          f"{owner}")
            owners.update(tokens)
            unix_users.update(users)
        cluster = self.cluster_token
        if not cluster and self.cluster_token_file:
            try:
                lines = Path(self.cluster_token_file).read_text().strip().splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"auth.cluster_token_file: {exc}") from None
            if not lines:
                raise ConfigError(f"auth.cluster_token_file: {self.cluster_token_file} is empty")
            cluster = lines[0].strip()
            _check_header_safe(cluster, f"auth.cluster_token_file {self.cluster_token_file}")
        # the checks of __post_init__ again, on the tokens read from the files
        resolved = replace(self, owner_tokens=owners, cluster_token=cluster,
                           owner_unix_users=unix_users, owner_tokens_file="",
                           cluster_token_file="")
        if cluster and cluster in owners.values():
            raise ConfigError("auth: an owner token equals the cluster token (agents and "
                              "trainers would act as that owner); give each its own")
        return resolved


def _check_header_safe(token: str, key: str) -> None:
    """A token no client can send is refused when the daemon starts, naming ``key``: a
    character outside printable ASCII (gRPC metadata cannot carry it, so every call with
    it fails), or a space at either end (clients and the daemon strip what they send and
    receive, so it would never match)."""
    try:
        check_token(token, key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if token != token.strip():
        raise ConfigError(f"{key}: the token begins or ends with a space; clients strip "
                          "it, so no call would match it")


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    listen: str = "127.0.0.1:7070"
    """gRPC address, host:port; port 0 lets the OS pick (written to state_dir/endpoints.json)."""
    state_dir: str = "/var/lib/hetpilot"
    """Holds state.db (SQLite, WAL) and endpoints.json."""
    metrics_listen: str = "127.0.0.1:9464"
    """Prometheus /metrics address; empty turns metrics off; port 0 lets the OS pick."""
    slot_s: float = 60.0
    """Default controller slot length of jobs that do not set one."""
    report_interval_s: float = 1.0
    """How often agents are asked to report."""
    heartbeat_timeout_s: float = 10.0
    """An agent silent this long is down; its devices leave the next plan."""
    restart_grace_s: float = 30.0
    """After the daemon starts, the agents it knew count as up for this long (or
    ``heartbeat_timeout_s`` if longer) before they must have reported again: an
    agent's reconnect backoff (up to its ``max_backoff_s``, 10 s by default) must
    not cost the running plans two needless switches (drop, then re-add)."""
    drain_s: float = 1.0
    """On SIGTERM, health turns NOT_SERVING and the daemon keeps serving this long, so
    that load balancers and clients see it going before calls are refused."""
    grace_s: float = 5.0
    """Then, how long in-flight calls get to finish before they are cancelled."""
    max_message_bytes: int = 4 * 1024 * 1024
    """Larger requests are refused with RESOURCE_EXHAUSTED."""
    max_concurrent_streams: int = 10000
    handshake_timeout_s: float = 10.0
    """A connection that has not finished its TLS and HTTP/2 handshake this long after it
    was accepted is closed (grpc's default, 120 s, let idle sockets hold the daemon's
    file descriptors: 1500 kept one with 1024 from answering)."""
    idle_connection_s: float = 300.0
    """A connection with no call in flight this long is closed (clients reconnect on their
    next call; agents' report streams keep theirs busy); 0: never."""
    intra_host_gbps: float = 2400.0
    """Network defaults for pairs no probe has measured (spec v1 section 1)."""
    inter_host_gbps: float = 25.0
    latency_us: float = 5.0
    planner_memory_mb: int = 8192
    """Address-space limit of the planning process (RLIMIT_AS); a slot whose solve
    needs more fails with an error in the job's warnings; 0: no limit."""
    rdzv_port_min: int = 29400
    """Rendezvous ports of launched jobs (c10d store on the first chosen host): each
    launch takes the lowest port of [rdzv_port_min, rdzv_port_max] that no running
    launch holds; that host's agent checks it is free there before starting torchrun,
    else the launch moves to the next one (open them in firewalls)."""
    rdzv_port_max: int = 29499
    log_bytes_per_host: int = 32 * 1024 * 1024
    """Output of a launched job kept per host (state_dir/logs/JOB/HOST.log); older
    output is dropped beyond it (one rotation)."""
    log_retention_hours: float = 168.0
    """An ended job's kept output is removed this long after it ended (and every host's
    ranks exited); 0: kept until removed by hand. A running job's output never is."""
    insecure_local: bool = False
    """``--insecure-local``: no authentication, loopback ``listen`` only (a one-machine
    trial; see :mod:`hetpilot.daemon.quickstart`)."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        try:
            check_address(self.listen, "listen", listen=True)
            if self.metrics_listen:
                check_address(self.metrics_listen, "metrics_listen", listen=True)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.insecure_local and not is_loopback(self.listen):
            raise ConfigError(f"--insecure-local: listen address {self.listen} is not a "
                              "loopback address (127.0.0.1, ::1, localhost): without "
                              "tokens only this machine may connect")
        for name in ("slot_s", "report_interval_s", "heartbeat_timeout_s", "grace_s",
                     "intra_host_gbps", "inter_host_gbps"):
            _positive(name, getattr(self, name))
        if not (math.isfinite(self.restart_grace_s) and self.restart_grace_s >= 0):
            raise ConfigError(f"restart_grace_s: must be >= 0, got {self.restart_grace_s!r}")
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ConfigError(f"latency_us: must be >= 0, got {self.latency_us!r}")
        if self.slot_s < 0.05:
            raise ConfigError(f"slot_s: must be >= 0.05 s, got {self.slot_s!r}")
        if not (math.isfinite(self.drain_s) and 0 <= self.drain_s <= 300):
            raise ConfigError(f"drain_s: must be in [0, 300], got {self.drain_s!r}")
        if self.heartbeat_timeout_s < self.report_interval_s:
            raise ConfigError("heartbeat_timeout_s: must be >= report_interval_s")
        if not (isinstance(self.planner_memory_mb, int) and self.planner_memory_mb >= 0):
            raise ConfigError("planner_memory_mb: must be an integer >= 0 (0: no limit)")
        if not (isinstance(self.rdzv_port_min, int) and isinstance(self.rdzv_port_max, int)
                and 1 <= self.rdzv_port_min <= self.rdzv_port_max <= 65535):
            raise ConfigError("rdzv_port_min, rdzv_port_max: must be integers with "
                              f"1 <= min <= max <= 65535, got {self.rdzv_port_min!r}, "
                              f"{self.rdzv_port_max!r}")
        if not (isinstance(self.log_bytes_per_host, int)
                and 64 * 1024 <= self.log_bytes_per_host <= 2**40):
            raise ConfigError("log_bytes_per_host: must be an integer in [64 KiB, 1 TiB], "
                              f"got {self.log_bytes_per_host!r}")
        if not (isinstance(self.log_retention_hours, (int, float))
                and not isinstance(self.log_retention_hours, bool)
                and math.isfinite(self.log_retention_hours)
                and 0 <= self.log_retention_hours <= 24 * 365 * 100):
            raise ConfigError("log_retention_hours: must be a number of hours in [0, 876000] "
                              f"(0: keep forever), got {self.log_retention_hours!r}")
        if not 1024 <= self.max_message_bytes <= 256 * 1024 * 1024:
            raise ConfigError("max_message_bytes: must be in [1 KiB, 256 MiB]")
        if not (math.isfinite(self.handshake_timeout_s) and 1 <= self.handshake_timeout_s <= 600):
            raise ConfigError("handshake_timeout_s: must be in [1, 600] seconds, got "
                              f"{self.handshake_timeout_s!r}")
        if not (math.isfinite(self.idle_connection_s)
                and (self.idle_connection_s == 0 or 10 <= self.idle_connection_s <= 86400)):
            raise ConfigError("idle_connection_s: must be 0 (never) or in [10, 86400] seconds, "
                              f"got {self.idle_connection_s!r}")
        if not 1 <= self.max_concurrent_streams <= 2**31 - 1:
            raise ConfigError("max_concurrent_streams: must be in [1, 2147483647], got "
                              f"{self.max_concurrent_streams!r}")


def load_daemon_config(path: str | Path | None = None, **overrides: Any) -> DaemonConfig:
    """Read ``[daemon]``, ``[auth]`` and ``[tls]`` from a TOML file; overrides win."""
    data = read_tables(path, {"daemon", "auth", "tls"})
    top = table(data, "daemon")
    for nested in ("auth", "tls"):
        if nested in top:
            raise ConfigError(f"daemon.{nested}: give it as its own [{nested}] table")
    top.update({k: v for k, v in overrides.items() if v is not None})
    top["auth"] = build(AuthConfig, table(data, "auth"), "auth")
    top["tls"] = build(TlsConfig, table(data, "tls"), "tls")
    return build(DaemonConfig, top, "daemon")  # type: ignore[no-any-return]
