"""Where plans come from, and the check that refuses a wrong plan before any rank computes.

A :class:`PlanSource` yields plan versions as parsed
:class:`~hetpilot.planner.types.Plan` values; rank 0 polls it before every iteration
and broadcasts what it got, so every rank switches to the same version at the same
step (:mod:`hetpilot.trainer.planfeed`). Two sources are
here: :class:`StaticPlanSource` (a fixed list, for tests and benchmarks) and
:class:`FilePlanSource` (a plan file for offline use; rewriting the file with
a new ``"version"`` switches the plan at the next iteration).

This module imports no torch: the CLI checks plans with it before it spawns
any rank.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hetpilot.planner.errors import DeadlockError, InvalidPlanError, ValidationError
from hetpilot.planner.refmodel import pipeline_makespan, validate_plan
from hetpilot.planner.schedules import custom_order, order
from hetpilot.planner.serde import check_integer, plan_from_dict, plan_to_dict
from hetpilot.planner.types import (
    Cluster,
    Device,
    Group,
    Layer,
    Model,
    Network,
    Plan,
    Stage,
)

__all__ = [
    "FilePlanSource",
    "PlanSource",
    "PlanVersion",
    "StaticPlanSource",
    "check_plan",
    "random_plan",
]


@dataclass(frozen=True)
class PlanVersion:
    version: int
    plan: Plan


class PlanSource(Protocol):
    """Yields plan versions; only rank 0's source is polled, before every iteration."""

    def poll(self, after_version: int, *, epoch: int = 0, step: int = 0
             ) -> PlanVersion | None:
        """The newest plan with a version above ``after_version``, or None. ``epoch`` and
        ``step`` are the trainer's position (the next iteration's epoch, the optimizer steps
        taken), for sources that time their plans by it."""
        ...


class StaticPlanSource:
    """Plan version i+1 is ``plans[i]``; version v becomes visible at epoch ``at_epoch[v-1]``
    (default: version i+1 at epoch i), or at global step ``at_step[v-1]`` when given."""

    def __init__(self, plans: Sequence[Plan], at_epoch: Sequence[int] | None = None,
                 at_step: Sequence[int] | None = None) -> None:
        self._plans = list(plans)
        self._at = list(at_epoch) if at_epoch is not None else list(range(len(plans)))
        self._at_step = list(at_step) if at_step is not None else None

    def poll(self, after_version: int, *, epoch: int = 0, step: int = 0
             ) -> PlanVersion | None:
        best = None
        for i, plan in enumerate(self._plans):
            due = self._at_step[i] <= step if self._at_step is not None else self._at[i] <= epoch
            if i + 1 > after_version and due:
                best = PlanVersion(i + 1, plan)
        return best


class FilePlanSource:
    """A spec section 4 plan file, optionally with an integer ``"version"`` (default 1)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None
        """(mtime_ns, size, inode) of the file last read: the trainer polls every iteration,
        and an unchanged file is not read again."""

    def poll(self, after_version: int, *, epoch: int = 0, step: int = 0
             ) -> PlanVersion | None:
        if after_version > 0:
            try:
                st = self.path.stat()
            except OSError:
                return None  # a file being replaced: keep the running plan
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
            if seen == self._seen:
                return None
            self._seen = seen
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            if after_version == 0:
                raise ValidationError("--plan", f"cannot read {str(self.path)!r}: {exc}") from exc
            return None  # a file being rewritten: keep the running plan
        version = (check_integer(data.get("version", 1), "plan.version")
                   if isinstance(data, Mapping) else 1)
        if version <= after_version:
            return None
        return PlanVersion(version, plan_from_dict(data, path="plan"))


# -- refusal -----------------------------------------------------------------

def check_plan(
    plan: Plan, device_ids: Sequence[str], num_layers: int, global_batch: int,
    *, tensor_parallel: bool = False,
) -> list[list[tuple[tuple[bool, int], ...]]]:
    """Refuse a plan the ranks cannot run; return each group's stage op orders.

    Raises :class:`InvalidPlanError` naming the field: a tensor-parallel stage when the
    job has no ``tp_plan`` (``tensor_parallel`` false), a device id no rank
    has, a layer range outside ``[0, num_layers)`` or not covering it, samples
    not summing to ``global_batch`` or not a multiple of the microbatch size,
    a custom order that is malformed or deadlocks.
    """
    known = set(device_ids)
    for gi, group in enumerate(plan.groups):
        for si, stage in enumerate(group.stages):
            if stage.tp > 1 and not tensor_parallel:
                raise InvalidPlanError(
                    f"plan.groups[{gi}].stages[{si}].devices",
                    f"a tensor-parallel stage of {stage.tp} devices, and the job has no "
                    "tp_plan saying what to split (give the job a tp_plan, or plan with "
                    "tensor_parallel = false)",
                )
            for d in stage.devices:
                if d not in known:
                    shown = ", ".join(sorted(known)[:8]) + (" ..." if len(known) > 8 else "")
                    field = "device" if stage.tp == 1 else "devices"
                    raise InvalidPlanError(
                        f"plan.groups[{gi}].stages[{si}].{field}",
                        f"no rank has device {d!r} (ranks have: {shown})",
                    )
    # Memory, speed and hosts do not matter here (the ranks run a tensor-parallel stage
    # over any links): a cluster of the ranks' devices on one host with ample memory, and
    # a model of the right length, let the reference model's validator check everything
    # else with its own messages.
    cluster = Cluster(
        devices=tuple(Device(id=d, host="ranks", tflops=1.0, memory_gb=1e12) for d in known),
        network=Network(intra_host_gbps=1.0, inter_host_gbps=1.0, latency_us=0.0),
    )
    model = Model(
        name="check",
        layers=tuple(
            Layer(name=str(i), fwd_gflop=0.0, bwd_gflop=0.0, out_mb=0.0, act_mb=0.0, param_mb=0.0)
            for i in range(num_layers)
        ),
    )
    validate_plan(cluster, model, plan, global_batch)
    orders: list[list[tuple[tuple[bool, int], ...]]] = []
    for gi, group in enumerate(plan.groups):
        n = len(group.stages)
        micro = group.samples // plan.microbatch_size
        group_orders = [
            custom_order(stage.order, micro, f"plan.groups[{gi}].stages[{j}].order")
            if plan.schedule == "custom" and stage.order is not None
            else order(plan.schedule, n, j, micro)
            for j, stage in enumerate(group.stages)
        ]
        orders.append(group_orders)
        try:
            pipeline_makespan([1.0] * n, [1.0] * n, [0.0] * max(n - 1, 0), group_orders)
        except DeadlockError as exc:
            raise DeadlockError(f"plan.groups[{gi}].{exc.field}", exc.problem) from None
    return orders


# -- random valid plans (train-check) ------------------------------------------

def _random_custom_orders(rng: random.Random, stages: int, micro: int) -> list[list[str]]:
    """Orders read off one random sequential run, so they cannot deadlock."""
    f_done = [[False] * micro for _ in range(stages)]
    b_done = [[False] * micro for _ in range(stages)]
    orders: list[list[str]] = [[] for _ in range(stages)]
    while True:
        ready: list[tuple[int, bool, int]] = []
        for j in range(stages):
            for k in range(micro):
                if not f_done[j][k] and (j == 0 or f_done[j - 1][k]):
                    ready.append((j, False, k))
                elif (
                    f_done[j][k]
                    and not b_done[j][k]
                    and (b_done[j + 1][k] if j + 1 < stages else True)
                ):
                    ready.append((j, True, k))
        if not ready:
            return orders
        j, is_bwd, k = rng.choice(ready)
        (b_done if is_bwd else f_done)[j][k] = True
        orders[j].append(("B" if is_bwd else "F") + str(k))


def _draw_cuts(rng: random.Random, num_layers: int, count: int,
               prefer: set[int] | None) -> list[int]:
    preferred = sorted(prefer or ())
    rng.shuffle(preferred)
    cuts = preferred[:count]
    others = [c for c in range(1, num_layers) if c not in cuts]
    cuts += rng.sample(others, count - len(cuts))
    if prefer is not None:
        prefer.difference_update(cuts)
    return sorted(cuts)


def _draw_spans(rng: random.Random, devices: int, degrees: Sequence[int]) -> list[int]:
    """How many devices each stage of a group of ``devices`` takes (1, or one of
    ``degrees`` half the time); draws nothing from ``rng`` without ``degrees``."""
    spans: list[int] = []
    left = devices
    while left:
        fits = [d for d in degrees if 1 < d <= left]
        t = rng.choice(fits) if fits and rng.random() < 0.5 else 1
        spans.append(t)
        left -= t
    return spans


def random_plan(
    rng: random.Random,
    device_ids: Sequence[str],
    num_layers: int,
    global_batch: int,
    microbatch_size: int,
    schedule: str,
    *,
    groups: int | None = None,
    leave_idle: bool = False,
    prefer_cuts: set[int] | None = None,
    recompute_p: float = 0.3,
    tp_degrees: Sequence[int] = (),
) -> Plan:
    """A random valid plan: ``groups`` groups (random if None), uneven samples, random cuts
    and recompute (each stage with probability ``recompute_p``); with ``leave_idle`` one
    device is left out. Cuts are drawn from ``prefer_cuts`` first (boundaries not yet tried;
    each one drawn is removed from the set). With ``tp_degrees``, stages are
    tensor-parallel of one of those degrees at random, and at least one stage is (of the
    largest degree a group has room for), when any group has two devices."""
    devices = list(device_ids)
    rng.shuffle(devices)
    if leave_idle and len(devices) > 1:
        devices = devices[:-1]
    micro_total = global_batch // microbatch_size
    top = min(len(devices), micro_total)
    k = rng.randint(1, top) if groups is None else max(1, min(groups, top))
    # devices -> groups (each non-empty, at most num_layers stages)
    sizes = [1] * k
    for _ in range(len(devices) - k):
        options = [i for i in range(k) if sizes[i] < num_layers]
        if not options:
            break
        sizes[rng.choice(options)] += 1
    # microbatches -> groups, uneven, each at least one
    counts = [1] * k
    for _ in range(micro_total - k):
        counts[rng.randrange(k)] += 1
    made = []
    pos = 0
    spans = [_draw_spans(rng, sizes[g], tp_degrees) for g in range(k)]
    if tp_degrees and not any(t > 1 for sp in spans for t in sp):
        g = max(range(k), key=lambda i: sizes[i])
        fits = [d for d in tp_degrees if 1 < d <= sizes[g]]
        if fits:
            top = max(fits)
            spans[g] = [top, *([1] * (sizes[g] - top))]
    for g in range(k):
        group_devices = devices[pos : pos + sizes[g]]
        pos += sizes[g]
        stage_devices: list[tuple[str, ...]] = []
        at = 0
        for t in spans[g]:
            stage_devices.append(tuple(group_devices[at : at + t]))
            at += t
        cuts = _draw_cuts(rng, num_layers, len(stage_devices) - 1, prefer_cuts)
        bounds = [0, *cuts, num_layers]
        orders: list[tuple[str, ...] | None] = (
            [tuple(o) for o in _random_custom_orders(rng, len(stage_devices), counts[g])]
            if schedule == "custom"
            else [None] * len(stage_devices)
        )
        stages = tuple(
            Stage(
                device=d[0],
                devices=d,
                layers=(bounds[j], bounds[j + 1]),
                recompute=rng.random() < recompute_p,
                order=orders[j],
            )
            for j, d in enumerate(stage_devices)
        )
        made.append(Group(samples=counts[g] * microbatch_size, stages=stages))
    return Plan(microbatch_size=microbatch_size, schedule=schedule, groups=tuple(made))


def plan_json(plan: Plan, version: int | None = None) -> dict[str, Any]:
    data = plan_to_dict(plan)
    if version is not None:
        data["version"] = version
    return data

