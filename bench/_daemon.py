"""Shared by the daemon benchmarks (bench/daemon_fuzz.py, bench/daemon_jobs.py,
bench/controlplane_load.py): a real ``hetpilot daemon`` subprocess on
127.0.0.1 with a temporary state directory and bearer tokens, EMULATED agents
that keep reporting, and a monitor thread sampling health-check latency and the
daemon's RSS. Loopback only; nothing here needs a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hetpilot.v1 import agent_pb2_grpc

from hetpilot.channel import metadata

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, *, cluster_token: str, owner_tokens: dict[str, str] | None = None,
                 **daemon: object) -> Path:
    """A daemon TOML: ``[daemon]`` keys from ``daemon``, ``[auth]`` tokens."""
    lines = ["[daemon]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in daemon.items()]
    lines += ["[auth]", f"cluster_token = {json.dumps(cluster_token)}"]
    if owner_tokens:
        lines.append("[auth.owner_tokens]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in owner_tokens.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def rss_kb(pid: int) -> int | None:
    """VmRSS of a process in kB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct child processes (the daemon's planning process)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not reaped) is not alive
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


def _health_answers(address: str) -> bool:
    """Whether a grpc.health.v1 Check at ``address`` answers (SERVING or not)."""
    with grpc.insecure_channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return True


class Daemon:
    """``python -m hetpilot daemon`` as a subprocess on 127.0.0.1 (port 0, or ``listen``).

    stderr goes to ``log`` (appended across restarts) unless ``log`` is None."""

    def __init__(self, state_dir: Path, config: Path, *, log: Path | None = None,
                 metrics: bool = True, log_level: str = "INFO",
                 listen: str = "127.0.0.1:0") -> None:
        self.state_dir, self.config, self.log, self.listen = state_dir, config, log, listen
        self.metrics_flag, self.log_level = metrics, log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.metrics = ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> str:
        """Start and wait for endpoints.json written by this process (or, on a fixed
        ``listen``, for health to answer: on a full disk there is no endpoints.json);
        the gRPC address."""
        ends = self.state_dir / "endpoints.json"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        stderr = open(self.log, "ab") if self.log is not None else None  # noqa: SIM115
        cmd = [sys.executable, "-m", "hetpilot", "daemon", "--listen", self.listen,
               "--state-dir", str(self.state_dir), "--config", str(self.config),
               "--metrics-listen", "127.0.0.1:0" if self.metrics_flag else "",
               "--log-level", self.log_level]
        try:
            self.proc = subprocess.Popen(cmd, stderr=stderr, stdout=subprocess.DEVNULL)
        finally:
            if stderr is not None:
                stderr.close()
        began = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode} while starting"
                                   + (f" (log: {self.log})" if self.log else ""))
            with contextlib.suppress(OSError, ValueError, KeyError):
                data = json.loads(ends.read_text())
                if data["pid"] == self.proc.pid:
                    self.address, self.metrics = data["grpc"], data.get("metrics", "")
                    return self.address
            if not self.listen.endswith(":0") and _health_answers(self.listen):
                self.address = self.listen
                return self.address
            if time.monotonic() - began > timeout:
                self.kill()
                raise RuntimeError("daemon did not write endpoints.json in time")
            time.sleep(0.1)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> tuple[int | None, float]:
        """SIGTERM; (exit code or None if it had to be killed, seconds to exit)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            return self.proc.returncode, 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            self.kill()
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for child in children(self.proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait(timeout=10)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def scrape(self, prefixes: tuple[str, ...] = ("hetpilot_",)) -> dict[str, float]:
        """Prometheus samples (no histogram buckets) whose names start with ``prefixes``."""
        if not self.metrics:
            return {}
        import urllib.request

        out: dict[str, float] = {}
        try:
            with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        for line in text.splitlines():
            if line.startswith("#") or "_bucket{" in line or not line.startswith(prefixes):
                continue
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
        return out


def log_summary(log: Path) -> dict[str, Any]:
    """Size of a daemon log, its Traceback lines and the exceptions they end with."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = text.splitlines()
    excs: Counter[str] = Counter()
    in_tb = False
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            in_tb = True
            continue
        if in_tb and line and not line.startswith((" ", "\t")) and i > 0:
            if not line.startswith(("During handling", "The above exception")):
                excs[line[:140]] += 1
            in_tb = False
    return {"bytes": len(text.encode()), "lines": len(lines),
            "tracebacks": sum(1 for x in lines if "Traceback" in x),
            "exceptions": excs.most_common(8)}


# -- requests: the control-plane tests' builders (one copy for tests and benches) ----

sys.path.insert(0, str(ROOT))
from tests.controlplane import helpers as _requests  # noqa: E402

model_json = _requests.model_json
register_request = _requests.register_request
report = _requests.report
submit_request = _requests.submit_request

# -- emulated agents ---------------------------------------------------------------

@dataclass
class AgentStats:
    acked: int = 0
    errors: int = 0
    last_error: str = ""


class EmulatedAgents:
    """EMULATED agents (``devices`` fake devices each) in their own thread and event loop:
    register, then one Report stream each, a report every ``interval`` s; reconnect
    after any error (a daemon restart included: call :meth:`retarget`)."""

    def __init__(self, address: str, token: str, hosts: list[str], devices: int = 2,
                 interval: float = 0.5, tflops: Callable[[int], float] | None = None) -> None:
        self.address, self.token, self.hosts = address, token, hosts
        self.devices, self.interval = devices, interval
        self.tflops = tflops or (lambda i: 50.0 + 10.0 * (i % 4))
        self.stats = AgentStats()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="emulated-agents", daemon=True)

    def start(self) -> EmulatedAgents:
        self._thread.start()
        return self

    def retarget(self, address: str) -> None:
        """Point the agents at a restarted daemon (they reconnect on their own)."""
        self.address = address

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._run())
        self._loop.close()

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        tasks = [asyncio.create_task(self._agent(i, h)) for i, h in enumerate(self.hosts)]
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _agent(self, i: int, host: str) -> None:
        md = metadata(self.token)
        seq = 0
        tflops = self.tflops(i)
        while True:
            address = self.address
            try:
                async with grpc.aio.insecure_channel(address) as ch:
                    stub = agent_pb2_grpc.AgentServiceStub(ch)
                    reg = await stub.Register(register_request(host, self.devices, tflops),
                                              metadata=md, timeout=10)
                    call = stub.Report(metadata=md)
                    while address == self.address:
                        seq += 1
                        await call.write(report(host, seq, self.devices, tflops,
                                                registration=reg.registration))
                        ack = await asyncio.wait_for(call.read(), 10)
                        if ack is grpc.aio.EOF:  # type: ignore[attr-defined]
                            raise RuntimeError("report stream ended")
                        self.stats.acked += 1
                        await asyncio.sleep(self.interval)
                    call.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnect after anything
                self.stats.errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                await asyncio.sleep(0.5)


# -- monitor -------------------------------------------------------------------------

@dataclass
class MonitorStats:
    health_ms: list[float] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    rss_kb: list[int] = field(default_factory=list)
    planner_rss_kb: list[int] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Monitor:
    """A thread that, every ``period`` s, times a grpc.health.v1 Check (deadline 5 s),
    samples the daemon's VmRSS (and its children's), and calls ``extra()`` if given."""

    def __init__(self, daemon: Daemon, period: float = 0.5,
                 extra: Callable[[], None] | None = None) -> None:
        self.daemon, self.period, self.extra = daemon, period, extra
        self.stats = MonitorStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def start(self) -> Monitor:
        self._thread.start()
        return self

    def stop(self) -> MonitorStats:
        self._stop.set()
        self._thread.join(timeout=15)
        return self.stats

    def _run(self) -> None:
        channel = grpc.insecure_channel(self.daemon.address)
        health = health_pb2_grpc.HealthStub(channel)
        pid = self.daemon.pid
        next_t = time.monotonic()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                resp = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                ms = (time.perf_counter() - t0) * 1000
                self.stats.health_ms.append(ms)
                if resp.status != health_pb2.HealthCheckResponse.SERVING:
                    self.stats.health_failures.append(f"status {resp.status}")
            except grpc.RpcError as exc:
                self.stats.health_ms.append((time.perf_counter() - t0) * 1000)
                self.stats.health_failures.append(exc.code().name)  # type: ignore[attr-defined]
            rss = rss_kb(pid)
            if rss is not None:
                self.stats.rss_kb.append(rss)
                kids = [r for c in children(pid) if (r := rss_kb(c)) is not None]
                if kids:
                    self.stats.planner_rss_kb.append(sum(kids))
            if self.extra is not None:
                try:
                    self.extra()
                except Exception as exc:  # the sampler must not die
                    self.stats.health_failures.append(f"sampler: {type(exc).__name__}: {exc}")
            next_t += self.period
            self._stop.wait(max(0.0, next_t - time.monotonic()))
        channel.close()
