"""Sockets that connect to the daemon and never speak hold none of its file descriptors
for long: past ``handshake_timeout_s`` grpc closes them, so a daemon whose descriptors
they took answers again (a rank on any host can open them; docs/operating.md)."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .helpers import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

LIMIT = 256


def _few_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def test_idle_sockets_past_the_descriptor_limit_are_closed_and_the_daemon_answers(
        tmp_path: Path) -> None:
    state = tmp_path / "s"
    toml = tmp_path / "daemon.toml"
    toml.write_text("[daemon]\nhandshake_timeout_s = 2\n")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "hetpilot", "daemon", "--config", str(toml), "--listen",
         "127.0.0.1:0", "--state-dir", str(state), "--metrics-listen", "", "--insecure-local"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_few_files)
    sockets: list[socket.socket] = []
    try:
        wait_until("the daemon's endpoints", lambda: (state / "endpoints.json").exists()
                   or daemon.poll() is not None, timeout=60)
        assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
        address = json.loads((state / "endpoints.json").read_text())["grpc"]
        host, port = address.rsplit(":", 1)
        for _ in range(LIMIT + 144):  # more than the daemon has descriptors
            sock = socket.create_connection((host, int(port)), timeout=5)
            sockets.append(sock)
        # without the option the daemon stayed mute for about 60 s here (grpc default: 120 s)
        wait_until("the daemon answering while the idle sockets stay open",
                   lambda: _serving(address), timeout=40)
    finally:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        daemon.terminate()
        daemon.wait(timeout=60)


def test_the_connection_timeouts_are_config_keys_checked_by_name() -> None:
    from hetpilot.daemon.config import ConfigError, DaemonConfig

    for field, bad in (("handshake_timeout_s", 0), ("handshake_timeout_s", float("nan")),
                       ("idle_connection_s", 5), ("idle_connection_s", -1)):
        with pytest.raises(ConfigError, match=f"^{field}: "):
            DaemonConfig(**{field: bad})
    assert DaemonConfig(idle_connection_s=0).idle_connection_s == 0
