"""The reference model (spec section 5) against the spec example and hand-computed cases."""

from __future__ import annotations

import math

import pytest
from hetpilot.planner import serde
from hetpilot.planner.refmodel import (
    GroupTimes,
    evaluate,
    group_makespan,
    pipeline_makespan,
    stage_memory_mb,
    sync_time,
)
from hetpilot.planner.schedules import custom_order, inflight, order
from hetpilot.planner.types import Group, Plan, Stage

from .helpers import example, flat_cluster, spec_cluster, spec_model, uniform_model


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


def test_spec_example_reproduced_exactly() -> None:
    got = evaluate(spec_cluster(), spec_model(), serde.plan_from_dict(example("plan.json")))
    want = example("plan.evaluation.json")
    assert got.valid and got.error is None
    out = got.to_dict()
    for key in ("iteration_s", "sync_s", "efficiency", "ideal_s", "price_per_hour", "power_watts"):
        assert _close(out[key], want[key]), key
    assert len(out["groups"]) == len(want["groups"])
    for g, w in zip(out["groups"], want["groups"], strict=True):
        assert g["microbatches"] == w["microbatches"]
        assert _close(g["makespan_s"], w["makespan_s"])


def test_orders_follow_the_spec() -> None:
    assert order("gpipe", 2, 0, 2) == ((False, 0), (False, 1), (True, 0), (True, 1))
    # 1f1b with w = min(S - j - 1, M): stage 0 of 3 warms up two forwards
    assert order("1f1b", 3, 0, 3) == (
        (False, 0), (False, 1), (False, 2), (True, 0), (True, 1), (True, 2))
    assert order("1f1b", 3, 2, 3) == (
        (False, 0), (True, 0), (False, 1), (True, 1), (False, 2), (True, 2))
    assert [inflight(order("1f1b", 4, j, 10)) for j in range(4)] == [4, 3, 2, 1]
    assert inflight(order("gpipe", 4, 0, 10)) == 10


# Hand-computed pipelines: F = 1, B = 2 on both stages, transfer 0.5, M = 2.
#   gpipe  stage0: F0 0-1, F1 1-2; stage1: F0 1.5-2.5, F1 2.5-3.5, B0 3.5-5.5, B1 5.5-7.5;
#          grads arrive at stage0 at 6.0 and 8.0: B0 6-8, B1 8-10.
#   1f1b   stage1: F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5, B1 5.5-7.5; grads arrive 5.0, 8.0;
#          stage0: B0 5-7, B1 8-10.
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_by_hand(schedule: str) -> None:
    times = GroupTimes((1.0, 1.0), (2.0, 2.0), (0.5,))
    assert group_makespan(times, schedule, 2) == pytest.approx(10.0, abs=1e-12)


def test_fifo_channel_queues_transfers() -> None:
    # F = B = 1, transfer 3, M = 2, gpipe. F1's activation waits for F0's on the channel:
    # arrivals 4 and 7; stage1 F0 4-5, F1 7-8, B0 8-9, B1 9-10; gradients leave at 9 and 10
    # but queue: arrive 12 and 15; stage0 B0 12-13, B1 15-16.
    times = GroupTimes((1.0, 1.0), (1.0, 1.0), (3.0,))
    assert group_makespan(times, "gpipe", 2) == pytest.approx(16.0, abs=1e-12)


def test_single_stage_is_sum_of_ops() -> None:
    times = GroupTimes((0.25,), (0.5,), ())
    assert group_makespan(times, "1f1b", 7) == pytest.approx(7 * 0.75)


def test_deadlocking_custom_order_is_invalid() -> None:
    cluster = flat_cluster([10.0, 10.0])
    model = uniform_model(2)
    plan = Plan(microbatch_size=1, schedule="custom", groups=(Group(samples=2, stages=(
        Stage(device="d0", layers=(0, 1), order=("F0", "B0", "F1", "B1")),
        Stage(device="d1", layers=(1, 2), order=("F1", "F0", "B0", "B1")),
    )),))
    result = evaluate(cluster, model, plan)
    assert not result.valid
    assert "deadlock" in (result.error or "")
    assert (result.error or "").startswith("plan.groups[0].stages[")


def test_custom_order_equal_to_1f1b_scores_the_same() -> None:
    cluster = flat_cluster([10.0, 20.0, 5.0], latency_us=30.0)
    model = uniform_model(6)
    stages = ((0, 2), (2, 5), (5, 6))
    builtin = Plan(microbatch_size=2, schedule="1f1b", groups=(Group(samples=12, stages=tuple(
        Stage(device=f"d{j}", layers=r) for j, r in enumerate(stages))),))
    custom = Plan(microbatch_size=2, schedule="custom", groups=(Group(samples=12, stages=tuple(
        Stage(device=f"d{j}", layers=r,
              order=tuple(f"{'B' if b else 'F'}{k}" for b, k in order("1f1b", 3, j, 6)))
        for j, r in enumerate(stages))),))
    a, b = evaluate(cluster, model, builtin), evaluate(cluster, model, custom)
    assert a.valid and b.valid
    assert a.iteration_s == pytest.approx(b.iteration_s, rel=1e-12)


@pytest.mark.parametrize("ops,problem", [
    (("F0", "B1", "F1", "B0"), "B1 comes before F1"),
    (("F0", "F0", "B0", "B1"), "appears twice"),
    (("F0", "B0"), "misses F1"),
    (("F0", "B0", "F1", "B1", "F2"), "names microbatch 2"),
])
def test_custom_order_rules(ops: tuple[str, ...], problem: str) -> None:
    from hetpilot.planner.errors import InvalidPlanError

    with pytest.raises(InvalidPlanError, match=problem):
        custom_order(ops, 2, "order")


def test_sync_two_groups_by_hand() -> None:
    # one bucket of 2 layers x 10 MB over a ring of 2 devices on 100 Gbit/s, 5 us:
    # AR = 2(K-1)/K * 20 MB * 8 / (1000 * 100) + 2(K-1) * 5e-6
    cluster = flat_cluster([10.0, 10.0], inter=100.0, latency_us=5.0)
    model = uniform_model(2)
    groups = [Group(samples=1, stages=(Stage(device=f"d{i}", layers=(0, 2)),)) for i in range(2)]
    assert sync_time(cluster, model, groups) == pytest.approx(20 * 8 / 100_000 + 2 * 5e-6)


def test_sync_buckets_follow_owner_lists() -> None:
    # group0 cuts after layer 1, group1 after layer 2: buckets {0}, {1}, {2, 3}; device d0
    # owns layers 0-1 in group0 and takes part in buckets {0} and {1}.
    cluster = flat_cluster([10.0] * 4, inter=100.0, latency_us=0.0)
    model = uniform_model(4)
    groups = [
        Group(samples=1, stages=(Stage(device="d0", layers=(0, 2)), Stage(device="d1", layers=(2, 4)))),
        Group(samples=1, stages=(Stage(device="d2", layers=(0, 1)), Stage(device="d3", layers=(1, 4)))),
    ]
    per_mb = 8 / 100_000  # 2(K-1)/K = 1 for K = 2
    # d3 takes part in bucket {1} (10 MB) and bucket {2,3} (20 MB); d0 in {0} and {1}
    assert sync_time(cluster, model, groups) == pytest.approx(30 * per_mb)


def test_memory_with_and_without_recompute() -> None:
    model = uniform_model(3, act_mb=10.0, out_mb=2.0, param_mb=5.0, opt=3.0)
    plain = Stage(device="d0", layers=(0, 3))
    rec = Stage(device="d0", layers=(0, 3), recompute=True)
    # params 15 MB * (1 + 3) = 60; activations 4 in flight * m=2 * 30 MB
    assert stage_memory_mb(model, plain, 2, 4) == pytest.approx(60 + 4 * 2 * 30)
    # recompute keeps inputs of layers 1, 2 (out_mb of layers 0, 1; layer 0's input is 0)
    assert stage_memory_mb(model, rec, 2, 4) == pytest.approx(60 + 4 * 2 * 4 + 2 * 30)


def test_recompute_adds_forward_to_backward() -> None:
    cluster = flat_cluster([10.0])
    model = uniform_model(2, fwd=10.0)
    base = Plan(microbatch_size=1, schedule="1f1b", groups=(Group(samples=1, stages=(
        Stage(device="d0", layers=(0, 2)),)),))
    rec = Plan(microbatch_size=1, schedule="1f1b", groups=(Group(samples=1, stages=(
        Stage(device="d0", layers=(0, 2), recompute=True),)),))
    f = 20.0 / 10_000
    assert evaluate(cluster, model, base).iteration_s == pytest.approx(3 * f)
    assert evaluate(cluster, model, rec).iteration_s == pytest.approx(4 * f)


@pytest.mark.parametrize("mutate,field", [
    (lambda g: [Group(samples=g[0].samples, stages=(Stage(device="d0", layers=(0, 1)),
                                                      Stage(device="d1", layers=(2, 4))))],
     "plan.groups[0].stages[1].layers"),
    (lambda g: [g[0], Group(samples=4, stages=(Stage(device="d0", layers=(0, 4)),))],
     "plan.groups[1].stages[0].device"),
    (lambda g: [Group(samples=3, stages=g[0].stages)], "plan.groups[0].samples"),
    (lambda g: [Group(samples=4, stages=(Stage(device="zz", layers=(0, 4)),))],
     "plan.groups[0].stages[0].device"),
    (lambda g: [Group(samples=4, stages=(Stage(device="d0", layers=(0, 3)),))],
     "plan.groups[0].stages"),
])
def test_invalid_plans_name_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    cluster = flat_cluster([10.0, 10.0])
    model = uniform_model(4)
    good = (Group(samples=4, stages=(Stage(device="d0", layers=(0, 2)),
                                      Stage(device="d1", layers=(2, 4)))),)
    plan = Plan(microbatch_size=2, schedule="1f1b", groups=tuple(mutate(good)))
    result = evaluate(cluster, model, plan)
    assert not result.valid
    assert (result.error or "").startswith(field + ":"), result.error


def test_memory_limit_makes_a_plan_invalid() -> None:
    cluster = flat_cluster([10.0], memory_gb=0.1)  # 100 MB
    model = uniform_model(4, param_mb=10.0, opt=3.0, act_mb=10.0)  # params alone 160 MB
    plan = Plan(microbatch_size=1, schedule="1f1b", groups=(Group(samples=1, stages=(
        Stage(device="d0", layers=(0, 4)),)),))
    result = evaluate(cluster, model, plan)
    assert not result.valid and "needs" in (result.error or "")


def test_batch_mismatch_is_invalid() -> None:
    plan = serde.plan_from_dict(example("plan.json"))
    result = evaluate(spec_cluster(), spec_model(), plan, global_batch=128)
    assert not result.valid and "global batch is 128" in (result.error or "")


def test_large_plan_evaluates_quickly_enough_to_be_usable() -> None:
    """1024 devices in 128 identical 8-stage pipelines: groups are simulated once (memoised)."""
    from hetpilot.planner import catalog

    cluster = catalog.make_cluster([("A100", 8)] * 128)
    model = catalog.MODELS["llama-13b"]()
    bounds = [0, 6, 11, 16, 21, 26, 31, 36, 42]
    groups = tuple(Group(samples=4, stages=tuple(
        Stage(device=f"h{h}:{j}", layers=(bounds[j], bounds[j + 1]), recompute=True)
        for j in range(8))) for h in range(128))
    plan = Plan(microbatch_size=1, schedule="1f1b", groups=groups)
    result = evaluate(cluster, model, plan)
    assert result.valid, result.error
    assert len(set(result.makespans)) == 1
    assert result.sync_s is not None and result.sync_s > 0


def test_pipeline_makespan_reports_stuck_op() -> None:
    from hetpilot.planner.errors import DeadlockError

    orders = [((False, 0), (True, 0)), ((True, 0), (False, 0))]
    with pytest.raises(DeadlockError, match="B0 can never start"):
        pipeline_makespan((1.0, 1.0), (1.0, 1.0), (0.0,), orders)
