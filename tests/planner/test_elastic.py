"""A fixed plan through failures: the groups that lost a device wait, the rest take the batch."""

from __future__ import annotations

from hetpilot.planner.elastic import surviving_plan
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.schedules import format_order, warmup_order
from hetpilot.planner.types import Cluster, Device, Group, Layer, Model, Network, Plan, Stage

MODEL = Model(name="m", layers=tuple(
    Layer(name=f"l{i}", fwd_gflop=10.0, bwd_gflop=20.0, out_mb=1.0, act_mb=1.0, param_mb=10.0)
    for i in range(4)))


def _cluster(ids: list[str], memory_gb: float = 80.0) -> Cluster:
    return Cluster(devices=tuple(Device(id=i, host=i.split(":")[0], tflops=100.0, memory_gb=memory_gb)
                                 for i in ids),
                   network=Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=5.0))


def _pipe(a: str, b: str, samples: int, order: bool = False) -> Group:
    m = samples // 4
    def stage(dev: str, j: int) -> Stage:
        return Stage(device=dev, layers=(2 * j, 2 * j + 2),
                     order=format_order(warmup_order(2 - j, m)) if order else None)
    return Group(samples=samples, stages=(stage(a, 0), stage(b, 1)))


ALL = ["a:0", "a:1", "b:0", "b:1", "c:0", "c:1"]
PLAN = Plan(microbatch_size=4, schedule="1f1b", groups=(
    _pipe("a:0", "a:1", 48), _pipe("b:0", "b:1", 32), _pipe("c:0", "c:1", 16)))


def test_nothing_down_returns_the_plan_itself() -> None:
    assert surviving_plan(PLAN, _cluster(ALL), MODEL, 96) is PLAN


def test_survivors_take_the_batch_in_proportion() -> None:
    up = _cluster([d for d in ALL if d != "b:1"])
    out = surviving_plan(PLAN, up, MODEL, 96)
    assert out is not None
    assert [g.stages for g in out.groups] == [PLAN.groups[0].stages, PLAN.groups[2].stages]
    assert [g.samples for g in out.groups] == [72, 24]  # 48:16 of 96, whole microbatches
    assert evaluate(up, MODEL, out, 96).valid


def test_largest_remainder_keeps_whole_microbatches_and_the_total() -> None:
    plan = Plan(microbatch_size=4, schedule="1f1b", groups=(
        _pipe("a:0", "a:1", 40), _pipe("b:0", "b:1", 28), _pipe("c:0", "c:1", 28)))
    out = surviving_plan(plan, _cluster(ALL[:4]), MODEL, 96)
    assert out is not None
    assert sum(g.samples for g in out.groups) == 96
    assert all(g.samples % 4 == 0 for g in out.groups)
    assert [g.samples for g in out.groups] == [56, 40]  # 14.12 -> 14, 9.88 -> 10 microbatches


def test_no_group_left_or_no_longer_fitting_is_none() -> None:
    assert surviving_plan(PLAN, _cluster(["a:0", "b:0", "c:0"]), MODEL, 96) is None
    gpipe = Plan(microbatch_size=4, schedule="gpipe", groups=PLAN.groups)
    # every microbatch in flight under gpipe: 24 x 4 x 2 MB more than 0.15 GB can hold
    tight = _cluster(["a:0", "a:1", "c:0", "c:1"], memory_gb=0.15)
    assert surviving_plan(gpipe, tight, MODEL, 96) is None


def test_custom_orders_are_rebuilt_for_the_new_count() -> None:
    plan = Plan(microbatch_size=4, schedule="custom", groups=(
        _pipe("a:0", "a:1", 48, order=True), _pipe("b:0", "b:1", 48, order=True)))
    up = _cluster(["a:0", "a:1"])
    out = surviving_plan(plan, up, MODEL, 96)
    assert out is not None and out.groups[0].samples == 96
    assert out.groups[0].stages[0].order == format_order(warmup_order(2, 24))
    assert evaluate(up, MODEL, out, 96).valid
