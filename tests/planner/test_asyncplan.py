"""The staleness-aware objective: time to accuracy = steps(mean staleness) x time per step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hetpilot.planner.asyncplan import choose_by_time_to_accuracy, cut_points, mean_staleness
from hetpilot.planner.refmodel import evaluate, group_makespan, group_op_times
from hetpilot.planner.types import Cluster, Device, Job, Layer, Model, Network

MODEL = Model(name="m", layers=tuple(
    Layer(name=f"l{i}", fwd_gflop=10.0, bwd_gflop=20.0, out_mb=0.01, act_mb=0.01, param_mb=1.0)
    for i in range(8)))
CLUSTER = Cluster(
    devices=tuple(Device(id=f"d{i}", host="h", tflops=tf, memory_gb=16.0)
                  for i, tf in enumerate((100.0, 100.0, 50.0, 50.0))),
    network=Network(intra_host_gbps=100.0, inter_host_gbps=100.0, latency_us=5.0))
JOB = Job(global_batch=64, microbatch_size=8, schedules=("1f1b",))


@dataclass(frozen=True)
class Linear:
    I0: float
    alpha: float

    def iterations(self, staleness: float) -> float:
        return self.I0 * (1.0 + self.alpha * staleness)


def test_no_cost_of_staleness_takes_the_fastest_pipeline() -> None:
    choices = choose_by_time_to_accuracy(CLUSTER, MODEL, JOB, Linear(100, 0.0))
    best = choices[0]
    assert best.asynchronous and best.stages == 4
    assert [c.tta_s for c in choices] == sorted(c.tta_s for c in choices)
    asyncs = {c.stages: c for c in choices if c.asynchronous}
    assert set(asyncs) == {1, 2, 3, 4}
    assert asyncs[4].per_microbatch_s < asyncs[1].per_microbatch_s


def test_steep_staleness_cost_prefers_fewer_stages_or_sync() -> None:
    best = choose_by_time_to_accuracy(CLUSTER, MODEL, JOB, Linear(100, 5.0))[0]
    assert not best.asynchronous or best.stages == 1
    only_async = choose_by_time_to_accuracy(CLUSTER, MODEL, JOB, Linear(100, 5.0), synchronous=False)
    # 4 stages: 1.5 mean staleness costs 8.5x the steps, far more than the pipeline saves
    assert only_async[0].stages < 4
    for c in only_async:
        assert c.tta_s == pytest.approx(100 * (1 + 5.0 * mean_staleness(c.stages)) * c.per_microbatch_s)


def test_async_period_is_the_steady_state_spacing_of_the_reference_model() -> None:
    for c in choose_by_time_to_accuracy(CLUSTER, MODEL, JOB, Linear(1, 0), synchronous=False):
        group = c.plan.groups[0]
        assert cut_points(c.plan)[-1] == 8 and len(group.stages) == c.stages
        assert evaluate(CLUSTER, MODEL, c.plan, JOB.global_batch).valid
        times = group_op_times(CLUSTER, MODEL, group, JOB.microbatch_size)
        m = JOB.microbatches
        later = (group_makespan(times, "1f1b", 4 * m) - group_makespan(times, "1f1b", 3 * m)) / m
        assert c.per_microbatch_s == pytest.approx(later, rel=1e-9)


def test_sync_candidates_cost_iteration_time_per_microbatch() -> None:
    sync = [c for c in choose_by_time_to_accuracy(CLUSTER, MODEL, JOB, Linear(10, 1.0))
            if not c.asynchronous]
    assert sync
    for c in sync:
        it = evaluate(CLUSTER, MODEL, c.plan, JOB.global_batch).iteration_s
        assert it is not None
        assert c.tta_s == pytest.approx(10 * it / JOB.microbatches, rel=0.02)
