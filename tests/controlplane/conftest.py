"""Fixtures of the control-plane tests: a real daemon (grpc.aio on a port the
OS picks, SQLite in a temp dir) in a background thread, and channels to it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hetpilot.daemon.config import AuthConfig, DaemonConfig

from hetpilot.channel import Endpoint, metadata, open_sync

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OWNER_TOKEN = "alice-token-123"
OTHER_TOKEN = "bob-token-4567"
CLUSTER_TOKEN = "cluster-token-89"


def auth_config() -> AuthConfig:
    return AuthConfig(owner_tokens={"alice": OWNER_TOKEN, "bob": OTHER_TOKEN},
                      cluster_token=CLUSTER_TOKEN)


@dataclass
class RunningDaemon:
    address: str
    metrics: str
    state_dir: Path
    config: DaemonConfig
    _loop: asyncio.AbstractEventLoop
    _stop: asyncio.Event
    _thread: threading.Thread

    def channel(self) -> grpc.Channel:
        return open_sync(Endpoint(address=self.address))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=20)
        assert not self._thread.is_alive(), "daemon did not stop"


def wait_endpoints(state_dir: Path, timeout: float = 20.0, not_pid: int | None = None) -> dict:
    deadline = time.monotonic() + timeout
    path = state_dir / "endpoints.json"
    while time.monotonic() < deadline:
        if path.exists():
            data = json.loads(path.read_text())
            if not_pid is None or data["pid"] != not_pid:
                return data
        time.sleep(0.05)
    raise TimeoutError("daemon did not write endpoints.json")


def start_daemon(state_dir: Path, **overrides: object) -> RunningDaemon:
    from hetpilot.daemon.server import serve

    kwargs: dict[str, object] = dict(listen="127.0.0.1:0", state_dir=str(state_dir),
                                     metrics_listen="127.0.0.1:0", slot_s=0.3,
                                     report_interval_s=0.2, heartbeat_timeout_s=1.0,
                                     grace_s=1.0, drain_s=0.1, auth=auth_config())
    kwargs.update(overrides)
    config = DaemonConfig(**kwargs)  # type: ignore[arg-type]
    (state_dir / "endpoints.json").unlink(missing_ok=True)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    errors: list[BaseException] = []

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve(config, stop))
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=main, name="daemon", daemon=True)
    thread.start()
    try:
        ends = wait_endpoints(state_dir)
    except TimeoutError:
        raise RuntimeError(f"daemon failed: {errors}") from None
    return RunningDaemon(address=ends["grpc"], metrics=ends["metrics"], state_dir=state_dir,
                         config=config, _loop=loop, _stop=stop, _thread=thread)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    d = start_daemon(tmp_path / "state")
    try:
        yield d
    finally:
        d.stop()


OWNER_MD = metadata(OWNER_TOKEN)
OTHER_MD = metadata(OTHER_TOKEN)
CLUSTER_MD = metadata(CLUSTER_TOKEN)
