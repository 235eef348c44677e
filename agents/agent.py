"""The node agent: register the host's devices, stream reports, probe peers,
start and stop job ranks on the daemon's orders.

It never gives up on the daemon: any failure (daemon away, restarting,
refusing) closes the channel and reconnects with capped exponential backoff
and jitter, then registers again. Reports wait for their ack with a deadline,
so a daemon that hangs is noticed as surely as one that is gone.

Launches (:mod:`hetpilot.agents.launcher`) ride on the same stream: each
report carries the state of this host's launches and their new output, each
ack the launches to start and to stop. A report's output counts as shipped
only once its ack arrives (a lost ack means it is sent again, and the daemon
recognises it by its offset); orders are carried out after the ack, and a
launch id is started at most once, so an order repeated after a reconnect
starts nothing twice. Launches run in their own sessions: they go on while the
agent reconnects, and end with the agent process (:mod:`hetpilot.agents.runner`);
the agent that comes back reports how they ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from typing import Any

import grpc
from hetpilot.v1 import agent_pb2, agent_pb2_grpc, common_pb2

from hetpilot.channel import Endpoint, metadata, open_aio
from hetpilot.emulation import EmulationFile

from .config import AgentConfig
from .cpustat import CpuMeter
from .host_secret import HostSecret
from .launcher import Launcher
from .netprobe import measure, start_probe_server
from .probes import DeviceState, discover, refresh

__all__ = ["Agent", "ProbeListenError", "exposure"]

log = logging.getLogger("hetpilot.agent")

_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # grpc-stubs lacks grpc.aio.EOF

ACK_EVERY = 5
"""At least every ACK_EVERY-th report asks to be acked at once (the others say
``ack_later``): a daemon that stopped answering is noticed within ACK_EVERY report
intervals plus the call timeout, and an ack message per report is what costs the
daemon most (bench/RESULTS-controlplane-profile.md)."""

_Sent = tuple[list[tuple[str, bool]], list[tuple[str, int, bytes]], list[tuple[str, int]]]
"""A report's (launch id, running) states, output chunks and (launch id, port) refusals."""


def may_ack_later(sent: _Sent, since_ack: int, covered: int) -> bool:
    """Whether a report carrying ``sent`` may say ``ack_later``: not the first of its
    stream (``covered``: the latest seq an ack covered, 0 for none), not every
    ACK_EVERY-th (``since_ack``: reports since the last that asked, this one counted),
    and only when it ships no output, no exit and no refusal (those wait for their ack
    before the next report, which would otherwise send them again)."""
    statuses, chunks, refusals = sent
    return (covered > 0 and since_ack < ACK_EVERY and not chunks and not refusals
            and all(running for _, running in statuses))


class StreamEnded(ConnectionError):
    """The daemon ended the report stream without an error status."""
_KIND = {"cpu": common_pb2.DEVICE_KIND_CPU, "cuda": common_pb2.DEVICE_KIND_CUDA,
         "emulated": common_pb2.DEVICE_KIND_EMULATED}


def exposure(config: AgentConfig) -> list[str]:
    """What the ranks this agent launches could read or do that they should not: its
    secret files readable by other users, or owners' ranks run as root."""
    out: list[str] = []
    if not config.launch:
        return out
    if config.launching.run_as == "agent" and os.geteuid() == 0:
        out.append("[launch] run_as = \"agent\" and the agent runs as root: every owner's "
                   "ranks run as root on this host")
    for key in ("token_file", "key_file"):
        path = getattr(config, key)
        try:
            mode = os.stat(path).st_mode if path else 0
        except OSError:
            continue
        if mode & 0o044:
            out.append(f"{key} {path} is readable by other users (mode {mode & 0o777:o}): "
                       "launched ranks can read it; chmod 600")
    return out


class ProbeListenError(OSError):
    """The link-probe server cannot listen where it was told (the message names
    ``--probe-listen``)."""


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.devices: list[DeviceState] = []
        self.peers: dict[str, str] = {}
        self.links: dict[str, tuple[float, float]] = {}
        self.probe_address = ""
        self.reports_acked = 0
        self.connections = 0
        self._seq = 0
        self._registration = ""  # RegisterResponse.registration, sent with each report
        self._cpu: CpuMeter | None = None  # a CPU host's load between reports
        self._md = metadata(config.cluster_token())
        self.secret = HostSecret(config.resolved_state_dir())  # binds the host name
        # EMULATED conditions (off unless configured): see hetpilot.emulation
        self._emufile = EmulationFile(config.emulate_file) if config.emulate_file else None
        self._endpoint = Endpoint(address=config.daemon, ca_file=config.ca_file,
                                  cert_file=config.cert_file, key_file=config.key_file)
        self.launcher: Launcher | None = None
        if config.launch:
            self.launcher = Launcher(
                config.resolved_state_dir(), host=config.host, daemon=config.daemon,
                python=config.launch_python, stop_grace_s=config.stop_grace_s,
                tls={"ca_file": config.ca_file, "cert_file": config.cert_file,
                     "key_file": config.key_file},
                retention_s=config.launch_retention_s, run_as=config.launching.run_as,
                output_bytes=config.launching.output_bytes,
                limits=config.launching.limits(),
                require_limits=config.launching.require_limits)
        self._sent: _Sent = ([], [], [])
        """Launch states, output chunks and busy-port refusals of the latest report."""
        self._unacked: dict[int, _Sent] = {}
        """What each report not yet covered by an ack delivers, by seq."""

    # -- requests ------------------------------------------------------------

    def register_request(self) -> agent_pb2.RegisterRequest:
        return agent_pb2.RegisterRequest(
            host=self.config.host, probe_address=self.probe_address, agent_version="1",
            launches=self.launcher is not None, registration=self._registration,
            host_secret=self.secret.value(), devices=[agent_pb2.DeviceInfo(
                index=d.index, name=d.name, kind=_KIND[d.kind], tflops=d.tflops,
                memory_gb=d.memory_total_gb, price_per_hour=d.price_per_hour,
                power_watts=d.power_watts, emulated=d.emulated, probe_dtype=d.probe_dtype,
                probe_shape=d.probe_shape) for d in self.devices])

    def report(self) -> agent_pb2.AgentReport:
        self._seq += 1
        tflops = {d.index: d.tflops for d in self.devices}
        links = {h: v for h, v in self.links.items() if h in self.peers}
        if self._emufile is not None:  # EMULATED: the file's speeds and links win
            emu = self._emufile.state()
            for d in self.devices:
                t = emu.devices.get(f"{self.config.host}:{d.index}")
                if d.emulated and t is not None:
                    tflops[d.index] = t
            for h in self.peers:
                link = emu.link(self.config.host, h)
                if link is not None:
                    links[h] = (link[0], 2 * link[1])  # rtt = 2 x one-way latency
        launches, chunks, refusals = [], [], []
        if self.launcher is not None:
            launches = [agent_pb2.LaunchStatus(
                launch_id=st.launch_id, job_id=st.job_id, pid=st.pid, stopped=st.stopped,
                state=(agent_pb2.LAUNCH_STATE_RUNNING if st.running
                       else agent_pb2.LAUNCH_STATE_EXITED),
                exit_code=st.exit_code or 0, reason=st.reason[:2000],
                log_bytes=st.output_bytes()) for st in self.launcher.statuses()]
            chunks = self.launcher.chunks()
            refusals = self.launcher.refusals()
        self._sent = ([(st.launch_id, st.state == agent_pb2.LAUNCH_STATE_RUNNING)
                       for st in launches], chunks, [(i, p) for i, _, p, _ in refusals])
        launches += [agent_pb2.LaunchStatus(  # not started: the rendezvous port is in use
            launch_id=i, job_id=job, state=agent_pb2.LAUNCH_STATE_EXITED, exit_code=127,
            reason=why[:2000], rdzv_port_busy=port) for i, job, port, why in refusals]
        return agent_pb2.AgentReport(
            agent_id=self.config.host, seq=self._seq, unix_ms=int(time.time() * 1000),
            registration=self._registration, launches=launches,
            logs=[agent_pb2.LogChunk(launch_id=i, offset=o, data=d) for i, o, d in chunks],
            devices=[agent_pb2.DeviceReport(
                index=d.index, tflops=tflops[d.index], memory_total_gb=d.memory_total_gb,
                memory_free_gb=d.memory_free_gb, utilization=d.utilization,
                colocated_processes=d.colocated_processes, colocated_load=d.colocated_load,
                emulated=d.emulated, probe_dtype=d.probe_dtype, probe_shape=d.probe_shape)
                for d in self.devices],
            links=[agent_pb2.LinkReport(peer_host=h, gbps=g, rtt_us=r)
                   for h, (g, r) in sorted(links.items())])

    # -- loops ---------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        host, _, port = self.config.probe_listen.rpartition(":")
        try:
            server = await start_probe_server(host.strip("[]"), int(port))
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ProbeListenError(
                f"--probe-listen {self.config.probe_listen}: cannot listen there ({why}); "
                "another agent on this machine? give each its own port (port 0: any free "
                "one)") from None
        bound = server.sockets[0].getsockname()[1]
        adv_host = host if host not in ("0.0.0.0", "::", "") else self.config.host
        self.probe_address = self.config.probe_advertise or f"{adv_host}:{bound}"
        if self.launcher is not None:  # torchrun --local-addr: where peers reach this host
            self.launcher.local_addr = self.probe_address.rpartition(":")[0].strip("[]")
        for warning in exposure(self.config):
            log.warning("%s", warning)
        if not self.config.emulate:
            self._cpu = CpuMeter(self.config.job_pattern)
        self.devices = await asyncio.to_thread(discover, self.config, self._cpu)
        log.info("%d device(s): %s; probe server %s", len(self.devices),
                 ", ".join(f"{d.index}={d.kind}:{d.tflops:.2f}TF" for d in self.devices),
                 self.probe_address)
        tasks = [asyncio.create_task(self._measure_loop(stop)),
                 asyncio.create_task(self._link_loop(stop))]
        if self.launcher is not None:
            tasks.append(asyncio.create_task(self._launch_loop(stop)))
        try:
            await self._connect_loop(stop)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            server.close()
            await server.wait_closed()
            running = self.launcher.running() if self.launcher is not None else []
            if running:
                log.info("%d launch(es) end with this agent (%s): their runners stop them; "
                         "the next agent on this host reports how they ended", len(running),
                         ", ".join(s.launch_id for s in running))

    async def _connect_loop(self, stop: asyncio.Event) -> None:
        backoff = 0.2
        while not stop.is_set():
            channel = open_aio(self._endpoint)
            try:
                stub: Any = agent_pb2_grpc.AgentServiceStub(channel)
                resp = await stub.Register(self.register_request(), metadata=self._md,
                                           timeout=self.config.call_timeout_s)
                self._set_peers(resp.peers)
                self._registration = resp.registration
                if resp.host_secret:  # the daemon made the secret (not sent by us)
                    self.secret.replace(resp.host_secret)
                self.connections += 1
                log.info("registered with %s", self.config.daemon)
                backoff = 0.2
                await self._stream(stub, max(0.05, resp.report_interval_s), stop)
            except Exception as exc:  # never crash on the daemon: log, back off, reconnect
                code = (exc.code().name if isinstance(exc, grpc.aio.AioRpcError)
                        else type(exc).__name__)
                if isinstance(exc, grpc.aio.AioRpcError) and (exc.code() in (
                        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED)
                        or "stopping" in (exc.details() or "")):
                    code += f" ({exc.details()})"  # refused, or the daemon stops: say why
                elif isinstance(exc, StreamEnded):
                    code = str(exc)
                log.warning("daemon %s: %s; retrying in %.1fs", self.config.daemon, code, backoff)
            finally:
                await channel.close(grace=None)
            if stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self.config.max_backoff_s)

    async def _stream(self, stub: Any, interval: float, stop: asyncio.Event) -> None:
        """One Report stream: write a report a second, until it breaks. A task reads the
        acks (peers, launch orders, what they cover). A report that ships output, an
        exit or a refusal, and every ACK_EVERY-th, waits for its ack before the next;
        the others say ``ack_later``, so an idle host costs the daemon one ack message
        per ACK_EVERY reports. What an uncovered report delivered is sent again by the
        next report (the launcher keeps it until :meth:`Launcher.acked`).

        ``stub`` is an aio AgentServiceStub (grpc-stubs types only the sync one)."""
        call: Any = stub.Report(metadata=self._md)
        self._unacked.clear()
        covered: list[int] = [0]  # the seq of the latest report an ack covered
        wakes: list[tuple[int, asyncio.Future[None]]] = []
        reader = asyncio.create_task(self._read_acks(call, covered, wakes))
        stopping = asyncio.create_task(stop.wait())
        try:
            since_ack = 0  # reports written since the last one that asked for its ack
            while not stop.is_set():
                report = self.report()
                sent = self._sent
                since_ack += 1
                report.ack_later = may_ack_later(sent, since_ack, covered[0])
                self._unacked[report.seq] = sent
                acked: asyncio.Future[None] | None = None
                if not report.ack_later:  # waited for (the ack may come before write returns)
                    # the stream's first report starts the count at a random phase, so
                    # agents that connect together (a daemon restart) ask at other times
                    since_ack = random.randrange(ACK_EVERY) if covered[0] == 0 else 0
                    acked = asyncio.get_running_loop().create_future()
                    wakes.append((report.seq, acked))
                try:
                    await asyncio.wait_for(call.write(report), self.config.call_timeout_s)
                except asyncio.InvalidStateError:  # the call ended: its status says why
                    await asyncio.wait({reader}, timeout=self.config.call_timeout_s)
                    if reader.done():
                        reader.result()
                    raise
                if acked is not None:
                    await self._until(acked, reader)
                await asyncio.wait({reader, stopping}, timeout=interval,
                                   return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    reader.result()  # the stream's status, raised
            await call.done_writing()
            with contextlib.suppress(StreamEnded):  # the last ack covers every report
                await asyncio.wait_for(reader, self.config.call_timeout_s)
        finally:
            stopping.cancel()
            reader.cancel()
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader  # its error, if any, was raised above

    async def _until(self, acked: asyncio.Future[None], reader: asyncio.Task[None]) -> None:
        """Wait for ``acked`` (call timeout); raise the stream's error if it breaks first."""
        done, _ = await asyncio.wait({acked, reader}, timeout=self.config.call_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if reader.done():
            reader.result()
            if not acked.done():
                raise StreamEnded("the daemon ended the report stream before acking")
        if not done:
            acked.cancel()
            raise TimeoutError(f"no ack within {self.config.call_timeout_s:g} s")

    async def _read_acks(self, call: Any, covered: list[int],
                         wakes: list[tuple[int, asyncio.Future[None]]]) -> None:
        """Take each ack of the stream until it ends: raises its status (an error) or
        StreamEnded (closed by the daemon)."""
        while True:
            ack = await call.read()
            if ack is _EOF:  # (a stream that ends with an error raises it from read)
                raise StreamEnded("the daemon closed the report stream")
            if ack.seq > covered[0]:
                covered[0] = ack.seq
                for seq in sorted(s for s in self._unacked if s <= ack.seq):
                    self.reports_acked += 1
                    self._delivered(self._unacked.pop(seq))
            if ack.peers:
                self._set_peers(ack.peers)
            self._orders(ack)
            while wakes and wakes[0][0] <= covered[0]:
                _, acked = wakes.pop(0)
                if not acked.done():
                    acked.set_result(None)

    def _delivered(self, sent: _Sent) -> None:
        """An ack covered a report that carried ``sent``: its output is shipped."""
        if self.launcher is not None:
            self.launcher.acked(*sent)

    def _orders(self, ack: agent_pb2.ReportAck) -> None:
        """Start and stop as ordered."""
        launcher = self.launcher
        if launcher is None:
            if ack.start:
                log.warning("launch orders ignored: this agent runs with --no-launch")
            return
        kinds = {d.index: d.kind for d in self.devices}
        for order in ack.start:
            launcher.start(order, kinds)
        for launch_id in ack.stop:
            launcher.stop(launch_id)

    async def _launch_loop(self, stop: asyncio.Event) -> None:
        assert self.launcher is not None
        while not stop.is_set():
            try:
                self.launcher.poll()
            except Exception:  # watching launches must not stop the agent
                log.exception("watching launches failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)

    def _set_peers(self, peers: object) -> None:
        self.peers = {p.host: p.probe_address for p in peers  # type: ignore[attr-defined]
                      if p.host != self.config.host}

    async def _measure_loop(self, stop: asyncio.Event) -> None:
        last_probe = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(1.0)
            reprobe = time.monotonic() - last_probe >= self.config.reprobe_interval_s
            if reprobe:
                last_probe = time.monotonic()
            try:
                self.devices = await asyncio.to_thread(refresh, self.devices, self.config,
                                                       reprobe=reprobe, meter=self._cpu)
            except Exception:  # a flaky probe must not stop reporting
                log.exception("device refresh failed")

    async def _link_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for host, address in list(self.peers.items()):
                try:
                    self.links[host] = await measure(address, self.config.link_probe_bytes,
                                                     timeout=self.config.call_timeout_s)
                except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                    log.info("link probe to %s (%s) failed: %s", host, address, exc)
                    self.links.pop(host, None)
            await asyncio.sleep(self.config.link_probe_interval_s if self.peers else 1.0)
