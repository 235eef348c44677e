"""What the demo emulates: hosts, devices, links, prices, budget, and the mid-run events.

Every speed and link here is EMULATED: agents declare the devices
(``--emulate``) and report what the emulation file (:mod:`hetpilot.emulation`)
says; trainer ranks sleep to the same speeds (target-time emulation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BUDGET", "DEVICES", "HOSTS", "LINK_GBPS", "LINK_LATENCY_US", "Event", "Host",
           "even_plan", "events", "links"]


@dataclass(frozen=True)
class Host:
    name: str
    tflops: float
    """EMULATED TFLOP/s of each device (tiny: a CPU core stands in for a GPU)."""
    count: int
    price_per_hour: float
    power_watts: float
    memory_gb: float = 16.0


HOSTS = (
    Host("hostA", 1.0e-4, 2, 3.0, 300.0),   # two fast devices
    Host("hostB", 5.0e-5, 1, 2.0, 250.0),   # half as fast
    Host("hostC", 2.5e-5, 1, 1.0, 150.0),   # a quarter as fast
)
#: device id -> (host, nominal TFLOP/s, price per hour); rank r runs DEVICES[r]
DEVICES: tuple[tuple[str, Host], ...] = tuple(
    (f"{h.name}:{i}", h) for h in HOSTS for i in range(h.count))
LINK_GBPS = 10.0
LINK_LATENCY_US = 50.0
BUDGET = {"price_per_hour": 10.0}
V = 10.0


@dataclass(frozen=True)
class Event:
    epoch: int
    """Takes effect when the trainer finishes epoch ``epoch - 1``."""
    text: str
    devices: dict[str, float]
    """Device id -> EMULATED TFLOP/s that changes."""
    links: dict[tuple[str, str], float]
    """Host pair -> EMULATED Gbit/s that changes."""


def events(epochs: int) -> tuple[Event, ...]:
    """A co-located job slows hostA:0 8x a third of the way in; the links to hostC
    are throttled to 0.01 Gbit/s two thirds of the way in."""
    slow, throttle = max(1, epochs // 3), max(2, (2 * epochs) // 3)
    a0 = HOSTS[0].tflops
    return (
        Event(slow, f"EMULATED co-located job on hostA:0: {a0:g} -> {a0 / 8:g} TFLOP/s (8x slower)",
              {"hostA:0": a0 / 8}, {}),
        Event(throttle, f"EMULATED link throttle hostA<->hostC and hostB<->hostC: "
              f"{LINK_GBPS:g} -> 0.01 Gbit/s",
              {}, {("hostA", "hostC"): 0.01, ("hostB", "hostC"): 0.01}),
    )


def links(gbps: dict[tuple[str, str], float]) -> list[dict[str, Any]]:
    """Every host pair, at LINK_GBPS unless ``gbps`` says otherwise (emulation file form)."""
    names = [h.name for h in HOSTS]
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            out.append({"a": a, "b": b, "gbps": gbps.get((a, b), LINK_GBPS),
                        "latency_us": LINK_LATENCY_US})
    return out


def even_plan() -> dict[str, Any]:
    """The static baseline: even data parallelism, one whole-model replica per device."""
    from .digits import GLOBAL_BATCH, MICROBATCH

    n = len(DEVICES)
    share = GLOBAL_BATCH // n
    return {"version": 1, "microbatch_size": MICROBATCH, "schedule": "1f1b",
            "groups": [{"samples": share, "stages": [{"device": d, "layers": [0, 5]}]}
                       for d, _ in DEVICES]}
