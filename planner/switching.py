"""What changing the running plan costs: bytes moved and the time to move them.

Switching from plan A to plan B moves, for every device of B, the layers it
holds in B but did not hold in A: their parameters plus gradient and
optimizer state, ``param_mb * (1 + optimizer_factor)`` MB per layer. Each
such layer comes from the device of A holding it (any data-parallel group;
replicas are identical) with the fastest link to the receiver (a holder on
the receiver's own host when there is one, else the best of at most
``MAX_SOURCES`` holders on distinct hosts, which keeps 1024-device switches
cheap to estimate). When no
device of A that is still in the cluster holds it (its owners went down),
it comes from the last checkpoint, over the network's ``inter_host_gbps``.

Time model: every device receives its layers one after another and every
device sends its layers one after another, each transfer taking
``latency + MB * 8 / (1000 * gbps)`` of the pair's link (cluster.link);
different devices move in parallel. The switch takes the busiest device's
time, receiving or sending. Sample reassignment alone (same stages, other
``samples``) moves no parameters and costs 0 here.

Pure: numbers in, numbers out; no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .types import Cluster, Model, Plan

__all__ = ["CHECKPOINT", "MAX_SOURCES", "SwitchCost", "layer_owners", "switch_cost"]

#: Source named for layers that no surviving device of the old plan holds.
CHECKPOINT = "<checkpoint>"
#: Holders on other hosts tried per layer when none is on the receiver's host.
MAX_SOURCES = 16


@dataclass(frozen=True)
class SwitchCost:
    mb: float
    """Total MB moved (parameters plus gradient and optimizer state)."""
    seconds: float
    """Wall-clock time of the move: the busiest sender or receiver."""
    received_mb: Mapping[str, float] = field(default_factory=dict)
    """MB each receiving device gets."""

    @property
    def free(self) -> bool:
        return self.mb == 0.0


_FREE = SwitchCost(0.0, 0.0, MappingProxyType({}))


def layer_owners(plan: Plan) -> dict[str, set[int]]:
    """Device id -> layers it holds in ``plan``."""
    owned: dict[str, set[int]] = {}
    for group in plan.groups:
        for stage in group.stages:
            owned.setdefault(stage.device, set()).update(range(*stage.layers))
    return owned


def switch_cost(cluster: Cluster, model: Model, old: Plan | None, new: Plan) -> SwitchCost:
    """Bytes and seconds to go from ``old`` to ``new`` on ``cluster``.

    ``old=None`` (the first plan) is free: loading the model is not a switch.
    Devices of ``old`` missing from ``cluster`` (down) are not sources.
    """
    if old is None or old == new:
        return _FREE
    factor = 1.0 + model.optimizer_factor
    present = cluster.by_id
    old_owned = layer_owners(old)
    # layer -> host -> first surviving holder on that host
    holders: dict[int, dict[str, str]] = {}
    for dev, layers in old_owned.items():
        if dev in present:
            host = present[dev].host
            for layer in layers:
                holders.setdefault(layer, {}).setdefault(host, dev)
    ckpt_s = 8.0 / (1000.0 * cluster.network.inter_host_gbps)
    ckpt_lat = cluster.network.latency_us / 1e6
    recv_s: dict[str, float] = {}
    recv_mb: dict[str, float] = {}
    send_s: dict[str, float] = {}
    total = 0.0
    for dev, layers in layer_owners(new).items():
        have = old_owned.get(dev, set())
        for layer in sorted(layers - have):
            mb = model.layers[layer].param_mb * factor
            if mb <= 0.0:
                continue
            best_src, best_t = CHECKPOINT, ckpt_lat + mb * ckpt_s
            for src in _sources(holders.get(layer), present[dev].host):
                gbps, lat = cluster.link(src, dev)
                t = lat + mb * 8.0 / (1000.0 * gbps)
                if t <= best_t:
                    best_src, best_t = src, t
            total += mb
            recv_mb[dev] = recv_mb.get(dev, 0.0) + mb
            recv_s[dev] = recv_s.get(dev, 0.0) + best_t
            send_s[best_src] = send_s.get(best_src, 0.0) + best_t
    if total == 0.0:
        return _FREE
    # The checkpoint store is not one device: its reads do not serialise.
    send_s.pop(CHECKPOINT, None)
    seconds = max(max(recv_s.values()), max(send_s.values(), default=0.0))
    return SwitchCost(total, seconds, MappingProxyType(recv_mb))


def _sources(by_host: dict[str, str] | None, host: str) -> list[str]:
    if not by_host:
        return []
    local = by_host.get(host)
    if local is not None:
        return [local]
    return [src for _, src in zip(range(MAX_SOURCES), by_host.values(), strict=False)]
