"""The estimator's inputs: what agents and trainers already report, as one vector.

A row describes one pipeline stage on one device for the next slot:

- *interference* (agent report, :class:`hetpilot.daemon.records.DeviceReport`
  and ``LinkReport``): device utilisation 0..1, co-located load 0..1 and
  runnable co-located processes, memory in use (fraction), the device's
  probe speed over its quiet speed (the agent's matmul probe, ``tflops`` in
  the report over the registered ``tflops``), link round-trip time and its
  jitter (standard deviation of the last round-trip times the daemon kept:
  no new report field is needed);
- *workload* (model profile, spec v1 section 2, for the stage's layers and
  one microbatch): forward GFLOP, parameter MB, activation MB kept for the
  backward, output MB sent on, arithmetic intensity (GFLOP per MB touched),
  and the share of layers of each kind (linear, conv, norm, activation,
  other), taken from layer names;
- *history* (trainer reports, :class:`History`): the stage's own measured
  slowdown in the previous slot (0 when it did not run there: a new stage
  after a re-cut, or a device that just joined) and the device's slowdown in
  the previous slot on whatever it ran (0 when it ran nothing).

The target is the stage's *slowdown*: measured time over its time on the
same device when quiet (>= about 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

__all__ = [
    "FEATURES",
    "HISTORY",
    "INTERFERENCE",
    "KINDS",
    "WORKLOAD",
    "History",
    "Interference",
    "Workload",
    "layer_kind",
    "row",
    "workload_of",
]

KINDS = ("linear", "conv", "norm", "act", "other")
_KIND_WORDS = {
    "conv": ("conv",),
    "norm": ("norm", "bn", "ln"),
    "act": ("relu", "gelu", "tanh", "sigmoid", "silu", "act", "softmax", "dropout"),
    "linear": ("linear", "fc", "mlp", "proj", "dense", "attn", "embed", "head", "lm"),
}


def layer_kind(name: str) -> str:
    """Kind of a layer from its (profile) name, e.g. ``"3.Linear"`` -> linear."""
    low = name.lower()
    for kind in ("conv", "norm", "act", "linear"):
        if any(w in low for w in _KIND_WORDS[kind]):
            return kind
    return "other"


@dataclass(frozen=True, kw_only=True)
class Interference:
    utilization: float = 0.0
    colocated_load: float = 0.0
    colocated_processes: float = 0.0
    memory_used: float = 0.0
    """Fraction of the device's memory in use (0..1)."""
    probe_ratio: float = 1.0
    """Agent probe speed now over the device's quiet (registered) speed."""
    rtt_us: float = 0.0
    rtt_jitter_us: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Workload:
    gflop: float
    """Forward GFLOP of one microbatch through the stage."""
    param_mb: float
    act_mb: float
    out_mb: float
    linear: float = 0.0
    conv: float = 0.0
    norm: float = 0.0
    act: float = 0.0
    other: float = 0.0

    @property
    def log_intensity(self) -> float:
        return math.log10(max(self.gflop, 1e-9) / max(self.param_mb + self.act_mb, 1e-6))


@dataclass(frozen=True, kw_only=True)
class History:
    """What the trainer reported for the previous slot (0 = nothing reported)."""

    stage_last_slowdown: float = 0.0
    """This stage's measured slowdown in the previous slot on this device."""
    device_last_slowdown: float = 0.0
    """The device's measured slowdown in the previous slot, any stage."""


INTERFERENCE = tuple(f.name for f in fields(Interference))
WORKLOAD = (*(f.name for f in fields(Workload)), "log_intensity")
HISTORY = tuple(f.name for f in fields(History))
FEATURES = (*INTERFERENCE, *WORKLOAD, *HISTORY)


def workload_of(layers: Sequence[object], microbatch: int) -> Workload:
    """Workload of a stage: ``layers`` are spec-section-2 layers (objects with
    name, fwd_gflop, param_mb, act_mb, out_mb) for one microbatch of size
    ``microbatch``."""
    if not layers:
        raise ValueError("a stage has at least one layer")
    kinds = dict.fromkeys(KINDS, 0.0)
    for layer in layers:
        kinds[layer_kind(str(getattr(layer, "name", "")))] += 1.0 / len(layers)
    return Workload(
        gflop=microbatch * sum(float(getattr(x, "fwd_gflop")) for x in layers),  # noqa: B009
        param_mb=sum(float(getattr(x, "param_mb")) for x in layers),  # noqa: B009
        act_mb=microbatch * sum(float(getattr(x, "act_mb")) for x in layers),  # noqa: B009
        out_mb=microbatch * float(getattr(layers[-1], "out_mb")),  # noqa: B009
        **kinds,
    )


def row(inter: Interference, work: Workload, hist: History | None = None) -> list[float]:
    """The feature vector, in :data:`FEATURES` order."""
    out = [float(v) for v in asdict(inter).values()]
    out += [float(v) for v in asdict(work).values()]
    out.append(work.log_intensity)
    out += [float(v) for v in asdict(hist or History()).values()]
    return out


def from_mapping(data: Mapping[str, object]) -> list[float]:
    """Feature vector from a mapping holding every name of :data:`FEATURES`
    (a CSV row of the recorded data set)."""
    return [float(data[name]) for name in FEATURES]  # type: ignore[arg-type]
