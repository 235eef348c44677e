"""Wire the daemon together and run it until SIGTERM: grpc.aio server with
auth, request decoding, health and reflection, the SQLite store, job loops,
Prometheus metrics and systemd notify. Start: store (checked) and job loops
first, then listen. Graceful stop: health NOT_SERVING, keep serving for
``drain_s``, end plan streams, ``server.stop(grace_s)``, stop the loops (a
solve under way is killed), close the store."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import resource
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from hetpilot.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from hetpilot import pidlock

from .auth import Authenticator, AuthInterceptor
from .config import DaemonConfig, TlsConfig
from .controlplane import ControlPlane
from .decode import DecodeInterceptor
from .errors import StateDirInUse
from .metrics import Metrics
from .quickstart import announce_generated, generated_auth, insecure_auth
from .sdnotify import Notifier
from .servicers import AgentServicer, ClusterServicer, JobServicer, TrainerServicer
from .sqlite_store import SqliteStore

__all__ = ["SERVICES", "serve", "server_credentials"]

log = logging.getLogger("hetpilot.daemon")

SERVICES = (
    job_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
    trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name,
    cluster_pb2.DESCRIPTOR.services_by_name["ClusterService"].full_name,
)


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    key = Path(tls.key_file).read_bytes()
    cert = Path(tls.cert_file).read_bytes()
    if tls.client_ca_file:
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=Path(tls.client_ca_file).read_bytes(),
            require_client_auth=True)
    return grpc.ssl_server_credentials([(key, cert)])


def _write_endpoints(state_dir: Path, grpc_addr: str, metrics_addr: str) -> None:
    """Say where the daemon listens (for a port the OS picked). On a full disk it serves
    anyway (the store refuses writes until there is room): a stale file is removed
    rather than left naming the last daemon."""
    tmp, path = state_dir / "endpoints.json.tmp", state_dir / "endpoints.json"
    try:
        tmp.write_text(json.dumps({"grpc": grpc_addr, "metrics": metrics_addr,
                                   "pid": os.getpid()}))
        tmp.replace(path)
    except OSError as exc:
        for stale in (tmp, path):
            with contextlib.suppress(OSError):
                stale.unlink()
        log.warning("%s not written (%s): serving on %s without it", path, exc.strerror,
                    grpc_addr)


def _job_key(state_dir: Path) -> bytes:
    """The key trainer tokens are derived with: made once, kept with the state (0600),
    so tokens handed out survive restarts; delete it to revoke them all."""
    path = state_dir / "trainer-token.key"
    if not path.exists():
        tmp = state_dir / "trainer-token.key.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(32))
        tmp.replace(path)
    key = path.read_bytes()
    if len(key) < 16:
        raise OSError(f"{path}: too short to be a key ({len(key)} bytes); delete it to make "
                      "a new one (trainer tokens handed out so far stop working)")
    return key


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


@contextlib.contextmanager
def _state_dir_lock(state_dir: Path) -> Iterator[None]:
    """Hold ``state_dir/daemon.lock`` (:mod:`hetpilot.pidlock`) while serving; raise
    :class:`StateDirInUse`, naming the holder's pid, when another daemon holds it."""
    path = state_dir / "daemon.lock"
    try:
        handle = pidlock.take(path)
    except pidlock.LockHeld as held:
        raise StateDirInUse(f"{state_dir} is in use by another daemon (pid {held.holder}; "
                            f"{path} is locked): stop it, or give this one another "
                            "--state-dir") from None
    except OSError:  # a read-only state dir: the store refuses it, naming state.db
        yield
        return
    try:
        yield
    finally:
        pidlock.release(handle)


def raise_open_files_limit(ceiling: int = 65536) -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit (at most
    ``ceiling``), as the unit's ``LimitNOFILE=`` does: a daemon started by hand keeps the
    shell's 1024, which a few thousand agents and clients use up. (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` (SIGTERM, SIGINT). Raises StorageError when the state store is
    damaged or another daemon holds the state directory, OSError when the address is
    taken."""
    state_dir = Path(config.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    before, after = raise_open_files_limit()
    if after != before:
        log.info("open files limit raised from %d to %d", before, after)
    with _state_dir_lock(state_dir):
        await _serve(config, stop or asyncio.Event(), state_dir)


async def _serve(config: DaemonConfig, stop: asyncio.Event, state_dir: Path) -> None:
    loop = asyncio.get_running_loop()
    # SIGHUP (a closed terminal, a reload hetpilot does not have) stops as SIGTERM does,
    # rather than ending the process at once, which is its default
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, _stop_on, sig, stop)
    notifier = Notifier()
    auth_config = config.auth.resolved()
    generated = None
    if config.insecure_local:
        auth_config = insecure_auth(auth_config, config.listen)
    elif (generated := generated_auth(auth_config, state_dir)) is not None:
        auth_config = generated[0]
    elif auth_config.allow_unauthenticated:
        log.warning("auth.allow_unauthenticated is set: every caller is owner 'anonymous' "
                    "and a cluster member; for development on a trusted machine only")
    # the store and the job loops first: nothing listens before they are known good
    store = SqliteStore(state_dir / "state.db")  # quick_check; DamagedStore if it fails
    metrics = Metrics()
    plane = ControlPlane(store, config, metrics)
    await plane.start()
    auth = Authenticator(auth_config, _job_key(state_dir))
    reject = metrics.rejected.labels
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(auth, lambda: reject(code="UNAUTHENTICATED").inc()),
                      DecodeInterceptor(lambda: reject(code="INVALID_ARGUMENT").inc())],
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.so_reuseport", 0),  # a second daemon on the same port fails, not shares
            # grpc's default of 1000 queued calls CANCELLED ~10% of 2000 agents
            # registering at once after a daemon restart
            ("grpc.server.max_pending_requests", 20000),
            ("grpc.server.max_pending_requests_hard_limit", 40000),
            # sockets that never finish a handshake, or stay without calls, give back
            # their descriptors (docs/operating.md, "Security")
            ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000)),
            *([("grpc.max_connection_idle_ms", int(config.idle_connection_s * 1000))]
              if config.idle_connection_s else []),
        ])
    job_pb2_grpc.add_JobServiceServicer_to_server(JobServicer(plane, auth), server)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(
        AgentServicer(plane, config.tls.agents_by_certificate, auth.job_token, auth.unix_user),
        server)
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(plane, auth), server)
    cluster_pb2_grpc.add_ClusterServiceServicer_to_server(ClusterServicer(plane, auth), server)
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    try:
        if config.tls.enabled:
            port = server.add_secure_port(config.listen, server_credentials(config.tls))
        else:
            port = server.add_insecure_port(config.listen)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        await plane.stop()
        store.close()
        raise OSError(f"cannot listen on {config.listen}: {exc}") from None
    metrics_addr = ""
    if config.metrics_listen:
        host, mport = _split(config.metrics_listen)
        metrics_addr = f"{host}:{metrics.serve(host, mport)}"
    host, _ = _split(config.listen)
    grpc_addr = f"{host}:{port}"
    await server.start()
    gc.freeze()  # see _freeze_when_warm
    warm_task = asyncio.create_task(_freeze_when_warm(plane), name="gc-freeze")
    health_task = asyncio.create_task(_store_health(store, health_servicer), name="store-health")
    _write_endpoints(state_dir, grpc_addr, metrics_addr)
    log.info("serving on %s (metrics %s)", grpc_addr, metrics_addr or "off")
    if generated is not None:
        announce_generated(generated[1], grpc_addr)
    notifier.notify(READY=1, STATUS=f"serving on {grpc_addr}", MAINPID=os.getpid())
    watchdog = None
    interval = notifier.watchdog_interval_s()
    if notifier.enabled and interval:
        async def ping() -> None:
            while True:
                notifier.notify(WATCHDOG=1, STATUS=f"serving on {grpc_addr}; "
                                f"{len(plane.agent_table())} agents")
                await asyncio.sleep(interval)
        watchdog = asyncio.create_task(ping())
    try:
        await stop.wait()
    finally:
        # 1. say it: health NOT_SERVING, while still answering calls for drain_s;
        # 2. end the plan streams (clients reconnect elsewhere or after the restart);
        # 3. refuse new calls, give the in-flight ones grace_s; 4. stop the loops.
        log.info("stopping (drain %.1fs, grace %.1fs)", config.drain_s, config.grace_s)
        notifier.notify(STOPPING=1, STATUS="stopping")
        health_task.cancel()
        warm_task.cancel()
        await health_servicer.enter_graceful_shutdown()
        await asyncio.sleep(config.drain_s)
        plane.end_streams()
        if watchdog is not None:
            watchdog.cancel()
        await server.stop(config.grace_s)
        await plane.members.commits.close()  # reports still queued: committed
        await plane.stop()
        store.close()
        metrics.close()
        notifier.close()
        log.info("stopped")


def _stop_on(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("%s: stopping%s", sig.name, " (there is no reload: restart the daemon to apply "
             "a changed config)" if sig == signal.SIGHUP else "")
    stop.set()


async def _freeze_when_warm(plane: ControlPlane) -> None:
    """Move what start-up allocated (imports, the config, the store; then the slowdown
    estimator's library and forest, once its background fit is done) to the garbage
    collector's permanent generation (``gc.freeze``). A full collection stops every
    thread, the event loop's included, for as long as it scans, and these objects live
    as long as the daemon: frozen, they are never scanned again, so what a collection
    costs follows what serving allocates. The daemon's own start-up heap (41k objects)
    took 5-10 ms per full collection on a 2-core VM; a daemon embedded in a larger
    process (a test run that has imported torch and cvxpy, 230k objects) 75-90 ms, and
    125-217 ms on the estimator's thread mid-fit, which stalled the event loop past the
    100 ms its health checks may wait."""
    while not plane.adapter.wait_ready(0):  # polled: a thread waiting would hold up the stop
        await asyncio.sleep(1.0)
    gc.freeze()


async def _store_health(store: SqliteStore, health_servicer: Any) -> None:
    """Health follows the store: NOT_SERVING from a write that failed for want of
    storage (disk full, I/O errors) until a probe write, every 5 s, commits again."""
    serving: bool | None = None
    while True:
        ok = store.writable
        if ok != serving:
            status = (health_pb2.HealthCheckResponse.SERVING if ok
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", *SERVICES):
                await health_servicer.set(name, status)
            if not ok:
                log.error("the state store cannot write: health NOT_SERVING until it can")
            elif serving is not None:
                log.info("the state store writes again: health SERVING")
            serving = ok
        if ok:
            await asyncio.sleep(1.0)
        else:
            await asyncio.sleep(5.0)
            await asyncio.to_thread(store.probe)
