"""JSON <-> domain types, with validation that names the field and the problem.

Every ``*_from_dict`` takes the parsed JSON and a ``path`` prefix used in
error messages (``model.layers[3].fwd_gflop: must be >= 0, got -1``). Only the
*shape* of a plan is checked here; whether a plan is valid for a cluster and a
model (coverage, memory, deadlock) is the reference model's job
(:func:`hetpilot.planner.refmodel.validate_plan`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ValidationError
from .types import (
    COST_KINDS,
    DEFAULT_V,
    SCHEDULES,
    Cluster,
    Device,
    Group,
    Job,
    Layer,
    Link,
    Model,
    Network,
    Plan,
    Stage,
    budget_problem,
)

__all__ = [
    "MAX_INTEGER",
    "MAX_MICROBATCHES",
    "MAX_NUMBER",
    "MIN_POSITIVE",
    "check_integer",
    "check_number",
    "cluster_from_dict",
    "cluster_to_dict",
    "job_from_dict",
    "load_json",
    "model_from_dict",
    "model_to_dict",
    "plan_from_dict",
    "plan_to_dict",
]

_OP = re.compile(r"^[FB](0|[1-9][0-9]*)$")


def load_json(path: str | Path, what: str) -> Any:
    """Read a JSON file; errors name ``what`` (e.g. ``--cluster``)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValidationError(what, f"cannot read {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ValidationError(what, f"{str(path)!r} is not valid JSON: {exc}") from exc


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


# -- field helpers -----------------------------------------------------------

def _obj(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValidationError(path, f"must be an object, got {_kind(value)}")
    return value


def _list(value: Any, path: str, *, non_empty: bool = False) -> list[Any]:
    if not isinstance(value, list):
        raise ValidationError(path, f"must be a list, got {_kind(value)}")
    if non_empty and not value:
        raise ValidationError(path, "must not be empty")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def _required(obj: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in obj:
        raise ValidationError(f"{path}.{key}", "is required")
    return obj[key]


def _str(obj: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str:
    value = obj.get(key, default) if default is not None else _required(obj, key, path)
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{path}.{key}", f"must be a non-empty string, got {value!r}")
    return value


def _num(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    *,
    default: float | None = None,
    positive: bool = False,
) -> float:
    value = _required(obj, key, path) if default is None else obj.get(key, default)
    return check_number(value, f"{path}.{key}", positive=positive)


MAX_NUMBER = 1e12
"""The largest value a number of the contract may take. Far beyond any real device, link,
model or budget (1e12 TFLOP/s, GB, Gbit/s, GFLOP per sample, MB, $/h, W, us), and small
enough, with :data:`MIN_POSITIVE`, that spec 5's products and quotients of them stay
finite: a layer of 1e308 GFLOP made the iteration time infinite and the output invalid
JSON."""
MIN_POSITIVE = 1e-9
"""The smallest value a number that must be positive may take (a 1e-320 Gbit/s link
overflowed the transfer time)."""
MAX_INTEGER = 2**53
"""The largest integer the contract takes (beyond it a float no longer holds it exactly)."""
MAX_MICROBATCHES = 2**20
"""Microbatches per iteration in one group at most: the reference model and the planner
keep per-microbatch op times, and a global batch of 2**70 samples overflowed them."""


def check_number(value: Any, path: str, *, positive: bool = False) -> float:
    """A finite number in ``[0, MAX_NUMBER]`` (``positive``: in ``[MIN_POSITIVE,
    MAX_NUMBER]``), or ValidationError naming ``path``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(path, f"must be a number, got {_kind(value)}")
    if isinstance(value, int) and abs(value) > 1e300:  # float(value) would overflow
        raise ValidationError(path, f"must be a number below 1e300, got {len(str(value))} digits")
    if not math.isfinite(value):
        raise ValidationError(path, f"must be finite, got {value}")
    if positive and value <= 0:
        raise ValidationError(path, f"must be > 0, got {value:g}")
    if value < 0:
        raise ValidationError(path, f"must be >= 0, got {value:g}")
    if value > MAX_NUMBER:
        raise ValidationError(path, f"must be at most {MAX_NUMBER:g}, got {value:g}")
    if positive and value < MIN_POSITIVE:
        raise ValidationError(path, f"must be at least {MIN_POSITIVE:g}, got {value:g}")
    return float(value)


def _int(obj: Mapping[str, Any], key: str, path: str, *, minimum: int = 1) -> int:
    value = _required(obj, key, path)
    return check_integer(value, f"{path}.{key}", minimum=minimum)


def check_integer(value: Any, path: str, *, minimum: int = 1) -> int:
    """An integer (or a float holding one) in ``[minimum, MAX_INTEGER]``, or
    ValidationError naming ``path``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(path, f"must be an integer, got {_kind(value)} {value!r}")
    if value < minimum:
        raise ValidationError(path, f"must be >= {minimum}, got {value}")
    if value > MAX_INTEGER:
        raise ValidationError(path, f"must be at most 2**53, got {value:.3g}")
    return value


def _microbatches(samples: int, micro: int, path: str) -> None:
    """Refuse more than :data:`MAX_MICROBATCHES` microbatches of ``micro`` in ``samples``."""
    if samples > micro * MAX_MICROBATCHES:
        raise ValidationError(path, f"makes {samples // micro} microbatches of {micro}; at most "
                                    f"{MAX_MICROBATCHES} (2**20) are planned: raise "
                                    "microbatch_size")


def _bool(obj: Mapping[str, Any], key: str, path: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise ValidationError(f"{path}.{key}", f"must be true or false, got {value!r}")
    return value


# -- cluster -----------------------------------------------------------------

def cluster_from_dict(data: Any, path: str = "cluster") -> Cluster:
    obj = _obj(data, path)
    raw_devices = _list(_required(obj, "devices", path), f"{path}.devices", non_empty=True)
    devices: list[Device] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_devices):
        p = f"{path}.devices[{i}]"
        d = _obj(raw, p)
        dev = Device(
            id=_str(d, "id", p),
            host=_str(d, "host", p),
            tflops=_num(d, "tflops", p, positive=True),
            memory_gb=_num(d, "memory_gb", p, positive=True),
            price_per_hour=_num(d, "price_per_hour", p, default=0.0),
            power_watts=_num(d, "power_watts", p, default=0.0),
            kind=None if d.get("kind") is None else _str(d, "kind", p),
        )
        if dev.id in seen:
            raise ValidationError(f"{p}.id", f"duplicate device id {dev.id!r}")
        seen.add(dev.id)
        devices.append(dev)
    hosts = {d.host for d in devices}
    net_path = f"{path}.network"
    net = _obj(obj.get("network", {}), net_path)
    network = Network(
        intra_host_gbps=_num(net, "intra_host_gbps", net_path, positive=True),
        inter_host_gbps=_num(net, "inter_host_gbps", net_path, positive=True),
        latency_us=_num(net, "latency_us", net_path, default=0.0),
        host_links=_links(net, "host_links", net_path, hosts, "host"),
        device_links=_links(net, "device_links", net_path, seen, "device"),
    )
    return Cluster(devices=tuple(devices), network=network)


def _links(
    net: Mapping[str, Any], key: str, path: str, known: set[str], what: str
) -> tuple[Link, ...]:
    links = []
    for i, raw in enumerate(_list(net.get(key, []), f"{path}.{key}")):
        p = f"{path}.{key}[{i}]"
        d = _obj(raw, p)
        a, b = _str(d, "a", p), _str(d, "b", p)
        for end, name in (("a", a), ("b", b)):
            if name not in known:
                raise ValidationError(f"{p}.{end}", f"unknown {what} {name!r}")
        if a == b:
            raise ValidationError(p, f"a link needs two distinct {what}s, got {a!r} twice")
        latency = d.get("latency_us")
        links.append(
            Link(
                a=a,
                b=b,
                gbps=_num(d, "gbps", p, positive=True),
                latency_us=None if latency is None else check_number(latency, f"{p}.latency_us"),
            )
        )
    return tuple(links)


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    def link(lk: Link) -> dict[str, Any]:
        out: dict[str, Any] = {"a": lk.a, "b": lk.b, "gbps": lk.gbps}
        if lk.latency_us is not None:
            out["latency_us"] = lk.latency_us
        return out

    net = cluster.network
    return {
        "devices": [
            {
                "id": d.id,
                "host": d.host,
                "tflops": d.tflops,
                "memory_gb": d.memory_gb,
                "price_per_hour": d.price_per_hour,
                "power_watts": d.power_watts,
                **({} if d.kind is None else {"kind": d.kind}),
            }
            for d in cluster.devices
        ],
        "network": {
            "intra_host_gbps": net.intra_host_gbps,
            "inter_host_gbps": net.inter_host_gbps,
            "latency_us": net.latency_us,
            "host_links": [link(lk) for lk in net.host_links],
            "device_links": [link(lk) for lk in net.device_links],
        },
    }


# -- model -------------------------------------------------------------------

def model_from_dict(data: Any, path: str = "model") -> Model:
    obj = _obj(data, path)
    raw_layers = _list(_required(obj, "layers", path), f"{path}.layers", non_empty=True)
    layers = []
    for i, raw in enumerate(raw_layers):
        p = f"{path}.layers[{i}]"
        d = _obj(raw, p)
        fwd = _num(d, "fwd_gflop", p)
        layers.append(
            Layer(
                name=str(d.get("name", f"layer{i}")),
                fwd_gflop=fwd,
                bwd_gflop=_num(d, "bwd_gflop", p, default=2.0 * fwd),
                out_mb=_num(d, "out_mb", p),
                act_mb=_num(d, "act_mb", p),
                param_mb=_num(d, "param_mb", p),
                **_tp_fields(d, p),
            )
        )
    if sum(layer.fwd_gflop + layer.bwd_gflop for layer in layers) <= 0:
        raise ValidationError(f"{path}.layers", "the model does no work: all GFLOP are 0")
    return Model(
        name=str(obj.get("name", "model")),
        layers=tuple(layers),
        optimizer_factor=_num(obj, "optimizer_factor", path, default=3.0),
    )


def _tp_fields(d: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A layer's tensor-parallel keys (spec 2); absent keys keep the Layer defaults."""
    out: dict[str, Any] = {}
    if d.get("tp_comm_mb") is not None:
        out["tp_comm_mb"] = _num(d, "tp_comm_mb", path)
    if "tp_allreduces" in d:
        out["tp_allreduces"] = _int(d, "tp_allreduces", path, minimum=0)
    if d.get("tp_max") is not None:
        out["tp_max"] = _int(d, "tp_max", path, minimum=1)
    if "tp_efficiency" in d:
        raw = _obj(d["tp_efficiency"], f"{path}.tp_efficiency")
        eff: dict[int, float] = {}
        for key, value in raw.items():
            kp = f"{path}.tp_efficiency.{key}"
            if not (isinstance(key, str) and key.isdigit() and int(key) >= 2):
                raise ValidationError(kp, f"keys must be degrees >= 2 as strings, got {key!r}")
            e = check_number(value, kp, positive=True)
            if e > 1.0:
                raise ValidationError(kp, f"must be at most 1 (a fraction of the ideal speed-up), "
                                          f"got {e:g}")
            eff[int(key)] = e
        out["tp_efficiency"] = tuple(sorted(eff.items()))
    if d.get("kind_scale") is not None:
        out["kind_scale"] = _kind_scale(d["kind_scale"], f"{path}.kind_scale")
    return out


def _kind_scale(data: Any, path: str) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
    """A layer's ``kind_scale`` (spec 2): ``{kind: factor}`` or ``{kind: {degree: factor}}``;
    a plain factor is kept as degree 0 (every degree)."""
    out = []
    for kind, value in _obj(data, path).items():
        kp = f"{path}.{kind}"
        if not kind.strip():
            raise ValidationError(kp, "a device kind must be a non-empty string")
        if isinstance(value, Mapping):
            factors = []
            for key, f in value.items():
                dp = f"{kp}.{key}"
                if not (isinstance(key, str) and key.isdigit() and int(key) >= 1):
                    raise ValidationError(dp, f"keys must be degrees >= 1 as strings, got {key!r}")
                factors.append((int(key), check_number(f, dp, positive=True)))
            out.append((kind, tuple(sorted(factors))))
        else:
            out.append((kind, ((0, check_number(value, kp, positive=True)),)))
    return tuple(out)


def _layer_to_dict(layer: Layer) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": layer.name,
        "fwd_gflop": layer.fwd_gflop,
        "bwd_gflop": layer.bwd_gflop,
        "out_mb": layer.out_mb,
        "act_mb": layer.act_mb,
        "param_mb": layer.param_mb,
    }
    if layer.tp_comm_mb is not None:  # a v1 layer is written as v1
        out["tp_comm_mb"] = layer.tp_comm_mb
        out["tp_allreduces"] = layer.tp_allreduces
        if layer.tp_max is not None:
            out["tp_max"] = layer.tp_max
        if layer.tp_efficiency:
            out["tp_efficiency"] = {str(k): v for k, v in layer.tp_efficiency}
    if layer.kind_scale:
        out["kind_scale"] = {k: f[0][1] if f and f[0][0] == 0 else {str(d): x for d, x in f}
                             for k, f in layer.kind_scale}
    return out


def model_to_dict(model: Model) -> dict[str, Any]:
    return {
        "name": model.name,
        "optimizer_factor": model.optimizer_factor,
        "layers": [_layer_to_dict(layer) for layer in model.layers],
    }


# -- job ---------------------------------------------------------------------

def job_from_dict(data: Any, path: str = "job") -> Job:
    obj = _obj(data, path)
    batch = _int(obj, "global_batch", path)
    micro = _int(obj, "microbatch_size", path)
    _microbatches(batch, micro, f"{path}.global_batch")
    if batch % micro:
        raise ValidationError(
            f"{path}.global_batch",
            f"must be a multiple of microbatch_size {micro}, got {batch}",
        )
    raw_sched = obj.get("schedule", ["1f1b", "gpipe"])
    if isinstance(raw_sched, str):
        raw_sched = ["1f1b", "gpipe", "custom"] if raw_sched == "any" else [raw_sched]
    scheds = _list(raw_sched, f"{path}.schedule", non_empty=True)
    for i, s in enumerate(scheds):
        if s not in SCHEDULES:
            raise ValidationError(
                f"{path}.schedule[{i}]", f"must be one of {', '.join(SCHEDULES)}, got {s!r}"
            )
    budgets_raw = _obj(obj.get("budgets", {}), f"{path}.budgets")
    budgets = {}
    for kind, value in budgets_raw.items():
        if kind not in COST_KINDS:
            raise ValidationError(
                f"{path}.budgets.{kind}", f"unknown cost kind; known: {', '.join(COST_KINDS)}"
            )
        budgets[kind] = check_number(value, f"{path}.budgets.{kind}")
        if (problem := budget_problem(budgets[kind])) is not None:
            raise ValidationError(f"{path}.budgets.{kind}", problem)
    return Job(
        global_batch=batch,
        microbatch_size=micro,
        schedules=tuple(dict.fromkeys(scheds)),
        budgets=budgets,
        # a V the job gives is the contract's weight (> 0); leaving it out picks
        # the controller's learned default (DEFAULT_V, docs/controller.md)
        V=_num(obj, "V", path, positive=True) if "V" in obj else DEFAULT_V,
        tensor_parallel=_bool(obj, "tensor_parallel", path),
    )


# -- plan --------------------------------------------------------------------

def plan_from_dict(data: Any, path: str = "plan") -> Plan:
    """Parse a plan's shape. Semantic validity is checked by the reference model."""
    obj = _obj(data, path)
    micro = _int(obj, "microbatch_size", path)
    schedule = _required(obj, "schedule", path)
    if schedule not in SCHEDULES:
        raise ValidationError(
            f"{path}.schedule", f"must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
        )
    groups = []
    for gi, raw in enumerate(_list(_required(obj, "groups", path), f"{path}.groups", non_empty=True)):
        gp = f"{path}.groups[{gi}]"
        g = _obj(raw, gp)
        stages = []
        raw_stages = _list(_required(g, "stages", gp), f"{gp}.stages", non_empty=True)
        for si, raw_stage in enumerate(raw_stages):
            sp = f"{gp}.stages[{si}]"
            s = _obj(raw_stage, sp)
            rng = _list(_required(s, "layers", sp), f"{sp}.layers")
            if len(rng) != 2:
                raise ValidationError(f"{sp}.layers", f"must be [start, end], got {rng!r}")
            start = check_integer(rng[0], f"{sp}.layers[0]", minimum=0)
            end = check_integer(rng[1], f"{sp}.layers[1]", minimum=0)
            order = None
            if "order" in s and s["order"] is not None:
                ops = _list(s["order"], f"{sp}.order")
                for oi, op in enumerate(ops):
                    if not isinstance(op, str) or not _OP.match(op):
                        raise ValidationError(
                            f"{sp}.order[{oi}]", f'must look like "F3" or "B3", got {op!r}'
                        )
                order = tuple(ops)
            if schedule == "custom" and order is None:
                raise ValidationError(f"{sp}.order", 'is required with schedule "custom"')
            devices = _stage_devices(s, sp)
            stages.append(
                Stage(
                    device=devices[0],
                    devices=devices,
                    layers=(start, end),
                    recompute=_bool(s, "recompute", sp),
                    order=order,
                )
            )
        samples = _int(g, "samples", gp)
        _microbatches(samples, micro, f"{gp}.samples")
        groups.append(Group(samples=samples, stages=tuple(stages)))
    predicted = None
    pred = obj.get("predicted")
    if (isinstance(pred, Mapping) and isinstance(pred.get("iteration_s"), (int, float))
            and not isinstance(pred["iteration_s"], bool)
            and math.isfinite(pred["iteration_s"])):  # informative: a NaN is left out
        predicted = float(pred["iteration_s"])
    return Plan(
        microbatch_size=micro,
        schedule=schedule,
        groups=tuple(groups),
        predicted_iteration_s=predicted,
    )


def _stage_devices(s: Mapping[str, Any], sp: str) -> tuple[str, ...]:
    """A stage's ``device``, or its tensor-parallel ``devices`` (exactly one of the two)."""
    if "devices" not in s:
        return (_str(s, "device", sp),)
    if "device" in s:
        raise ValidationError(f"{sp}.devices", 'give "device" or "devices", not both')
    raw = _list(s["devices"], f"{sp}.devices", non_empty=True)
    seen: dict[str, int] = {}
    for i, dev in enumerate(raw):
        dp = f"{sp}.devices[{i}]"
        if not isinstance(dev, str) or not dev.strip():
            raise ValidationError(dp, f"must be a non-empty string, got {dev!r}")
        if dev in seen:
            raise ValidationError(dp, f"{dev!r} is already devices[{seen[dev]}]")
        seen[dev] = i
    return tuple(raw)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    groups = []
    for g in plan.groups:
        stages = []
        for s in g.stages:
            stage: dict[str, Any] = (
                {"device": s.device} if s.tp == 1 else {"devices": list(s.devices)})
            stage["layers"] = [s.layers[0], s.layers[1]]
            if s.recompute:
                stage["recompute"] = True
            if plan.schedule == "custom" and s.order is not None:
                stage["order"] = list(s.order)
            stages.append(stage)
        groups.append({"samples": g.samples, "stages": stages})
    out: dict[str, Any] = {
        "microbatch_size": plan.microbatch_size,
        "schedule": plan.schedule,
        "groups": groups,
    }
    if plan.predicted_iteration_s is not None:
        out["predicted"] = {"iteration_s": round(plan.predicted_iteration_s, 6)}
    return out
