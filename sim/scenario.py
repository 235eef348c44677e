"""Scenarios (spec v1 section 6): parsing, validation, and the truth per slot.

A scenario is a cluster, a model, a job, a number of ``slots`` and a list of
``events``. An event takes effect from its slot on:

- ``{"slot", "device", ...}`` with any of ``tflops_scale`` (multiplies the
  device's nominal ``tflops``; 1.0 restores it), ``tflops``, ``memory_gb``,
  ``price_per_hour``, ``power_watts`` (set that field) and ``down`` (true
  removes the device, false returns it);
- ``{"slot", "hosts": [a, b], "gbps"[, "latency_us"]}`` sets a host link;
- ``{"slot", "budgets": {kind: value}}`` and/or ``{"slot", "V": v}`` change
  the job's budgets (the kinds named; others keep theirs) and V: an extension
  of section 6, since budgets can change while a job runs.

Optional top-level ``iterations_per_slot`` (default 100) is how many
iterations one slot (an epoch) holds: switching time is spread over them.

Every error names its field (``scenario.events[3].device: unknown device
'x:9'``) and is a :class:`~hetpilot.planner.errors.ValidationError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hetpilot.planner import serde
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.types import COST_KINDS, Cluster, Device, Job, Link, Model

__all__ = ["Event", "Scenario", "Timeline", "load_scenario", "scenario_from_dict"]

_DEVICE_FIELDS = ("tflops", "memory_gb", "price_per_hour", "power_watts")
_POSITIVE = ("tflops", "memory_gb", "tflops_scale", "gbps", "V")
_EVENT_KEYS = frozenset(
    {"slot", "device", "tflops_scale", "down", "hosts", "gbps", "latency_us", "budgets", "V",
     *_DEVICE_FIELDS}
)
DEFAULT_ITERATIONS_PER_SLOT = 100


@dataclass(frozen=True, kw_only=True)
class Event:
    slot: int
    device: str | None = None
    set_fields: Mapping[str, float] = field(default_factory=dict)
    """Device fields to set (tflops, memory_gb, price_per_hour, power_watts)."""
    tflops_scale: float | None = None
    down: bool | None = None
    hosts: tuple[str, str] | None = None
    gbps: float | None = None
    latency_us: float | None = None
    budgets: Mapping[str, float] = field(default_factory=dict)
    V: float | None = None


@dataclass(frozen=True, kw_only=True)
class Scenario:
    cluster: Cluster
    model: Model
    job: Job
    slots: int
    events: tuple[Event, ...] = ()
    iterations_per_slot: int = DEFAULT_ITERATIONS_PER_SLOT


MAX_SLOTS = 10**6
"""Slots a scenario may have: the simulator plans each one (2**53 slots would never end)."""


def load_scenario(path: str) -> Scenario:
    return scenario_from_dict(serde.load_json(path, "--scenario"))


def scenario_from_dict(data: Any, path: str = "scenario") -> Scenario:
    if not isinstance(data, Mapping):
        raise ValidationError(path, "must be an object")
    for key in ("cluster", "model", "job", "slots"):
        if key not in data:
            raise ValidationError(f"{path}.{key}", "is required")
    cluster = serde.cluster_from_dict(data["cluster"], f"{path}.cluster")
    model = serde.model_from_dict(data["model"], f"{path}.model")
    job = serde.job_from_dict(data["job"], f"{path}.job")
    slots = serde.check_integer(data["slots"], f"{path}.slots", minimum=1)
    if slots > MAX_SLOTS:
        raise ValidationError(f"{path}.slots", f"must be at most {MAX_SLOTS}, got {slots}")
    per_slot = serde.check_integer(data.get("iterations_per_slot", DEFAULT_ITERATIONS_PER_SLOT),
                    f"{path}.iterations_per_slot", minimum=1)
    raw_events = data.get("events", [])
    if not isinstance(raw_events, list):
        raise ValidationError(f"{path}.events", "must be a list")
    hosts = set(cluster.hosts)
    events = [
        _event(raw, f"{path}.events[{i}]", cluster, hosts, slots) for i, raw in enumerate(raw_events)
    ]
    events.sort(key=lambda e: e.slot)  # stable: same-slot events keep file order
    return Scenario(cluster=cluster, model=model, job=job, slots=slots, events=tuple(events),
                    iterations_per_slot=per_slot)


def _event(raw: Any, p: str, cluster: Cluster, hosts: set[str], slots: int) -> Event:
    if not isinstance(raw, Mapping):
        raise ValidationError(p, "must be an object")
    for key in raw:
        if key not in _EVENT_KEYS:
            raise ValidationError(f"{p}.{key}", f"unknown event field; known: {', '.join(sorted(_EVENT_KEYS))}")
    if "slot" not in raw:
        raise ValidationError(f"{p}.slot", "is required")
    slot = serde.check_integer(raw["slot"], f"{p}.slot", minimum=0)
    if slot >= slots:
        raise ValidationError(f"{p}.slot", f"must be < slots ({slots}), got {slot}")
    nums = {k: serde.check_number(raw[k], f"{p}.{k}", positive=k in _POSITIVE)
            for k in (*_DEVICE_FIELDS, "tflops_scale", "gbps", "latency_us", "V") if k in raw}
    device = raw.get("device")
    has_device_part = any(k in raw for k in (*_DEVICE_FIELDS, "tflops_scale", "down"))
    if device is not None:
        if not isinstance(device, str) or device not in cluster.by_id:
            raise ValidationError(f"{p}.device", f"unknown device {device!r}")
        if not has_device_part:
            raise ValidationError(p, "a device event needs tflops_scale, down or a device field")
    elif has_device_part:
        raise ValidationError(f"{p}.device", "is required with tflops_scale, down or a device field")
    down = raw.get("down")
    if down is not None and not isinstance(down, bool):
        raise ValidationError(f"{p}.down", f"must be true or false, got {down!r}")
    pair = None
    if "hosts" in raw:
        h = raw["hosts"]
        if not isinstance(h, list) or len(h) != 2:
            raise ValidationError(f"{p}.hosts", f"must be a list of two hosts, got {h!r}")
        for i, name in enumerate(h):
            if not isinstance(name, str) or name not in hosts:
                raise ValidationError(f"{p}.hosts[{i}]", f"unknown host {name!r}")
        if h[0] == h[1]:
            raise ValidationError(f"{p}.hosts", f"needs two distinct hosts, got {h[0]!r} twice")
        if "gbps" not in raw:
            raise ValidationError(f"{p}.gbps", "is required with hosts")
        pair = (str(h[0]), str(h[1]))
    elif "gbps" in raw or "latency_us" in raw:
        raise ValidationError(f"{p}.hosts", "is required with gbps or latency_us")
    budgets = {}
    if "budgets" in raw:
        if not isinstance(raw["budgets"], Mapping):
            raise ValidationError(f"{p}.budgets", "must be an object")
        for kind, value in raw["budgets"].items():
            if kind not in COST_KINDS:
                raise ValidationError(f"{p}.budgets.{kind}", f"unknown cost kind; known: {', '.join(COST_KINDS)}")
            budgets[kind] = serde.check_number(value, f"{p}.budgets.{kind}", positive=False)
    if device is None and pair is None and not budgets and "V" not in raw:
        raise ValidationError(p, "an event needs device, hosts, budgets or V")
    return Event(
        slot=slot,
        device=device,
        set_fields={k: nums[k] for k in _DEVICE_FIELDS if k in nums},
        tflops_scale=nums.get("tflops_scale"),
        down=down,
        hosts=pair,
        gbps=nums.get("gbps"),
        latency_us=nums.get("latency_us"),
        budgets=budgets,
        V=nums.get("V"),
    )


def _set_fields(d: Device, fields: Mapping[str, float]) -> Device:
    return replace(
        d,
        tflops=fields.get("tflops", d.tflops),
        memory_gb=fields.get("memory_gb", d.memory_gb),
        price_per_hour=fields.get("price_per_hour", d.price_per_hour),
        power_watts=fields.get("power_watts", d.power_watts),
    )


class Timeline:
    """The scenario's truth slot by slot.

    ``full(t)`` is every device with its fields in slot t (down ones too),
    ``truth(t)`` the cluster of slot t (down devices removed), ``up(t)`` the
    ids that are up. Slots without events share one Cluster object, so that
    caches keyed on the cluster hit.
    """

    def __init__(self, scenario: Scenario, slots: int | None = None) -> None:
        n = scenario.slots if slots is None else slots
        base = scenario.cluster
        nominal = {d.id: d for d in base.devices}
        current = dict(nominal)
        scale = {d.id: 1.0 for d in base.devices}
        down: set[str] = set()
        host_links = list(base.network.host_links)
        budgets = dict(scenario.job.budgets)
        V = scenario.job.V
        by_slot: dict[int, list[Event]] = {}
        for ev in scenario.events:
            by_slot.setdefault(ev.slot, []).append(ev)
        self._full: list[Cluster] = []
        self._truth: list[Cluster] = []
        self._budgets: list[dict[str, float]] = []
        self._V: list[float] = []
        full = base
        truth = base
        for t in range(n):
            events = by_slot.get(t, [])
            for ev in events:
                if ev.device is not None:
                    dev = ev.device
                    if ev.set_fields:
                        nominal[dev] = _set_fields(nominal[dev], ev.set_fields)
                    if ev.tflops_scale is not None:
                        scale[dev] = ev.tflops_scale
                    current[dev] = replace(nominal[dev], tflops=nominal[dev].tflops * scale[dev])
                    if ev.down is True:
                        down.add(dev)
                    elif ev.down is False:
                        down.discard(dev)
                if ev.hosts is not None:
                    assert ev.gbps is not None
                    host_links.append(Link(a=ev.hosts[0], b=ev.hosts[1], gbps=ev.gbps,
                                           latency_us=ev.latency_us))
                budgets.update(ev.budgets)
                if ev.V is not None:
                    V = ev.V
            if any(ev.device is not None or ev.hosts is not None for ev in events):
                devices: tuple[Device, ...] = tuple(current[d.id] for d in base.devices)
                net = replace(base.network, host_links=tuple(host_links))
                full = Cluster(devices=devices, network=net)
                truth = full.without(frozenset(down)) if down else full
            self._full.append(full)
            self._truth.append(truth)
            self._budgets.append(dict(budgets))
            self._V.append(V)

    def __len__(self) -> int:
        return len(self._truth)

    def full(self, t: int) -> Cluster:
        return self._full[t]

    def truth(self, t: int) -> Cluster:
        return self._truth[t]

    def up(self, t: int) -> frozenset[str]:
        return frozenset(self._truth[t].by_id)

    def budgets(self, t: int) -> dict[str, float]:
        return dict(self._budgets[t])

    def V(self, t: int) -> float:
        return self._V[t]
