"""EMULATED conditions shared by agents and trainer ranks on CPU-only test machines.

One small JSON file describes what the emulated devices and links can do
*now*; whoever emulates re-reads it, so rewriting the file (atomically:
:func:`write_emulation`) changes what the agents report and what the trainer
ranks feel at the same time::

    {"devices": {"hostA:0": 0.004, "hostB:0": 0.002},
     "links": [{"a": "hostA", "b": "hostC", "gbps": 0.05, "latency_us": 100}],
     "note": "EMULATED co-located job on hostA:0"}

- ``devices``: device id -> TFLOP/s. ``hetpilot agent --emulate-file`` reports
  it for its emulated devices; ``hetpilot train --emulate-file`` makes the
  rank with that device id a device of that speed (target-time emulation).
- ``links``: host pair -> Gbit/s (and latency). The agent reports it instead
  of the loopback it measures; trainer ranks stretch each gradient all-reduce
  to spec v1 section 5.3's time over those links.

Off unless a command names the file. Pure: no torch, no grpc.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EmulatedState", "EmulationFile", "allreduce_s", "write_emulation"]


@dataclass(frozen=True)
class EmulatedState:
    devices: Mapping[str, float] = field(default_factory=dict)
    """Device id -> TFLOP/s."""
    links: Mapping[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    """(host a, host b) sorted -> (Gbit/s, latency in microseconds)."""
    note: str = ""

    def link(self, a: str, b: str) -> tuple[float, float] | None:
        """(Gbit/s, latency_us) between two hosts, or None when not emulated."""
        return self.links.get((min(a, b), max(a, b)))


def _parse(data: Any) -> EmulatedState:
    if not isinstance(data, dict):
        raise ValueError("emulation file: must be a JSON object")
    devices: dict[str, float] = {}
    for dev, tflops in dict(data.get("devices", {})).items():
        value = float(tflops)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"emulation file: devices.{dev}: must be > 0, got {tflops!r}")
        devices[str(dev)] = value
    links: dict[tuple[str, str], tuple[float, float]] = {}
    for i, entry in enumerate(data.get("links", [])):
        a, b = str(entry["a"]), str(entry["b"])
        gbps, lat = float(entry["gbps"]), float(entry.get("latency_us", 0.0))
        if not (math.isfinite(gbps) and gbps > 0 and math.isfinite(lat) and lat >= 0):
            raise ValueError(f"emulation file: links[{i}]: gbps > 0 and latency_us >= 0")
        links[(min(a, b), max(a, b))] = (gbps, lat)
    return EmulatedState(devices=devices, links=links, note=str(data.get("note", "")))


class EmulationFile:
    """Re-reads the file when it changes; keeps the last good state when it is missing or bad."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._state = EmulatedState()
        self.changes = 0
        """How many times a new state was read."""

    def state(self) -> EmulatedState:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._state
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            try:
                state = _parse(json.loads(self.path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                return self._state  # half-written or wrong: keep the last good one
            self._stamp = stamp
            if state != self._state:
                self.changes += 1
            self._state = state
        return self._state


def write_emulation(path: str | Path, devices: Mapping[str, float],
                    links: Sequence[Mapping[str, Any]] = (), note: str = "") -> None:
    """Write the file atomically (readers never see half of it)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"devices": dict(devices), "links": list(links), "note": note},
                              indent=1))
    os.replace(tmp, path)


def allreduce_s(param_bytes: float, hosts: Sequence[str], state: EmulatedState) -> float | None:
    """Spec v1 section 5.3's ring all-reduce time of ``param_bytes`` over devices on
    ``hosts`` (in ring order), with the emulated links; None when a hop between two
    hosts is not in the file (that all-reduce is then not emulated). Hops inside a
    host are taken as free."""
    k = len(hosts)
    if k < 2:
        return 0.0
    gbps, lat = math.inf, 0.0
    for i in range(k):
        a, b = hosts[i], hosts[(i + 1) % k]
        if a == b:
            continue
        link = state.link(a, b)
        if link is None:
            return None
        gbps, lat = min(gbps, link[0]), max(lat, link[1])
    if math.isinf(gbps):
        return 0.0
    return 2 * (k - 1) / k * param_bytes * 8 / (gbps * 1e9) + 2 * (k - 1) * lat / 1e6
