"""The planner's search over tensor-parallel degrees (planner/tpsearch.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hetpilot.planner.errors import InfeasibleError
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.search import make_plan
from hetpilot.planner.tpsearch import degrees, make_tp_plan, virtual_cluster
from hetpilot.planner.types import Cluster, Device, Job, Layer, Model, Network, Plan


def _cluster(intra_gbps: float, hosts: int = 1, per_host: int = 4) -> Cluster:
    return Cluster(
        devices=tuple(Device(id=f"h{h}:{i}", host=f"h{h}", tflops=10.0, memory_gb=16.0)
                      for h in range(hosts) for i in range(per_host)),
        network=Network(intra_host_gbps=intra_gbps, inter_host_gbps=10.0, latency_us=0.0))


def _model(tp_comm_mb: float | None, efficiency: float = 1.0) -> Model:
    eff = ((2, efficiency), (4, efficiency)) if efficiency != 1.0 else ()
    return Model(name="blocks", layers=tuple(
        Layer(name=f"b{i}", fwd_gflop=10.0, bwd_gflop=20.0, out_mb=1.0, act_mb=10.0,
              param_mb=10.0, tp_comm_mb=tp_comm_mb, tp_allreduces=2, tp_efficiency=eff)
        for i in range(4)))


def test_tp_wins_when_the_batch_is_too_small_for_data_parallelism() -> None:
    # one sample per iteration: no second group, and a pipeline of M = 1 runs its stages
    # one after another; only splitting the layers puts the four devices to work at once
    cluster, model = _cluster(2400.0), _model(0.5)
    job = Job(global_batch=1, microbatch_size=1, tensor_parallel=True)
    v1 = evaluate(cluster, model, make_plan(cluster, model, job), 1).iteration_s
    assert v1 == pytest.approx(4 * 30 / 10000)  # one device's 0.012 s: nothing beats it in v1
    plan = make_tp_plan(cluster, model, job, make_plan)
    got = evaluate(cluster, model, plan, 1)
    assert got.valid and got.iteration_s is not None
    assert max(s.tp for g in plan.groups for s in g.stages) == 4
    # 4-way split: 0.003 s of compute, plus 16 all-reduces of 0.5 MB on 2400 Gbit/s
    assert got.iteration_s == pytest.approx(0.003 + 16 * 1.5 * 0.5 * 8 / 2.4e6)
    assert plan.predicted_iteration_s == pytest.approx(got.iteration_s)


def test_tp_is_not_chosen_where_data_parallelism_is_better() -> None:
    # 64 samples keep four data-parallel replicas busy; splitting layers over a slow host
    # link at 70% efficiency only adds all-reduces
    cluster, model = _cluster(1.0), _model(5.0, efficiency=0.7)
    job = Job(global_batch=64, microbatch_size=4, tensor_parallel=True)
    plan = make_tp_plan(cluster, model, job, make_plan)
    assert not plan.tensor_parallel
    assert evaluate(cluster, model, plan, 64).iteration_s == pytest.approx(
        evaluate(cluster, model, make_plan(cluster, model, job), 64).iteration_s)


def test_no_tp_without_the_job_flag_or_splittable_layers() -> None:
    cluster = _cluster(2400.0)
    for model, flag in ((_model(0.5), False), (_model(None), True)):
        job = Job(global_batch=1, microbatch_size=1, tensor_parallel=flag)
        assert not make_tp_plan(cluster, model, job, make_plan).tensor_parallel


def test_degrees_follow_hosts_and_tp_max() -> None:
    cluster = _cluster(2400.0, hosts=2, per_host=8)
    assert degrees(cluster, _model(0.5)) == {(10.0, 16.0): [2, 4, 8]}
    capped = Model(name="m", layers=tuple(
        Layer(name="l", fwd_gflop=1.0, bwd_gflop=2.0, out_mb=1.0, act_mb=1.0, param_mb=1.0,
              tp_comm_mb=1.0, tp_max=2) for _ in range(2)))
    assert degrees(cluster, capped) == {(10.0, 16.0): [2]}
    assert degrees(cluster, _model(None)) == {}


def test_virtual_device_runs_the_model_as_the_group_does() -> None:
    cluster, model = _cluster(2400.0), _model(0.5)
    virtual = virtual_cluster(cluster, model, {(10.0, 16.0): 2}, 1)
    assert virtual.members == {"h0:0": ("h0:0", "h0:1"), "h0:2": ("h0:2", "h0:3")}
    # 2-way: 120 GFLOP / 2 at 10 TFLOP/s plus 16 all-reduces of 0.5 MB (factor 1 at t = 2)
    seconds = 0.006 + 16 * 0.5 * 8 / 2.4e6
    assert virtual.cluster.by_id["h0:0"].tflops == pytest.approx(120 / (1000 * seconds))
    assert virtual.cluster.by_id["h0:0"].memory_gb == pytest.approx(32.0)  # all split


def test_cli_plans_and_evaluates_a_tp_plan(tmp_path: Path) -> None:
    cluster = {"devices": [{"id": f"h:{i}", "host": "h", "tflops": 10.0, "memory_gb": 16.0}
                           for i in range(4)],
               "network": {"intra_host_gbps": 2400.0, "inter_host_gbps": 10.0}}
    model = {"layers": [{"fwd_gflop": 10.0, "out_mb": 1.0, "act_mb": 10.0, "param_mb": 10.0,
                         "tp_comm_mb": 0.5, "tp_allreduces": 2} for _ in range(4)]}
    paths = {}
    for name, data in (("cluster", cluster), ("model", model)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(data))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hetpilot", *args, "--cluster",
                               str(paths["cluster"]), "--model", str(paths["model"])],
                              capture_output=True, text=True, timeout=120, check=False)

    v1 = run("plan", "--batch", "1", "--microbatch", "1")
    assert v1.returncode == 0, v1.stderr
    assert all("device" in s for g in json.loads(v1.stdout)["groups"] for s in g["stages"])
    res = run("plan", "--batch", "1", "--microbatch", "1", "--tensor-parallel")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["groups"][0]["stages"][0]["devices"] == ["h:0", "h:1", "h:2", "h:3"]
    (tmp_path / "plan.json").write_text(res.stdout)
    ev = run("evaluate", "--plan", str(tmp_path / "plan.json"), "--batch", "1")
    assert ev.returncode == 0, ev.stderr
    out = json.loads(ev.stdout)
    assert out["valid"] and out["iteration_s"] == pytest.approx(plan["predicted"]["iteration_s"],
                                                                rel=1e-5)


def test_megatron_baseline_splits_inside_hosts() -> None:
    from hetpilot.planner.tpsearch import megatron_tp

    cluster, model = _cluster(2400.0, hosts=2), _model(0.5)
    job = Job(global_batch=8, microbatch_size=1, tensor_parallel=True)
    plan = megatron_tp(cluster, model, job)
    # a 4-way group per host, one data-parallel replica each, equal samples
    assert [[s.devices for s in g.stages] for g in plan.groups] == [
        [("h0:0", "h0:1", "h0:2", "h0:3")], [("h1:0", "h1:1", "h1:2", "h1:3")]]
    assert [g.samples for g in plan.groups] == [4, 4]
    got = evaluate(cluster, model, plan, 8)
    assert got.valid and plan.predicted_iteration_s == pytest.approx(got.iteration_s)


def test_controller_offers_tp_plans_only_to_jobs_that_run_them() -> None:
    from hetpilot.planner.controller import Controller

    cluster, model = _cluster(2400.0), _model(0.5)
    for flag in (True, False):
        job = Job(global_batch=1, microbatch_size=1, tensor_parallel=flag, V=10.0)
        decision = Controller(model, job).step(cluster)
        assert decision.plan is not None
        assert decision.plan.tensor_parallel is flag


def test_tp_makes_a_model_fit_that_fits_nowhere_else() -> None:
    # one layer of 1000 MB of parameters (4000 MB with Adam's state) on devices of 1.5 GB:
    # no device and no pipeline holds it, a 2-way split needs 2000 MB, a 4-way one 1000 MB
    cluster = Cluster(
        devices=tuple(Device(id=f"h:{i}", host="h", tflops=10.0, memory_gb=1.5) for i in range(4)),
        network=Network(intra_host_gbps=2400.0, inter_host_gbps=10.0, latency_us=0.0))
    model = Model(name="wide", layers=(Layer(name="l", fwd_gflop=10.0, bwd_gflop=20.0, out_mb=1.0,
                                             act_mb=10.0, param_mb=1000.0, tp_comm_mb=1.0),))
    job = Job(global_batch=4, microbatch_size=1, tensor_parallel=True)
    with pytest.raises(InfeasibleError):
        make_plan(cluster, model, job)
    plan = make_tp_plan(cluster, model, job)
    assert [s.tp for g in plan.groups for s in g.stages] == [4]
    assert evaluate(cluster, model, plan, 4).valid


def _two_kinds(fast_hosts: int, slow_hosts: int) -> Cluster:
    devs = [Device(id=f"f{h}:{i}", host=f"f{h}", tflops=20.0, memory_gb=40.0)
            for h in range(fast_hosts) for i in range(4)]
    devs += [Device(id=f"s{h}:{i}", host=f"s{h}", tflops=10.0, memory_gb=6.0)
             for h in range(slow_hosts) for i in range(4)]
    return Cluster(devices=tuple(devs), network=Network(intra_host_gbps=1000.0,
                                                        inter_host_gbps=25.0, latency_us=0.0))


def test_mixed_pipelines_of_tp_groups_steer_the_degree_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 128 devices of two kinds, 96 microbatches, 8 layers too big for a slow device's
    # memory alone. mixed_plans lays out pipelines of fast and slow 4-way groups; judged
    # with each degree choice they lead the descent to 4-way groups of both kinds, where
    # the full search's 8-stage pipelines halve the iteration time that the search
    # without them reaches
    from hetpilot.planner import tpsearch

    cluster = _two_kinds(8, 24)
    model = Model(name="m", layers=tuple(
        Layer(name=f"b{i}", fwd_gflop=100.0, bwd_gflop=200.0, out_mb=10.0, act_mb=200.0,
              param_mb=300.0, tp_comm_mb=2.0, tp_allreduces=2) for i in range(8)))
    job = Job(global_batch=96, microbatch_size=1, tensor_parallel=True)
    both = {(20.0, 40.0): 4, (10.0, 6.0): 4}
    mixed = tpsearch.mixed_plans(virtual_cluster(cluster, model, both, 1), model, job)
    assert any(len({s.device[0] for s in g.stages}) == 2  # a pipeline of fast and slow hosts
               for plan in mixed for g in plan.groups)
    plan = make_tp_plan(cluster, model, job)
    assert {s.tp for g in plan.groups for s in g.stages} == {4}
    got = evaluate(cluster, model, plan, 96)
    assert got.valid and got.iteration_s == pytest.approx(plan.predicted_iteration_s)
    monkeypatch.setattr(tpsearch, "MIXED_STAGES", ())  # the search without them
    without = make_tp_plan(cluster, model, job)
    assert got.iteration_s < 0.6 * evaluate(cluster, model, without, 96).iteration_s


def test_mixed_plans_need_two_kinds() -> None:
    from hetpilot.planner.tpsearch import mixed_plans

    cluster, model = _cluster(2400.0, hosts=2), _model(0.5)
    job = Job(global_batch=8, microbatch_size=1, tensor_parallel=True)
    assert mixed_plans(virtual_cluster(cluster, model, {(10.0, 16.0): 2}, 1), model, job) == []


def test_choice_of_least_regret_over_two_sync_readings() -> None:
    from hetpilot.planner.tpsearch import _choose, _Judged
    from hetpilot.planner.types import Plan

    plan = Plan(microbatch_size=1, schedule="1f1b", groups=())
    v1 = _Judged(3.0, 3.0, plan)  # no split layers: both readings agree
    lucky = _Judged(2.0, 3.6, plan)  # fastest by spec 5, all of its lead in the sync term
    steady = _Judged(2.2, 2.3, plan)  # 10% behind by spec 5, fastest with shared uplinks
    # regrets: lucky max(1, 3.6 / 2.3) = 1.57, steady max(1.1, 1) = 1.1, v1 1.5
    assert _choose([v1, lucky, steady]) is steady
    assert _choose([v1, lucky]) is lucky  # regrets: v1 1.5, lucky max(1, 3.6 / 3) = 1.2


def test_least_regret_is_never_slower_than_a_plan_without_split_layers() -> None:
    import random

    from hetpilot.planner.tpsearch import _choose, _Judged
    from hetpilot.planner.types import Plan

    plan = Plan(microbatch_size=1, schedule="1f1b", groups=())
    rng = random.Random(38)
    for _ in range(2000):
        pool = [_Judged(s, s, plan) for s in (rng.uniform(1, 4) for _ in range(rng.randint(1, 3)))]
        pool += [_Judged(s, s * rng.uniform(1, 2.5), plan)
                 for s in (rng.uniform(1, 4) for _ in range(rng.randint(0, 6)))]
        rng.shuffle(pool)
        chosen = _choose(pool)
        assert chosen.seconds <= min(j.seconds for j in pool if j.robust == j.seconds)


def _tp_then_one() -> tuple[Cluster, Model]:
    """Host h: two 10-TFLOP/s devices (a TP group); host g: one; 10 Gbit/s between hosts."""
    cluster = Cluster(
        devices=(Device(id="h:0", host="h", tflops=10.0, memory_gb=16.0),
                 Device(id="h:1", host="h", tflops=10.0, memory_gb=16.0),
                 Device(id="g:0", host="g", tflops=10.0, memory_gb=16.0)),
        network=Network(intra_host_gbps=2400.0, inter_host_gbps=10.0, latency_us=0.0))
    model = Model(name="blocks", layers=tuple(
        Layer(name=f"b{i}", fwd_gflop=10.0, bwd_gflop=20.0, out_mb=1.0, act_mb=10.0,
              param_mb=10.0, tp_comm_mb=0.3, tp_allreduces=2) for i in range(4)))
    return cluster, model


def _two_stage_plan(cut: int) -> Plan:
    from hetpilot.planner.types import Group, Stage

    return Plan(microbatch_size=1, schedule="1f1b", groups=(Group(samples=1, stages=(
        Stage(device="h:0", devices=("h:0", "h:1"), layers=(0, cut)),
        Stage(device="g:0", layers=(cut, 4)))),))


def test_refine_cuts_moves_a_layer_to_the_faster_tp_stage_by_hand() -> None:
    from hetpilot.planner.tpsearch import _judged, refine_cuts

    cluster, model = _tp_then_one()
    job = Job(global_batch=1, microbatch_size=1, tensor_parallel=True)
    # one microbatch: T = F0 + C + F1 + B1 + C + B0. A layer on the TP stage: F 10 / 20000
    # = 0.0005 s, B 0.001, plus 2 all-reduces each way of 0.3 MB on 2400 Gbit/s (1e-6 s
    # each); on g:0 F 0.001, B 0.002. C: 1 MB over h:0 -> g:0 at 10 Gbit/s (0.0008) plus
    # the TP stage's gather, 1/2 * 1 MB on 2400 Gbit/s (1/600000).
    c = 0.0008 + 1 / 600000
    cut2 = 2 * 0.0005 + 4e-6 + 2 * 0.001 + 2 * 0.002 + 2 * 0.001 + 4e-6 + 2 * c
    cut3 = 3 * 0.0005 + 6e-6 + 0.001 + 0.002 + 3 * 0.001 + 6e-6 + 2 * c
    start = _judged(cluster, model, job, _two_stage_plan(2))
    assert start is not None and start.seconds == pytest.approx(cut2)
    got = refine_cuts(cluster, model, job, start)
    assert [s.layers for s in got.plan.groups[0].stages] == [(0, 3), (3, 4)]
    assert got.seconds == pytest.approx(cut3) and got.seconds < start.seconds
    assert evaluate(cluster, model, got.plan, 1).iteration_s == pytest.approx(cut3)


def test_refine_cuts_leaves_v1_plans_and_moves_groups_of_one_cut_together() -> None:
    from hetpilot.planner.tpsearch import _judged, _move_cut, refine_cuts
    from hetpilot.planner.types import Group, Stage

    cluster, model = _tp_then_one()
    job = Job(global_batch=2, microbatch_size=1, tensor_parallel=True)
    v1 = Plan(microbatch_size=1, schedule="1f1b", groups=(Group(samples=2, stages=(
        Stage(device="h:0", layers=(0, 2)), Stage(device="g:0", layers=(2, 4)))),))
    judged = _judged(cluster, model, job, v1)
    assert judged is not None and refine_cuts(cluster, model, job, judged) is judged
    a = (Stage(device="h:0", layers=(0, 2)), Stage(device="g:0", layers=(2, 4)))
    b = (Stage(device="h:1", layers=(0, 1)), Stage(device="g:0", layers=(1, 4)))
    plan = Plan(microbatch_size=1, schedule="1f1b", groups=(
        Group(samples=1, stages=a), Group(samples=1, stages=b), Group(samples=1, stages=a)))
    moved = _move_cut(plan, ((0, 2), (2, 4)), 0, 3)
    assert [[s.layers for s in g.stages] for g in moved.groups] == [
        [(0, 3), (3, 4)], [(0, 1), (1, 4)], [(0, 3), (3, 4)]]
