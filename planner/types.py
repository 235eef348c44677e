"""Domain types of spec v1 (sections 1-4) as frozen dataclasses.

The types hold already-validated values; parsing and validation of JSON lives
in :mod:`hetpilot.planner.serde`. Nothing here imports grpc or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise
from types import MappingProxyType

__all__ = [
    "COST_KINDS",
    "DEFAULT_V",
    "MAX_BUDGET",
    "MIN_BUDGET",
    "SCHEDULES",
    "Cluster",
    "Device",
    "Group",
    "Job",
    "Layer",
    "Link",
    "Model",
    "Network",
    "Plan",
    "Stage",
    "budget_problem",
]

SCHEDULES = ("gpipe", "1f1b", "custom")
#: Cost rates a plan has (spec 5.5); budgets are kept on these.
COST_KINDS = ("price_per_hour", "power_watts")
#: A positive budget below this is refused: the default V weighs a queue by
#: ``1 / budget**2`` and rescales queues by it, which leaves floating point for
#: budgets near 1e-154 (a budget of 0, "spend nothing", is allowed).
MIN_BUDGET = 1e-9
#: The largest budget (the daemon's bound on every rate it takes).
MAX_BUDGET = 1e12


def budget_problem(value: float) -> str | None:
    """What is wrong with a budget's value (a finite number already), or None."""
    if value < 0:
        return f"must be >= 0, got {value:g}"
    if 0 < value < MIN_BUDGET:
        return f"must be 0 or at least {MIN_BUDGET:g}, got {value:g}"
    if value > MAX_BUDGET:
        return f"must be at most {MAX_BUDGET:g}, got {value:g}"
    return None


@dataclass(frozen=True, kw_only=True)
class Device:
    id: str
    host: str
    tflops: float
    """Sustained TFLOP/s on this model's layers."""
    memory_gb: float
    """Memory training may use, decimal GB."""
    price_per_hour: float = 0.0
    power_watts: float = 0.0
    kind: str | None = None
    """The device's kind ("A100-40"), which a layer's ``kind_scale`` names (spec 1, 2)."""

    def cost(self, kind: str) -> float:
        return float(getattr(self, kind))


@dataclass(frozen=True, kw_only=True)
class Link:
    a: str
    b: str
    gbps: float
    latency_us: float | None = None
    """None takes the network's latency."""


@dataclass(frozen=True, kw_only=True)
class Network:
    intra_host_gbps: float
    inter_host_gbps: float
    latency_us: float
    host_links: tuple[Link, ...] = ()
    device_links: tuple[Link, ...] = ()


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    devices: tuple[Device, ...]
    network: Network

    @cached_property
    def by_id(self) -> Mapping[str, Device]:
        return MappingProxyType({d.id: d for d in self.devices})

    @cached_property
    def hosts(self) -> tuple[str, ...]:
        """Hosts in order of first appearance."""
        return tuple(dict.fromkeys(d.host for d in self.devices))

    @cached_property
    def _host_links(self) -> dict[tuple[str, str], tuple[float, float]]:
        return self._link_table(self.network.host_links)

    @cached_property
    def _device_links(self) -> dict[tuple[str, str], tuple[float, float]]:
        return self._link_table(self.network.device_links)

    def _link_table(self, links: tuple[Link, ...]) -> dict[tuple[str, str], tuple[float, float]]:
        table: dict[tuple[str, str], tuple[float, float]] = {}
        for link in links:  # later entries for the same pair win
            lat = self.network.latency_us if link.latency_us is None else link.latency_us
            table[_pair(link.a, link.b)] = (link.gbps, lat / 1e6)
        return table

    @cached_property
    def _links(self) -> dict[tuple[str, str], tuple[float, float]]:
        return {}

    def link(self, a: str, b: str) -> tuple[float, float]:
        """(Gbit/s, latency in seconds) between two distinct devices (spec section 1)."""
        key = (a, b)
        found = self._links.get(key)  # memoised: the planner asks for the same pairs often
        if found is None:
            found = self._links[key] = self._link(a, b)
        return found

    def path_links(self, ids: Sequence[str]) -> tuple[tuple[float, float], ...]:
        """:meth:`link` between each two consecutive of ``ids``: the same tuples, and
        without a lookup per pair where the network sets no per-pair links."""
        if self.network.device_links or self.network.host_links:
            link = self.link
            return tuple([link(ids[i], ids[i + 1]) for i in range(len(ids) - 1)])
        host_of = self._host_of
        hosts = [host_of[i] for i in ids]  # a KeyError on a foreign id, as link's
        intra, inter = self._default_links
        return tuple([inter if a != b else intra for a, b in pairwise(hosts)])

    @cached_property
    def _host_of(self) -> dict[str, str]:
        return {d.id: d.host for d in self.devices}

    @cached_property
    def _default_links(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(intra-host, inter-host) (Gbit/s, latency in seconds) of the network."""
        latency = self.network.latency_us / 1e6
        return (self.network.intra_host_gbps, latency), (self.network.inter_host_gbps, latency)

    def _link(self, a: str, b: str) -> tuple[float, float]:
        if self.network.device_links:
            found = self._device_links.get(_pair(a, b))
            if found is not None:
                return found
        host_of = self._host_of
        host_a, host_b = host_of[a], host_of[b]
        if host_a != host_b:
            if self.network.host_links:
                found = self._host_links.get(_pair(host_a, host_b))
                if found is not None:
                    return found
            return self._default_links[1]
        return self._default_links[0]

    def without(self, device_ids: set[str] | frozenset[str]) -> Cluster:
        return Cluster(
            devices=tuple(d for d in self.devices if d.id not in device_ids),
            network=self.network,
        )

    @cached_property
    def total_tflops(self) -> float:
        return sum(d.tflops for d in self.devices)


@dataclass(frozen=True, kw_only=True)
class Layer:
    name: str
    fwd_gflop: float
    bwd_gflop: float
    out_mb: float
    act_mb: float
    param_mb: float
    tp_comm_mb: float | None = None
    """MB per sample one all-reduce of the layer's tensor-parallel output moves;
    None: the layer is never split (spec 2, 5.6)."""
    tp_allreduces: int = 1
    """All-reduces per forward when split; the backward does as many."""
    tp_max: int | None = None
    """Largest degree the layer may be split into; None: no limit."""
    tp_efficiency: tuple[tuple[int, float], ...] = ()
    """(degree, fraction of the ideal speed-up the split compute reaches), by degree;
    degrees not named reach 1."""
    kind_scale: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    """(device kind, ((degree, factor), ...)) by kind: the factor multiplies the layer's
    compute time on a device of that kind when it runs at that degree (spec 2, 5.1);
    degree 0 stands for every degree (the key's plain-number form); kinds and degrees
    not named take 1."""

    def scale(self, kind: str | None, degree: int) -> float:
        """The factor on this layer's compute time on a device of ``kind`` at ``degree``."""
        for k, factors in self.kind_scale:
            if k == kind:
                for d, f in factors:
                    if d == degree or d == 0:
                        return f
                return 1.0
        return 1.0

    def splits(self, degree: int) -> bool:
        """Whether a stage of ``degree`` devices splits this layer (else each device runs it whole)."""
        return degree > 1 and self.tp_comm_mb is not None and (
            self.tp_max is None or degree <= self.tp_max)

    def efficiency(self, degree: int) -> float:
        for d, e in self.tp_efficiency:
            if d == degree:
                return e
        return 1.0


@dataclass(frozen=True, kw_only=True)
class Model:
    name: str
    layers: tuple[Layer, ...]
    optimizer_factor: float = 3.0

    @cached_property
    def kind_scaled(self) -> bool:
        """Whether some layer carries a ``kind_scale`` (else spec 5.1's one rate per device)."""
        return any(layer.kind_scale for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def total_gflop(self) -> float:
        """Forward plus backward GFLOP of one sample."""
        return sum(layer.fwd_gflop + layer.bwd_gflop for layer in self.layers)


#: The V of a job that gives none (the job file leaves ``V`` out): the
#: controller then learns the exchange rate between seconds and cost itself.
DEFAULT_V = 0.0


@dataclass(frozen=True, kw_only=True)
class Job:
    global_batch: int
    microbatch_size: int
    schedules: tuple[str, ...] = ("1f1b", "gpipe")
    """Schedules the planner may choose from (spec section 3)."""
    budgets: Mapping[str, float] = field(default_factory=dict)
    """Long-term average budget per cost kind (spec section 6)."""
    V: float = 0.0
    """Drift-plus-penalty weight on iteration time (spec section 6). The spec
    gives no default; here 0 (:data:`DEFAULT_V`, the job file leaving V out)
    means the job gives none and the controller learns its exchange rate
    between seconds and cost (docs/controller.md)."""
    tensor_parallel: bool = False
    """Whether the job's trainer runs tensor-parallel stages (spec 3); the
    planner offers plans with them only when it does."""

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.microbatch_size


@dataclass(frozen=True, kw_only=True)
class Stage:
    device: str
    """The stage's device; with tensor parallelism the first of ``devices``."""
    layers: tuple[int, int]
    """Half-open layer range [a, b)."""
    recompute: bool = False
    order: tuple[str, ...] | None = None
    """Per-stage op order ("F0", "B0", ...) for the custom schedule."""
    devices: tuple[str, ...] = ()
    """The tensor-parallel group, in ring order (spec 4, 5.6); ``(device,)`` when
    left out. A stage with more than one device splits its layers that many ways."""

    def __post_init__(self) -> None:
        if not self.devices:
            object.__setattr__(self, "devices", (self.device,))
        elif self.devices[0] != self.device:
            raise ValueError(f"Stage.device {self.device!r} must be devices[0] {self.devices[0]!r}")

    @property
    def tp(self) -> int:
        """The stage's tensor-parallel degree (1 without tensor parallelism)."""
        return len(self.devices)


@dataclass(frozen=True, kw_only=True)
class Group:
    samples: int
    stages: tuple[Stage, ...]

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device of the group, stage by stage (all of a tensor-parallel stage's)."""
        return tuple(d for s in self.stages for d in s.devices)

    @property
    def tensor_parallel(self) -> bool:
        return any(s.tp > 1 for s in self.stages)


@dataclass(frozen=True, kw_only=True)
class Plan:
    microbatch_size: int
    schedule: str
    groups: tuple[Group, ...]
    predicted_iteration_s: float | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for g in self.groups for d in g.devices)

    @property
    def global_batch(self) -> int:
        return sum(g.samples for g in self.groups)

    @property
    def tensor_parallel(self) -> bool:
        """Whether any stage of the plan is a tensor-parallel group (spec 4)."""
        return any(g.tensor_parallel for g in self.groups)
