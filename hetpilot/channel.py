"""Channels to the daemon, shared by the client, the agents and the trainer: TLS
from files, bearer-token metadata, deadlines, and a service-config retry policy
that retries only idempotent calls on UNAVAILABLE, or CANCELLED by a daemon that
is stopping (every unary call of hetpilot.v1 is idempotent: SubmitJob through its
request_id, the rest by what they do; streams are resumed by callers)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from hetpilot.addresses import check_address

__all__ = ["ADDRESS_ENV", "Endpoint", "channel_options", "check_token", "metadata", "open_aio",
           "open_sync", "read_token_file"]

ADDRESS_ENV = "HETPILOT_ADDRESS"
TOKEN_ENV = "HETPILOT_TOKEN"

_IDEMPOTENT = {
    "hetpilot.v1.JobService": ("SubmitJob", "GetJob", "ListJobs", "CancelJob", "UpdateBudgets"),
    "hetpilot.v1.AgentService": ("Register", "Heartbeat"),
    "hetpilot.v1.TrainerService": ("Attach", "ReportStageTimings", "FinishJob"),
    "hetpilot.v1.ClusterService": ("ListNodes", "DrainHost", "ResumeHost"),
}

_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": s, "method": m} for s, ms in _IDEMPOTENT.items() for m in ms],
        "retryPolicy": {
            "maxAttempts": 4, "initialBackoff": "0.2s", "maxBackoff": "2s",
            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
        },
    }],
})


def channel_options(max_message_bytes: int = 4 * 1024 * 1024) -> list[tuple[str, object]]:
    return [
        ("grpc.service_config", _SERVICE_CONFIG),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20000),
        ("grpc.keepalive_timeout_ms", 10000),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    address: str
    """host:port of the daemon."""
    token: str = ""
    """Bearer token sent as ``authorization`` metadata."""
    ca_file: str = ""
    """PEM CA of the daemon's certificate; TLS is on when set."""
    cert_file: str = ""
    """Client certificate for mutual TLS."""
    key_file: str = ""

    @classmethod
    def from_env(cls, address: str | None, token: str | None = None, **tls: str) -> Endpoint:
        addr = address or os.environ.get(ADDRESS_ENV, "")
        if not addr:
            raise ValueError(f"no daemon address: pass --daemon or set {ADDRESS_ENV}")
        check_address(addr, "--daemon" if address else ADDRESS_ENV)
        if token is None:
            token = os.environ.get(TOKEN_ENV, "").strip()
            check_token(token, f"${TOKEN_ENV}")
        return cls(address=addr, token=token, **tls)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ca_file:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes(),
            private_key=Path(self.key_file).read_bytes() if self.key_file else None,
            certificate_chain=Path(self.cert_file).read_bytes() if self.cert_file else None)


def read_token_file(path: str | Path, what: str = "--token-file") -> str:
    """The token in a token file: its first non-empty line, stripped (the rule of the
    daemon's own token files, so a second line, e.g. a comment, is not sent). ValueError
    (naming ``what`` and the file) for a file that is not UTF-8, holds no token, or a
    token that cannot go in gRPC metadata; OSError when it cannot be read."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path}: not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None
    token = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not token:
        raise ValueError(f"{what} {path}: holds no token (empty)")
    check_token(token, f"{what} {path}")
    return token


def check_token(token: str, source: str) -> None:
    """A bearer token goes in gRPC metadata: printable ASCII only (else every call fails
    with INTERNAL "Invalid metadata"); ValueError naming ``source``."""
    bad = next((c for c in token if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValueError(f"{source}: the token has a character a gRPC header cannot carry "
                         f"({bad!r}); tokens are printable ASCII")


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def open_sync(ep: Endpoint) -> grpc.Channel:
    creds = ep.credentials()
    if creds is None:
        return grpc.insecure_channel(ep.address, options=channel_options())
    return grpc.secure_channel(ep.address, creds, options=channel_options())


def open_aio(ep: Endpoint) -> grpc.aio.Channel:
    creds = ep.credentials()
    if creds is None:
        return grpc.aio.insecure_channel(ep.address, options=channel_options())
    return grpc.aio.secure_channel(ep.address, creds, options=channel_options())
