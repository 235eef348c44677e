"""The reference iteration-time model of spec v1 section 5, and plan validation.

This is what every plan is judged by, so it follows the spec literally:

* 5.1 op and transfer times per stage;
* 5.2 an event simulation of each group's pipeline in which every stage runs
  its ops one at a time in its order and each direction of each stage
  boundary is a FIFO channel (transfers queue in the order their ops end on
  the sending stage, which is that stage's op order);
* 5.3 bucketed ring all-reduce across groups;
* 5.4 memory, with and without recompute;
* 5.5 cost rates and the ideal bound.

Group makespans are memoised on their numeric inputs, so evaluating a plan
whose groups repeat (one pipeline per identical host, say) simulates each
distinct group once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from . import memos
from .errors import DeadlockError, InvalidPlanError
from .schedules import Op, custom_order, inflight, order
from .sync_readings import sync_readings
from .tpmodel import boundary_s, ring, stage_memory_mb, stage_op_s
from .types import SCHEDULES, Cluster, Device, Group, Model, Plan, Stage

__all__ = [
    "Evaluation",
    "GroupTimes",
    "builtin_makespan_1f1b",
    "builtin_makespan_gpipe",
    "evaluate",
    "group_makespan",
    "group_op_times",
    "ideal_time",
    "pipeline_makespan",
    "stage_memory_mb",
    "sync_time",
    "sync_time_literal",
    "validate_plan",
]


@dataclass(frozen=True)
class GroupTimes:
    """Per-stage forward, backward and boundary-transfer seconds of one microbatch."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    comm: tuple[float, ...]  # comm[j] between stage j and j+1; len S-1


@dataclass(frozen=True)
class Evaluation:
    """What ``hetpilot evaluate`` prints (spec section 7)."""

    valid: bool
    error: str | None
    iteration_s: float | None = None
    sync_s: float | None = None
    makespans: tuple[float, ...] = ()
    microbatches: tuple[int, ...] = ()
    efficiency: float | None = None
    ideal_s: float | None = None
    price_per_hour: float | None = None
    power_watts: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "valid": self.valid,
            "error": self.error,
            "iteration_s": self.iteration_s,
            "sync_s": self.sync_s,
            "groups": [
                {"makespan_s": p, "microbatches": m}
                for p, m in zip(self.makespans, self.microbatches, strict=True)
            ],
            "efficiency": self.efficiency,
            "ideal_s": self.ideal_s,
            "price_per_hour": self.price_per_hour,
            "power_watts": self.power_watts,
        }


# -- 5.1 ---------------------------------------------------------------------

def group_op_times(cluster: Cluster, model: Model, group: Group, micro: int) -> GroupTimes:
    """F_j, B_j and C_j of one microbatch (spec 5.1; tensor-parallel stages by 5.6)."""
    fwd, bwd, comm = [], [], []
    stages = group.stages
    for j, stage in enumerate(stages):
        f, bk = stage_op_s(cluster, model, stage, micro)
        fwd.append(f)
        bwd.append(bk)
        if j + 1 < len(stages):
            comm.append(boundary_s(cluster, model, stage, stages[j + 1], micro))
    return GroupTimes(tuple(fwd), tuple(bwd), tuple(comm))


# -- 5.2 ---------------------------------------------------------------------

def pipeline_makespan(
    fwd: Sequence[float],
    bwd: Sequence[float],
    comm: Sequence[float],
    orders: Sequence[Sequence[Op]],
) -> float:
    """Event simulation of one group; raises DeadlockError if it cannot finish.

    Each stage advances through its order as far as its dependencies allow;
    a stage that produced a transfer wakes its neighbour. Times are >= 0, so
    -1.0 marks "not yet known". Every op is visited once: O(S * M).
    """
    n = len(fwd)
    m = len(orders[0]) // 2
    unknown = -1.0
    f_end = [[unknown] * m for _ in range(n)]
    f_arrive = [[unknown] * m for _ in range(n)]
    b_arrive = [[unknown] * m for _ in range(n)]
    fwd_chan = [0.0] * n  # channel j -> j+1 free at
    bwd_chan = [0.0] * n  # channel j+1 -> j free at (indexed by j)
    clock = [0.0] * n
    pos = [0] * n
    queued = [True] * n
    work = list(range(n - 1, -1, -1))
    last = n - 1
    while work:
        j = work.pop()
        queued[j] = False
        ops = orders[j]
        n_ops = len(ops)
        p = pos[j]
        t = clock[j]
        f_dur, b_dur = fwd[j], bwd[j]
        my_f_end, my_f_arrive, my_b_arrive = f_end[j], f_arrive[j], b_arrive[j]
        woke_up = woke_down = False
        while p < n_ops:
            is_bwd, k = ops[p]
            if not is_bwd:
                ready = 0.0 if j == 0 else my_f_arrive[k]
                if ready < 0.0:
                    break
                t = (ready if ready > t else t) + f_dur
                my_f_end[k] = t
                if j != last:
                    chan = fwd_chan[j]
                    arrive = (t if t > chan else chan) + comm[j]
                    fwd_chan[j] = arrive
                    f_arrive[j + 1][k] = arrive
                    woke_down = True
            else:
                ready = my_f_end[k] if j == last else my_b_arrive[k]
                if ready < 0.0:
                    break
                t = (ready if ready > t else t) + b_dur
                if j:
                    chan = bwd_chan[j - 1]
                    arrive = (t if t > chan else chan) + comm[j - 1]
                    bwd_chan[j - 1] = arrive
                    b_arrive[j - 1][k] = arrive
                    woke_up = True
            p += 1
        pos[j] = p
        clock[j] = t
        if woke_down and not queued[j + 1]:
            queued[j + 1] = True
            work.append(j + 1)
        if woke_up and not queued[j - 1]:
            queued[j - 1] = True
            work.append(j - 1)
    stuck = [j for j in range(n) if pos[j] < len(orders[j])]
    if stuck:
        j = stuck[0]
        is_bwd, k = orders[j][pos[j]]
        raise DeadlockError(
            f"stages[{j}].order", f"deadlocks: {'B' if is_bwd else 'F'}{k} can never start"
        )
    return max(clock)


@lru_cache(maxsize=65536)
def _cached_makespan(
    fwd: tuple[float, ...],
    bwd: tuple[float, ...],
    comm: tuple[float, ...],
    schedule: str,
    microbatches: int,
) -> float:
    if schedule == "1f1b":
        return builtin_makespan_1f1b(fwd, bwd, comm, microbatches)
    if schedule == "gpipe":
        return builtin_makespan_gpipe(fwd, bwd, comm, microbatches)
    n = len(fwd)
    orders = [order(schedule, n, j, microbatches) for j in range(n)]
    return pipeline_makespan(fwd, bwd, comm, orders)


# The built-in schedules' simulations, visiting ops in an order fixed in advance.
#
# :func:`pipeline_makespan` finds, with a work list, an op whose inputs are known
# and computes its end as ``max(ready, stage clock) + duration`` and each transfer's
# arrival as ``max(end, channel free) + comm``. Those values do not depend on the
# order in which ops are visited, only on each op being visited after the ops it
# reads (the previous op of its stage, the op that sent its input, the previous
# transfer on its channel). For gpipe and 1f1b such an order is known in advance,
# so the two functions below skip the work list, the readiness tests and the op
# orders, and compute every op with the same operands and the same float
# operations: the same makespan, bit for bit (tests/planner/test_refmodel.py checks
# them against pipeline_makespan). Still O(S * M) steps, about 3x fewer of them.

def builtin_makespan_1f1b(fwd: Sequence[float], bwd: Sequence[float], comm: Sequence[float],
                          microbatches: int) -> float:
    """:func:`pipeline_makespan` under 1f1b, the same float.

    Stage j's order is ``w_j = min(S - 1 - j, M)`` warm-up forwards, then
    (F(w_j + i), B(i)) for i < M - w_j, then B(M - w_j) .. B(M - 1). Visited:
    first each stage's forwards up to and including its first pair's
    (``min(S - j, M)`` of them), stage 0 first; then rounds r = 0 .. M - 1, each
    over the stages last to first, stage j running B(r) (it needs stage j + 1's
    B(r), just visited, or on the last stage its own F(r)) and then, if its order
    has one, F(w_j + r + 1) (stage j - 1 ran it in round r - 1, or in the
    warm-up). Each stage's ops, and so each channel's transfers, keep their order.
    """
    n = len(fwd)
    m = microbatches
    if m <= 0:
        return 0.0
    last = n - 1
    f_arrive = [[0.0] * m for _ in range(n)]  # f_arrive[j][k]: F(k)'s input at stage j
    last_f_end = [0.0] * m
    clock = [0.0] * n
    fwd_chan = [0.0] * n  # channel j -> j + 1 free at
    bwd_chan = [0.0] * n  # channel j + 1 -> j free at (indexed by j)
    warm = [min(last - j, m) for j in range(n)]
    for j in range(n):
        f_dur, t, chan = fwd[j], 0.0, 0.0
        mine = f_arrive[j]
        nxt = f_arrive[j + 1] if j != last else last_f_end
        c = comm[j] if j != last else 0.0
        for k in range(min(n - j, m)):
            ready = mine[k] if j else 0.0
            t = (ready if ready > t else t) + f_dur
            if j != last:
                arrive = (t if t > chan else chan) + c
                chan = arrive
                nxt[k] = arrive
            else:
                nxt[k] = t
        clock[j] = t
        fwd_chan[j] = chan
    for r in range(m):
        ready = last_f_end[r]  # B(r) of the last stage needs its own F(r)
        for j in range(last, -1, -1):
            t = clock[j]
            t = (ready if ready > t else t) + bwd[j]
            if j:
                chan = bwd_chan[j - 1]
                ready = (t if t > chan else chan) + comm[j - 1]  # B(r)'s input at stage j - 1
                bwd_chan[j - 1] = ready
            k = warm[j] + r + 1
            if k < m:
                f_ready = f_arrive[j][k] if j else 0.0
                t = (f_ready if f_ready > t else t) + fwd[j]
                if j != last:
                    chan = fwd_chan[j]
                    arrive = (t if t > chan else chan) + comm[j]
                    fwd_chan[j] = arrive
                    f_arrive[j + 1][k] = arrive
                else:
                    last_f_end[k] = t
            clock[j] = t
    return max(clock)


def builtin_makespan_gpipe(fwd: Sequence[float], bwd: Sequence[float], comm: Sequence[float],
                           microbatches: int) -> float:
    """:func:`pipeline_makespan` under gpipe, the same float: every stage's forwards,
    stage 0 first, then every stage's backwards, the last stage first."""
    n = len(fwd)
    m = microbatches
    if m <= 0:
        return 0.0
    last = n - 1
    ready_at = [0.0] * m  # inputs of the stage being visited
    clock = [0.0] * n
    for j in range(n):
        f_dur, t, chan = fwd[j], 0.0, 0.0
        c = comm[j] if j != last else 0.0
        out = [0.0] * m
        for k in range(m):
            ready = ready_at[k]
            t = (ready if ready > t else t) + f_dur
            if j != last:
                arrive = (t if t > chan else chan) + c
                chan = arrive
                out[k] = arrive
            else:
                out[k] = t  # the last stage's backwards start from its own forwards
        clock[j] = t
        ready_at = out
    for j in range(last, -1, -1):
        b_dur, t, chan = bwd[j], clock[j], 0.0
        c = comm[j - 1] if j else 0.0
        out = [0.0] * m
        for k in range(m):
            ready = ready_at[k]
            t = (ready if ready > t else t) + b_dur
            if j:
                arrive = (t if t > chan else chan) + c
                chan = arrive
                out[k] = arrive
        clock[j] = t
        ready_at = out
    return max(clock)


def group_makespan(times: GroupTimes, schedule: str, microbatches: int,
                   orders: Sequence[Sequence[Op]] | None = None) -> float:
    """Makespan of a group under a built-in schedule, or under explicit ``orders``."""
    if orders is not None:
        return pipeline_makespan(times.fwd, times.bwd, times.comm, orders)
    return _cached_makespan(times.fwd, times.bwd, times.comm, schedule, microbatches)


# -- 5.3 ---------------------------------------------------------------------

def _owners(model: Model, group: Group) -> list[tuple[tuple[str, ...], int]]:
    """Per layer, the devices of the stage holding it and how many ways it is split."""
    out: list[tuple[tuple[str, ...], int]] = []
    layers = model.layers
    for stage in group.stages:
        t = stage.tp
        for i in range(stage.layers[0], stage.layers[1]):
            out.append((stage.devices, t if t > 1 and layers[i].splits(t) else 1))
    return out


_LAST_SYNC: tuple[Cluster, Model, Sequence[Group], tuple[float, float]] | None = None
"""The last valid plan :func:`evaluate` judged, with both readings of its sync: the
TP search asks for the shared-uplinks reading of that plan next."""


def sync_time(cluster: Cluster, model: Model, groups: Sequence[Group], *,
              shared_uplinks: bool = False) -> float:
    """Largest per-device sum of bucketed ring all-reduce times (spec 5.3, 5.6).

    Of a valid plan's groups (distinct devices, each group's stages covering the
    layers in order) both readings come from :func:`~.sync_readings.sync_readings`,
    the same floats as :func:`sync_time_literal` with fewer steps; other groups get
    the literal reading.
    """
    last = _LAST_SYNC
    if last is not None and last[0] is cluster and last[1] is model and last[2] is groups:
        readings = last[3]
    elif _tiles(model, groups):
        readings = sync_readings(cluster, model, groups)
    else:
        return sync_time_literal(cluster, model, groups, shared_uplinks=shared_uplinks)
    return readings[1] if shared_uplinks else readings[0]


def _tiles(model: Model, groups: Sequence[Group]) -> bool:
    """Whether every device is used once and each group's stages cover the layers in
    order: what :func:`~.sync_readings.sync_readings` assumes of a plan."""
    used: set[str] = set()
    count = 0
    for g in groups:
        expect = 0
        for s in g.stages:
            a, b = s.layers
            if a != expect or b <= a:
                return False
            expect = b
            used.update(s.devices)
            count += len(s.devices)
        if expect != model.num_layers:
            return False
    return len(used) == count


def sync_time_literal(cluster: Cluster, model: Model, groups: Sequence[Group], *,
                      shared_uplinks: bool = False) -> float:
    """Largest per-device sum of bucketed ring all-reduce times (spec 5.3, 5.6), read
    literally: what :func:`sync_time` answers, for any groups.

    A layer's owner in a group is its stage's devices and its split degree
    there. With split degrees s_g the layer is all-reduced as s = min s_g
    rings at once, each over 1/s of its bytes; ring i passes through device
    ``i * t_g // s`` of each group's stage (t_g its degree), and every device
    of a stage waits for the ring its index falls in (``r * s // t_g``). With
    one device per stage this is spec 5.3 exactly.

    ``shared_uplinks`` (not spec 5; the TP search's robust reading): the s
    rings of a split bucket each carry all its bytes, as if they shared one
    link per host, so splitting a layer does not shrink its sync. Sailor's
    simulator times its sync across pipelines this way.
    """
    k = len(groups)
    if k <= 1:
        return 0.0
    owners_per_group = [_owners(model, g) for g in groups]
    per_device: dict[str, float] = {}
    ring_cache: dict[tuple[str, ...], tuple[float, float]] = {}
    num_layers = model.num_layers
    factor = 2.0 * (k - 1) / k
    lat_hops = 2.0 * (k - 1)
    layer = 0
    while layer < num_layers:
        owners = tuple(o[layer] for o in owners_per_group)
        size = 0.0
        end = layer
        while end < num_layers and all(o[end] == owners[i] for i, o in enumerate(owners_per_group)):
            size += model.layers[end].param_mb
            end += 1
        rings = min(split for _, split in owners)
        if rings > 1 and not shared_uplinks:
            size /= rings
        times = []
        for r in range(rings):
            members = tuple(devs[r * len(devs) // rings] for devs, _ in owners)
            found = ring_cache.get(members)
            if found is None:
                found = ring_cache[members] = ring(cluster, members)
            times.append(factor * size * 8.0 / (1000.0 * found[0]) + lat_hops * found[1])
        for devs, _ in owners:
            n = len(devs)
            for r, dev in enumerate(devs):
                per_device[dev] = per_device.get(dev, 0.0) + times[r * rings // n]
        layer = end
    return max(per_device.values())


# -- 5.4 ---------------------------------------------------------------------

# -- 5.5 ---------------------------------------------------------------------

def ideal_time(cluster: Cluster, model: Model, global_batch: int) -> float:
    return global_batch * model.total_gflop / (1000.0 * cluster.total_tflops)


# -- validation and evaluation ------------------------------------------------

def _stage_orders(plan: Plan, gi: int, microbatches: int) -> list[tuple[Op, ...]] | None:
    """Parsed custom orders of a group; None for the built-in schedules."""
    group = plan.groups[gi]
    if plan.schedule != "custom":
        return None
    orders = []
    for j, stage in enumerate(group.stages):
        field = f"plan.groups[{gi}].stages[{j}].order"
        if stage.order is None:
            raise InvalidPlanError(field, 'is required with schedule "custom"')
        orders.append(custom_order(stage.order, microbatches, field))
    return orders


def _in_flight(schedule: str, n: int, j: int, m: int,
               orders: list[tuple[Op, ...]] | None) -> int:
    """Spec 5.4: M for gpipe, min(S - j, M) for 1f1b, the order's peak for custom."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(n - j, m)
    assert orders is not None
    return inflight(orders[j])


def _check_stage_devices(by_id: Mapping[str, Device], stage: Stage, sp: str,
                         used: dict[str, tuple[int, int]], where: tuple[int, int]) -> None:
    """Rule 2 of spec 4 for each of the stage's devices, and 5.6's one host."""
    tp = stage.tp > 1
    for i, dev in enumerate(stage.devices):
        field = f"{sp}.devices[{i}]" if tp else f"{sp}.device"
        if dev not in by_id:
            raise InvalidPlanError(field, f"unknown device {dev!r}")
        if dev in used:
            ug, us = used[dev]
            raise InvalidPlanError(
                field, f"{dev!r} is already used at plan.groups[{ug}].stages[{us}]")
        used[dev] = where
        host = by_id[stage.devices[0]].host
        if by_id[dev].host != host:
            raise InvalidPlanError(
                field, f"{dev!r} is on host {by_id[dev].host!r}, devices[0] on {host!r}:"
                       " a tensor-parallel stage lies within one host")


_NEEDS: memos.PerModel[tuple[int, int, bool, int, int], float] = memos.PerModel()


def memory_needs(model: Model, micro: int) -> dict[tuple[int, int, bool, int, int], float]:
    """The shared memo of :func:`stage_memory_mb` for one (model, microbatch size), keyed
    (first layer, end layer, recompute, in-flight count, degree)."""
    return _NEEDS.table(model, micro)


def validate_plan(
    cluster: Cluster, model: Model, plan: Plan, global_batch: int | None = None
) -> list[list[tuple[Op, ...]] | None]:
    """Check every rule of spec section 4; return each group's custom orders.

    Raises InvalidPlanError naming the first field that breaks a rule.
    Deadlocks of custom orders are found by :func:`evaluate`.
    """
    num_layers = model.num_layers
    micro = plan.microbatch_size
    schedule = plan.schedule
    if schedule not in SCHEDULES:
        raise InvalidPlanError("plan.schedule", f"must be one of {', '.join(SCHEDULES)}")
    by_id = cluster.by_id
    used: dict[str, tuple[int, int]] = {}  # device -> (group, stage) that uses it
    needs = memory_needs(model, micro)  # stage memory, by its inputs
    all_orders = []
    for gi, group in enumerate(plan.groups):
        if group.samples <= 0 or group.samples % micro:
            raise InvalidPlanError(
                f"plan.groups[{gi}].samples",
                f"must be a positive multiple of microbatch_size {micro}, got {group.samples}",
            )
        stages = group.stages
        if not stages:
            raise InvalidPlanError(f"plan.groups[{gi}].stages", "must not be empty")
        expect = 0
        for si, stage in enumerate(stages):
            devices = stage.devices
            if len(devices) == 1:  # _check_stage_devices, inlined for the common case
                dev = devices[0]
                if dev not in by_id or dev in used:
                    _check_stage_devices(by_id, stage, f"plan.groups[{gi}].stages[{si}]", used,
                                         (gi, si))
                used[dev] = (gi, si)
            else:
                _check_stage_devices(by_id, stage, f"plan.groups[{gi}].stages[{si}]", used,
                                     (gi, si))
            a, b = stage.layers
            if a != expect or b <= a or b > num_layers:
                sp = f"plan.groups[{gi}].stages[{si}]"
                if a != expect:
                    raise InvalidPlanError(
                        f"{sp}.layers", f"must start at layer {expect}, got [{a}, {b})"
                    )
                if b <= a:
                    raise InvalidPlanError(f"{sp}.layers", f"must be non-empty, got [{a}, {b})")
                raise InvalidPlanError(
                    f"{sp}.layers", f"ends past the model's {num_layers} layers, got [{a}, {b})"
                )
            expect = b
        if expect != num_layers:
            raise InvalidPlanError(
                f"plan.groups[{gi}].stages", f"cover layers [0, {expect}), not all {num_layers}"
            )
        m = group.samples // micro
        orders = _stage_orders(plan, gi, m)
        n = len(stages)
        for si, stage in enumerate(stages):
            if schedule == "1f1b":
                flight = n - si if n - si < m else m
            elif schedule == "gpipe":
                flight = m
            else:
                flight = _in_flight(schedule, n, si, m, orders)
            a, b = stage.layers
            devices = stage.devices
            t = len(devices)
            key = (a, b, stage.recompute, flight, t)
            need = needs.get(key)
            if need is None:
                need = needs[key] = stage_memory_mb(model, stage, micro, flight)
            smallest = devices[0] if t == 1 else min(devices, key=lambda d: by_id[d].memory_gb)
            have = 1000.0 * by_id[smallest].memory_gb
            if need > have:
                raise InvalidPlanError(
                    f"plan.groups[{gi}].stages[{si}]",
                    f"needs {need:.1f} MB on {smallest!r}, which has {have:.1f} MB"
                    f" (stage {si} of {n}, {flight} microbatches in flight"
                    + (f", split {t} ways)" if t > 1 else ")"),
                )
        all_orders.append(orders)
    total = plan.global_batch
    if global_batch is not None and total != global_batch:
        raise InvalidPlanError(
            "plan.groups", f"samples sum to {total}, but the global batch is {global_batch}"
        )
    return all_orders


def evaluate(
    cluster: Cluster, model: Model, plan: Plan, global_batch: int | None = None
) -> Evaluation:
    """Judge a plan by spec section 5. Invalid plans give ``valid=False``."""
    try:
        all_orders = validate_plan(cluster, model, plan, global_batch)
        makespans = []
        micro = plan.microbatch_size
        for gi, (group, orders) in enumerate(zip(plan.groups, all_orders, strict=True)):
            times = group_op_times(cluster, model, group, micro)
            m = group.samples // micro
            try:
                if orders is not None:
                    makespans.append(group_makespan(times, plan.schedule, m, orders))
                else:
                    makespans.append(group_makespan(times, plan.schedule, m))
            except DeadlockError as exc:
                raise DeadlockError(f"plan.groups[{gi}].{exc.field}", exc.problem) from None
    except InvalidPlanError as exc:
        return Evaluation(valid=False, error=str(exc))
    global _LAST_SYNC
    readings = sync_readings(cluster, model, plan.groups)  # valid: the plan tiles
    _LAST_SYNC = (cluster, model, plan.groups, readings)
    sync = readings[0]
    iteration = max(makespans) + sync
    ideal = ideal_time(cluster, model, plan.global_batch if global_batch is None else global_batch)
    used = [cluster.by_id[d] for d in plan.devices]
    return Evaluation(
        valid=True,
        error=None,
        iteration_s=iteration,
        sync_s=sync,
        makespans=tuple(makespans),
        microbatches=tuple(g.samples // micro for g in plan.groups),
        efficiency=ideal / iteration,
        ideal_s=ideal,
        price_per_hour=sum(d.price_per_hour for d in used),
        power_watts=sum(d.power_watts for d in used),
    )
