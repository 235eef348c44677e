"""Link probes between agents: a small TCP server on every agent and a client
that measures round-trip time (1-byte pings) and bandwidth (a bulk send
acknowledged by the receiver). Bounded sizes and timeouts everywhere.

The server runs in the agent (root, on hosts where ranks run as their owners) and
anyone who reaches its port may connect, a rank of any owner included: it holds at
most ``MAX_CONNECTIONS`` at once (later ones are closed at once) and none longer than
``CONNECTION_S``, so connections never take the agent's file descriptors (a service's
soft limit is 1024) from its launches, records and daemon channel."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time

__all__ = ["CONNECTION_S", "MAX_CONNECTIONS", "MAX_PROBE_BYTES", "measure",
           "start_probe_server"]

MAX_PROBE_BYTES = 64_000_000
MAX_CONNECTIONS = 64
"""Probe connections one agent serves at once (peers probe one link at a time, for
seconds: more at once is not a peer measuring)."""
CONNECTION_S = 60.0
"""The longest a probe connection is served (a measurement's client gives up after 10 s)."""
_CHUNK = 256 * 1024


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            cmd = await asyncio.wait_for(reader.readexactly(1), timeout=30)
            if cmd == b"P":
                writer.write(b"P")
            elif cmd == b"B":
                (n,) = struct.unpack("!I", await reader.readexactly(4))
                if n > MAX_PROBE_BYTES:
                    return
                left = n
                while left:
                    data = await reader.read(min(left, _CHUNK))
                    if not data:
                        return
                    left -= len(data)
                writer.write(b"K")
            else:
                return
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, struct.error):
        pass
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def start_probe_server(host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
                             connection_s: float = CONNECTION_S) -> asyncio.Server:
    """The probe server on ``host:port``: at most ``max_connections`` served at once,
    each for at most ``connection_s`` seconds."""
    active = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal active
        if active >= max_connections:
            writer.close()  # its file descriptor goes back now
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return
        active += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_handle(reader, writer), connection_s)
        finally:
            active -= 1
            writer.close()

    return await asyncio.start_server(serve, host, port)


async def measure(address: str, nbytes: int = 4_000_000, pings: int = 5,
                  timeout: float = 10.0) -> tuple[float, float]:
    """(Gbit/s, RTT in microseconds) to the probe server at ``address``."""
    host, _, port = address.rpartition(":")

    async def run() -> tuple[float, float]:
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        try:
            rtts = []
            for _ in range(pings):
                t0 = time.perf_counter()
                writer.write(b"P")
                await writer.drain()
                await reader.readexactly(1)
                rtts.append(time.perf_counter() - t0)
            rtt = min(rtts)
            payload = b"\0" * min(nbytes, _CHUNK)
            t0 = time.perf_counter()
            writer.write(b"B" + struct.pack("!I", nbytes))
            left = nbytes
            while left:
                chunk = payload[: min(left, len(payload))]
                writer.write(chunk)
                await writer.drain()
                left -= len(chunk)
            await reader.readexactly(1)
            elapsed = max(time.perf_counter() - t0 - rtt, 1e-6)
            return nbytes * 8 / elapsed / 1e9, rtt * 1e6
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    return await asyncio.wait_for(run(), timeout=timeout)
