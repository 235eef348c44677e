"""The simple-layouts yardstick of bench/simple_layouts.py (bench/planner_profiles.py)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hetpilot.planner.bruteforce import brute_force
from hetpilot.planner.refmodel import evaluate, pipeline_makespan
from hetpilot.planner.schedules import order
from hetpilot.planner.types import Cluster, Device, Job, Layer, Model, Network

_PATH = Path(__file__).resolve().parents[2] / "bench" / "simple_layouts.py"
_spec = importlib.util.spec_from_file_location("simple_layouts", _PATH)
assert _spec is not None and _spec.loader is not None
simple_layouts = importlib.util.module_from_spec(_spec)
sys.modules["simple_layouts"] = simple_layouts
_spec.loader.exec_module(simple_layouts)


def _two_hosts(intra: float, inter: float, tflops: tuple[float, ...] = (1.0,) * 4) -> Cluster:
    devices = tuple(Device(id=f"h{i // 2}:{i % 2}", host=f"h{i // 2}", tflops=t, memory_gb=100.0)
                    for i, t in enumerate(tflops))
    return Cluster(devices=devices, network=Network(intra_host_gbps=intra, inter_host_gbps=inter,
                                                    latency_us=0.0))


def _two_heavy_halves() -> Model:
    """4 layers of 1 GFLOP forward, 2 backward, no activations to send; the first layer of
    each half holds 100 MB of parameters."""
    return Model(name="halves", optimizer_factor=1.0, layers=tuple(
        Layer(name=f"l{i}", fwd_gflop=1.0, bwd_gflop=2.0, out_mb=0.0, act_mb=1.0,
              param_mb=100.0 if i in (0, 2) else 0.0) for i in range(4)))


def test_finds_stage_major_layout_derived_by_hand() -> None:
    """Two hosts of two devices (1 TFLOP/s), 800 Gbit/s inside a host, 1 Gbit/s between,
    no latency; batch 8 in microbatches of 1 (M = 8).

    Stage-major, K = 2 pipelines of S = 2 stages cut at layer 2: stage 0 on h0:0 and h0:1,
    stage 1 on h1:0 and h1:1; each pipeline crosses hosts, but sends nothing (out_mb = 0).
    Each group runs M = 4: F = 2 ms, B = 4 ms per stage, no transfer time, so 1f1b takes
    (M + S - 1)(F + B) = 5 * 6 = 30 ms. Each stage's 100 MB are one bucket all-reduced by
    the two devices of one host: 2 (2 - 1) / 2 * 100 * 8 / (1000 * 800) s = 1 ms.
    T = 31 ms.

    The alternatives: group-major (each pipeline on one host) syncs across the 1 Gbit/s
    link, 100 * 8 / 1000 = 0.8 s; one 4-stage pipeline: (8 + 3) * 3 = 33 ms; a 2-stage
    pipeline on one host: (8 + 1) * 6 = 54 ms; two replicas on one host: 4 * 12 ms + 2 ms =
    50 ms; replicas across hosts: seconds of sync.
    """
    cluster = _two_hosts(800.0, 1.0)
    model = _two_heavy_halves()
    job = Job(global_batch=8, microbatch_size=1, schedules=("1f1b", "gpipe"))
    result = simple_layouts.search(cluster, model, job)
    assert result.plan is not None
    assert result.iteration_s == pytest.approx(0.031, rel=1e-12)
    ev = evaluate(cluster, model, result.plan, job.global_batch)
    assert ev.valid, ev.error
    assert ev.iteration_s == pytest.approx(result.iteration_s, rel=1e-12)
    assert ev.sync_s == pytest.approx(0.001, rel=1e-12)
    assert "stage-major" in result.label
    groups = [[s.device for s in g.stages] for g in result.plan.groups]
    assert groups == [["h0:0", "h1:0"], ["h0:1", "h1:1"]]
    assert [s.layers for s in result.plan.groups[0].stages] == [(0, 2), (2, 4)]
    assert result.per_layout["group-major"] == pytest.approx(0.030 + 0.8, rel=1e-12)
    assert result.per_layout["pipeline"] == pytest.approx(0.033, rel=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_vectorised_makespans_match_the_reference_simulation(schedule: str) -> None:
    r = random.Random(7)
    for _ in range(40):
        stages, micro, n = r.randint(1, 4), r.randint(1, 7), 5
        fwd = [np.array([r.uniform(0.1, 2) for _ in range(n)]) for _ in range(stages)]
        bwd = [np.array([r.uniform(0.1, 4) for _ in range(n)]) for _ in range(stages)]
        comm = [np.array([r.uniform(0, 3) for _ in range(n)]) for _ in range(stages - 1)]
        got = simple_layouts.makespans(fwd, bwd, comm, schedule, micro)
        orders = [order(schedule, stages, j, micro) for j in range(stages)]
        for c in range(n):
            want = pipeline_makespan([float(f[c]) for f in fwd], [float(b[c]) for b in bwd],
                                     [float(x[c]) for x in comm], orders)
            assert got[c] == pytest.approx(want, rel=1e-12)


def test_tiny_case_validates_and_is_no_better_than_brute_force() -> None:
    """Brute force searches a superset of the simple layouts."""
    r = random.Random(3)
    model = Model(name="tiny", optimizer_factor=3.0, layers=tuple(
        Layer(name=f"l{i}", fwd_gflop=r.uniform(1, 5), bwd_gflop=r.uniform(2, 10),
              out_mb=r.uniform(1, 20), act_mb=r.uniform(10, 100), param_mb=r.uniform(10, 300))
        for i in range(4)))
    cluster = _two_hosts(100.0, 5.0, tflops=(2.0, 2.0, 1.0, 1.0))
    job = Job(global_batch=12, microbatch_size=2, schedules=("1f1b", "gpipe"))
    result = simple_layouts.search(cluster, model, job)
    assert result.plan is not None
    ev = evaluate(cluster, model, result.plan, job.global_batch)
    assert ev.valid, ev.error
    assert ev.iteration_s == pytest.approx(result.iteration_s, rel=1e-12)
    best, _ = brute_force(cluster, model, job)
    assert best <= result.iteration_s * (1 + 1e-12)


def test_recompute_only_where_memory_needs_it() -> None:
    """One device that holds the model only with recompute (gpipe keeps both microbatches'
    800 MB of activations: 20 * 2 + 2 * 800 MB > 1 GB; with recompute 20 * 2 + 2 * 1 + 800 MB
    fits): the plan turns it on and each backward pays one more forward."""
    model = Model(name="big-acts", optimizer_factor=1.0, layers=tuple(
        Layer(name=f"l{i}", fwd_gflop=1.0, bwd_gflop=2.0, out_mb=1.0, act_mb=400.0,
              param_mb=10.0) for i in range(2)))
    cluster = Cluster(devices=(Device(id="a", host="a", tflops=1.0, memory_gb=1.0),),
                      network=Network(intra_host_gbps=100.0, inter_host_gbps=10.0,
                                      latency_us=0.0))
    job = Job(global_batch=2, microbatch_size=1, schedules=("gpipe",))
    result = simple_layouts.search(cluster, model, job)
    assert result.plan is not None
    assert result.plan.groups[0].stages[0].recompute
    # gpipe, 2 microbatches: F = 2 ms each, then B = 4 ms + 2 ms of recompute each
    assert result.iteration_s == pytest.approx(0.016, rel=1e-12)
