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

Tensor-parallel stages (spec 5.6): a device of a stage of degree t holds
slice i of t of each layer the stage splits, ``1/t`` of its MB; a device
holding the whole layer can send any slice, a slice of another degree is
moved anew, and a device that needs the whole layer receives what its
slices lack (from a holder of the whole layer, else from a holder of a
slice, timed as one transfer of the missing MB over that link).

Pure: numbers in, numbers out; no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .types import Cluster, Model, Plan

__all__ = ["CHECKPOINT", "MAX_SOURCES", "Slice", "SwitchCost", "layer_owners", "slice_owners",
           "switch_cost"]

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


#: (layer, degree t, index i): slice i of t of a layer; (layer, 1, 0) is the whole layer.
Slice = tuple[int, int, int]


def layer_owners(plan: Plan) -> dict[str, set[int]]:
    """Device id -> layers it holds in ``plan`` (whole or a slice of)."""
    owned: dict[str, set[int]] = {}
    for group in plan.groups:
        for stage in group.stages:
            for dev in stage.devices:
                owned.setdefault(dev, set()).update(range(*stage.layers))
    return owned


def slice_owners(model: Model, plan: Plan) -> dict[str, set[Slice]]:
    """Device id -> the layer slices it holds in ``plan`` (spec 5.6)."""
    owned: dict[str, set[Slice]] = {}
    layers = model.layers
    for group in plan.groups:
        for stage in group.stages:
            t = stage.tp
            for r, dev in enumerate(stage.devices):
                mine = owned.setdefault(dev, set())
                for layer in range(*stage.layers):
                    mine.add((layer, t, r) if t > 1 and layers[layer].splits(t) else (layer, 1, 0))
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
    old_owned = slice_owners(model, old)
    # slice -> host -> first surviving holder on that host
    holders: dict[Slice, dict[str, str]] = {}
    for dev, held in old_owned.items():
        if dev in present:
            host = present[dev].host
            for piece in held:
                holders.setdefault(piece, {}).setdefault(host, dev)
    sliced: dict[int, list[Slice]] = {}
    for piece in holders:
        if piece[1] > 1:
            sliced.setdefault(piece[0], []).append(piece)
    ckpt_s = 8.0 / (1000.0 * cluster.network.inter_host_gbps)
    ckpt_lat = cluster.network.latency_us / 1e6
    recv_s: dict[str, float] = {}
    recv_mb: dict[str, float] = {}
    send_s: dict[str, float] = {}
    total = 0.0
    for dev, slices in slice_owners(model, new).items():
        have = old_owned.get(dev, set())
        for piece in sorted(slices - have):
            layer, degree, _ = piece
            if degree > 1 and (layer, 1, 0) in have:
                continue  # the whole layer holds every slice of it
            mb = model.layers[layer].param_mb * factor
            if degree > 1:
                mb /= degree
            elif have:  # whole from slices: the slices it holds stay
                mb *= 1.0 - sum(1.0 / d for (lay, d, _) in have if lay == layer and d > 1)
            if mb <= 1e-12:
                continue
            best_src, best_t = CHECKPOINT, ckpt_lat + mb * ckpt_s
            by_host = holders.get(piece)
            if degree > 1 and (layer, 1, 0) in holders:
                by_host = {**holders[(layer, 1, 0)], **(by_host or {})}
            elif degree == 1 and by_host is None:  # gathered from the slices' holders
                for other in sliced.get(layer, []):
                    by_host = {**holders[other], **(by_host or {})}
            for src in _sources(by_host, present[dev].host):
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
