"""The planner: validity, optimality on tiny cases, baselines, the LP, infeasibility."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace

import pytest
from hetpilot.planner import catalog
from hetpilot.planner.assign import AssignmentLP, assign_microbatches
from hetpilot.planner.baselines import BASELINES, balanced_cuts, uniform_cuts
from hetpilot.planner.bruteforce import brute_force
from hetpilot.planner.errors import InfeasibleError, InvalidPlanError
from hetpilot.planner.makespans import exact_makespan, fast_makespan
from hetpilot.planner.partition import ModelArrays, evaluate_cut, partition_group
from hetpilot.planner.refmodel import (
    GroupTimes,
    evaluate,
    group_makespan,
    pipeline_makespan,
    stage_memory_mb,
    sync_time,
    validate_plan,
)
from hetpilot.planner.schedules import order
from hetpilot.planner.search import candidate_plans, make_plan
from hetpilot.planner.structure_planner import Planner, _passes
from hetpilot.planner.types import (
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
)

from .helpers import flat_cluster, random_model, spec_cluster, spec_model, uniform_model


def _tiny_case(seed: int):  # type: ignore[no-untyped-def]
    r = random.Random(seed)
    kinds = [r.choice(list(catalog.DEVICES)) for _ in range(3)]
    cluster = catalog.make_cluster([(kinds[0], 2), (kinds[1], 1), (kinds[2], 1)],
                                   inter_host_gbps=r.choice([10.0, 25.0, 100.0]))
    model = random_model(r.choice([4, 5]), seed)
    return cluster, model, Job(global_batch=24, microbatch_size=4, schedules=("1f1b", "gpipe"))


@pytest.mark.parametrize("seed", range(5))
def test_within_two_percent_of_brute_force(seed: int) -> None:
    cluster, model, job = _tiny_case(seed)
    best, _ = brute_force(cluster, model, job)
    plan = make_plan(cluster, model, job)
    result = evaluate(cluster, model, plan, job.global_batch)
    assert result.valid, result.error
    assert result.iteration_s is not None
    assert result.iteration_s <= best * 1.02


def _uneven_case(seed: int, devices: int | None = None):  # type: ignore[no-untyped-def]
    """3-4 devices (or ``devices``) of speeds up to 8x apart, each with memory from a third
    of the whole model's to 2.5 times it, on one host each or two hosts, sometimes a slow
    or fast link between two devices; 4-6 layers (4-5 on more than 4 devices, for brute
    force's sake), sometimes a heavy embedding first or a heavy output layer last."""
    r = random.Random(seed)
    n = r.choice([3, 4])
    if devices is not None:
        n = devices
    layers = [Layer(name=f"l{i}", fwd_gflop=r.uniform(5, 30), bwd_gflop=r.uniform(10, 60),
                    out_mb=r.uniform(1, 20), act_mb=r.uniform(50, 400),
                    param_mb=r.uniform(50, 600))
              for i in range(r.randint(4, 6 if n <= 4 else 5))]
    if r.random() < 0.4:
        layers[0] = replace(layers[0], fwd_gflop=1.0, bwd_gflop=2.0, param_mb=r.uniform(1500, 4000))
    if r.random() < 0.4:
        layers[-1] = replace(layers[-1], param_mb=r.uniform(1500, 4000))
    model = Model(name="uneven", layers=tuple(layers), optimizer_factor=r.choice([1.0, 3.0]))
    micro = r.choice([1, 2, 4])
    whole_gb = stage_memory_mb(model, Stage(device="x", layers=(0, len(layers))), micro, 1) / 1e3
    hosts = [f"h{i}" for i in range(n)] if r.random() < 0.5 else [f"h{i * 2 // n}" for i in range(n)]
    devices = tuple(Device(id=f"d{i}", host=hosts[i], tflops=50.0 * r.choice([1, 2, 4, 8]),
                           memory_gb=whole_gb * r.uniform(0.3, 2.5)) for i in range(n))
    links = ((Link(a="d0", b=f"d{n - 1}", gbps=r.choice([2.0, 1000.0])),)
             if r.random() < 0.4 else ())
    cluster = Cluster(devices=devices, network=Network(
        intra_host_gbps=600.0, inter_host_gbps=r.choice([10.0, 100.0]), latency_us=5.0,
        device_links=links))
    return cluster, model, Job(global_batch=8 * micro, microbatch_size=micro,
                               schedules=r.choice([("1f1b", "gpipe"), ("1f1b",), ("gpipe",)]))


def _assert_within_two_percent_of_brute_force(cluster: Cluster, model: Model, job: Job) -> None:
    """make_plan is within 2% of brute force, or raises InfeasibleError where nothing fits."""
    best, _ = brute_force(cluster, model, job)
    if best == float("inf"):
        with pytest.raises(InfeasibleError):
            make_plan(cluster, model, job)
        return
    plan = make_plan(cluster, model, job)
    result = evaluate(cluster, model, plan, job.global_batch)
    assert result.valid, result.error
    assert result.iteration_s is not None and result.iteration_s <= best * 1.02


@pytest.mark.parametrize("seed", range(16))
def test_within_two_percent_of_brute_force_on_uneven_devices(seed: int) -> None:
    """A randomized comparison on cases of this kind found 260 of 947 more than 2% slower
    than brute force (up to 12.5x): the best stage order was often neither of the few the
    structures tried. On subsets of up to 4 devices every mapping is a structure now."""
    _assert_within_two_percent_of_brute_force(*_uneven_case(seed))


@pytest.mark.parametrize("seed", range(18, 28))
def test_within_two_percent_of_brute_force_on_five_uneven_devices(seed: int) -> None:
    """On 5 devices no structure is every mapping; local search from the best ones
    (planner/localsearch.py) finds what the rules miss. Without it, 4 of these 10 seeds
    were more than 2% slower than brute force (1.03-1.21x; 5 of seeds 0-29)."""
    _assert_within_two_percent_of_brute_force(*_uneven_case(seed, devices=5))


@pytest.mark.parametrize("seed", range(6))
def test_plans_are_valid_and_beat_every_baseline(seed: int) -> None:
    r = random.Random(100 + seed)
    hosts = [(r.choice(list(catalog.DEVICES)), r.choice([1, 2, 4])) for _ in range(r.randint(2, 4))]
    cluster = catalog.make_cluster(hosts, inter_host_gbps=r.choice([25.0, 100.0]))
    model = catalog.MODELS[r.choice(["gpt2-small", "bert-large", "vgg16"])]()
    job = Job(global_batch=64, microbatch_size=r.choice([1, 2, 4]),
              schedules=("1f1b", "gpipe", "custom"))
    plan = make_plan(cluster, model, job)
    ours = evaluate(cluster, model, plan, job.global_batch)
    assert ours.valid, ours.error
    assert ours.iteration_s is not None and ours.iteration_s == pytest.approx(plan.predicted_iteration_s, rel=1e-6)
    for name in BASELINES:
        try:
            base = make_plan(cluster, model, job, policy=name)
        except InfeasibleError:
            continue
        other = evaluate(cluster, model, base, job.global_batch)
        assert other.valid, (name, other.error)
        assert ours.iteration_s <= other.iteration_s * (1 + 1e-9), name


def test_spec_example_beats_the_example_plan() -> None:
    cluster, model = spec_cluster(), spec_model()
    plan = make_plan(cluster, model, Job(global_batch=144, microbatch_size=8))
    result = evaluate(cluster, model, plan, 144)
    assert result.valid and result.iteration_s is not None
    assert result.iteration_s < 0.4465905318095238


def test_straggler_is_left_out() -> None:
    # one device 100x slower than the rest: any share it gets costs more than it brings
    cluster = flat_cluster([100.0, 100.0, 1.0], inter=1000.0)
    plan = make_plan(cluster, uniform_model(4), Job(global_batch=32, microbatch_size=4))
    assert "d2" not in plan.devices


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("tflops", [5e-324, 1e-300])
def test_a_device_of_vanishing_speed_is_left_out(tflops: float) -> None:
    # an agent may report such speeds. 5e-324: its stage times overflow to inf
    # (unusable), which numpy warned about on every solve, into the daemon's log.
    # 1e-300: finite times 1e300 s, on which the assignment LP's solvers failed, so
    # the whole job could not plan.
    cluster = flat_cluster([100.0, 100.0, tflops], inter=1000.0)
    plan = make_plan(cluster, uniform_model(4), Job(global_batch=32, microbatch_size=4))
    assert "d2" not in plan.devices


def test_uneven_assignment_follows_speed() -> None:
    cluster = flat_cluster([30.0, 10.0], inter=10_000.0)
    model = uniform_model(4, param_mb=0.001)  # sync is free: pure data parallelism wins
    plan = make_plan(cluster, model, Job(global_batch=64, microbatch_size=1, schedules=("1f1b",)))
    samples = {g.stages[0].device: g.samples for g in plan.groups if len(g.stages) == 1}
    assert samples.get("d0", 0) == 48 and samples.get("d1", 0) == 16


def test_recompute_only_when_needed() -> None:
    # 4 layers of 10 MB params (x4 with optimizer state) and 100 MB activations. On two
    # devices of 350 MB the only fit is cut 2|2 with recompute on stage 0, which keeps
    # two microbatches in flight under 1f1b: 80 + 2 * 200 = 480 MB plain, 80 + 2 * 1 + 200
    # = 282 MB with recompute.
    model = uniform_model(4, param_mb=10.0, opt=3.0, act_mb=100.0, out_mb=1.0)
    job = Job(global_batch=2, microbatch_size=1, schedules=("1f1b",))
    tight = make_plan(flat_cluster([10.0, 10.0], memory_gb=0.35), model, job)
    roomy = make_plan(flat_cluster([10.0, 10.0], memory_gb=10.0), model, job)
    assert [s.recompute for g in tight.groups for s in g.stages] == [True, False]
    assert not any(s.recompute for g in roomy.groups for s in g.stages)


def test_nothing_fits_raises() -> None:
    model = uniform_model(2, param_mb=1000.0)
    with pytest.raises(InfeasibleError, match="no plan fits in memory"):
        make_plan(flat_cluster([10.0, 10.0], memory_gb=1.0), model,
                  Job(global_batch=4, microbatch_size=1))


def test_candidates_are_valid_and_diverse_in_cost() -> None:
    cluster, model = spec_cluster(), spec_model()
    job = Job(global_batch=144, microbatch_size=8)
    found = candidate_plans(cluster, model, job)
    assert len(found) > 5
    for cand in found[:40]:
        result = evaluate(cluster, model, cand.plan, 144)
        assert result.valid, (cand.label, result.error)
        assert cand.costs["price_per_hour"] == pytest.approx(result.price_per_hour)
    assert len({round(c.costs["price_per_hour"], 6) for c in found}) >= 3


@pytest.mark.parametrize("seed", range(4))
def test_partition_matches_exhaustive_cuts(seed: int) -> None:
    r = random.Random(seed)
    model = random_model(6, seed)
    cluster = flat_cluster([r.uniform(20, 200) for _ in range(3)], memory_gb=1000.0,
                           inter=r.choice([10.0, 100.0]), latency_us=10.0)
    arr = ModelArrays(model)
    devs = list(cluster.devices)
    links = [cluster.link(devs[i].id, devs[i + 1].id) for i in range(2)]
    for schedule in ("1f1b", "gpipe"):
        found = partition_group(arr, devs, links, 2, 6, schedule)
        assert found is not None
        best = min(
            c.makespan for a in range(1, 5) for b in range(a + 1, 6)
            if (c := evaluate_cut(arr, devs, links, (0, a, b, 6), 2, 6, schedule)) is not None
        )
        assert found.makespan <= best * 1.02


def test_assignment_lp_is_dpp_and_rounding_is_tight() -> None:
    lp = AssignmentLP(3)
    assert lp.problem.is_dcp(dpp=True)
    fill, cycle = [0.5, 1.0, 0.2], [0.1, 0.3, 0.2]
    relaxed = lp.solve(fill, cycle, [100, 100, 100], 40)
    bound = max(f + c * m for f, c, m in zip(fill, cycle, relaxed, strict=True))

    def span(i: int, m: int) -> float:
        return fill[i] + cycle[i] * m

    counts = assign_microbatches(span, fill, cycle, [100, 100, 100], 40)
    assert counts is not None and sum(counts) == 40
    worst = max(span(i, m) for i, m in enumerate(counts))
    assert worst <= bound + max(cycle) + 1e-9  # within one microbatch of the LP bound


def test_fast_makespan_extrapolation_is_close() -> None:
    r = random.Random(7)
    for _ in range(30):
        n = r.randint(1, 6)
        f = tuple(r.uniform(0.5, 1.5) for _ in range(n))
        times = GroupTimes(f, tuple(2 * x for x in f), tuple(r.uniform(0, 0.5) for _ in range(n - 1)))
        for schedule in ("1f1b", "gpipe"):
            exact = group_makespan(times, schedule, 90)
            assert fast_makespan(times, schedule, 90) == pytest.approx(exact, rel=0.02)


@pytest.mark.parametrize("seed", range(3))
def test_exact_makespan_is_the_reference_simulation(seed: int) -> None:
    """One 1f1b simulation answers smaller M from its drains: the same floats, bit for bit."""
    from hetpilot.planner.makespans import _TRACES

    r = random.Random(seed)
    for _ in range(40):
        n = r.randint(1, 16)
        digits = 1 if r.random() < 0.3 else 17  # 1 digit: many equal arrival times
        f = tuple(round(r.uniform(0.01, 2.0), digits) or 0.1 for _ in range(n))
        times = GroupTimes(f, tuple(x * r.uniform(1.0, 3.0) for x in f),
                           tuple(round(r.uniform(0.0, 1.0), digits) for _ in range(n - 1)))
        _TRACES.clear()
        ms = list(range(1, 3 * n + 12))
        r.shuffle(ms)  # traces made at every order of requests
        for m in ms:
            orders = [order("1f1b", n, j, m) for j in range(n)]
            expect = pipeline_makespan(times.fwd, times.bwd, times.comm, orders)
            assert exact_makespan(times, "1f1b", m) == expect
            assert exact_makespan(times, "gpipe", m) == group_makespan(times, "gpipe", m)


@pytest.mark.parametrize("seed", range(4))
def test_planner_sync_time_is_the_reference(seed: int) -> None:
    """The planner's all-reduce time of valid plans: the reference's float, bit for bit."""
    r = random.Random(seed)
    kinds = [r.choice(list(catalog.DEVICES)) for _ in range(3)]
    hosts = [(kinds[i % 3], r.randint(1, 4)) for i in range(r.randint(2, 6))]
    slow = [(0, 1, 5.0)] if len(hosts) > 2 else []
    cluster = catalog.make_cluster(hosts, inter_host_gbps=r.choice([10.0, 100.0]), slow_links=slow)
    model = random_model(r.choice([4, 9, 16]), seed)
    job = Job(global_batch=64, microbatch_size=4, schedules=("1f1b", "gpipe", "custom"))
    planner = Planner(cluster, model, job)
    found = candidate_plans(cluster, model, job)
    assert found
    for cand in found:
        groups = cand.plan.groups
        assert planner.sync_time(groups) == sync_time(cluster, model, groups)


def test_assignment_lp_memo_returns_copies() -> None:
    lp = AssignmentLP(2)
    first = lp.solve([1.0, 2.0], [0.5, 0.25], [40, 40], 40)
    first[0] = -1.0
    again = lp.solve([1.0, 2.0], [0.5, 0.25], [40, 40], 40)
    assert again[0] >= 0 and abs(again.sum() - 40) < 1e-6


def test_baseline_cuts() -> None:
    assert uniform_cuts(10, 3) == [0, 4, 7, 10]
    assert balanced_cuts([1, 1, 1, 1, 4], 2) == [0, 4, 5]


def _run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter (nothing imported yet); fail with its output."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_planner_does_not_import_torch_or_grpc() -> None:
    code = ("import sys, hetpilot.planner.search, hetpilot.planner.cli; "
            "bad = [m for m in ('torch', 'grpc') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    _run_python(code)


def test_assignment_lps_bounded_or_not_import_no_cvxpy() -> None:
    """Importing the planner leaves cvxpy out (start-up of `hetpilot plan`, the daemon);
    assignment LPs whose optimum lies inside the bounds have a closed form (all classes
    finishing together: assign.closed_form), and those with a bound active at the
    optimum (a slow class that gets no share, a memory cap) are water-filled
    (assign.water_fill): planning either kind of cluster imports no cvxpy."""
    code = ("import sys\n"
            "from hetpilot.planner import assign, catalog\n"
            "from hetpilot.planner.search import make_plan\n"
            "from hetpilot.planner.types import Job\n"
            "assert 'cvxpy' not in sys.modules, 'imported with the planner'\n"
            "cluster = catalog.make_cluster([('A100', 2), ('V100', 2), ('T4', 2)])\n"
            "make_plan(cluster, catalog.MODELS['gpt2-small'](), Job(global_batch=64, microbatch_size=4))\n"
            "assert 'cvxpy' not in sys.modules, 'imported for LPs with a closed form'\n"
            "bounded = []\n"
            "closed_form = assign.closed_form\n"
            "def spy(*args):\n"
            "    found = closed_form(*args)\n"
            "    bounded.append(found is None)\n"
            "    return found\n"
            "assign.closed_form = spy\n"
            "cluster = catalog.make_cluster([('H100', 2), ('T4', 2)])\n"
            "make_plan(cluster, catalog.MODELS['gpt2-small'](), Job(global_batch=8, microbatch_size=1))\n"
            "assert any(bounded), 'no LP with an active bound: pick another case'\n"
            "assert 'cvxpy' not in sys.modules, 'an LP with an active bound imported cvxpy'\n")
    _run_python(code)


def test_warm_up_imports_cvxpy_and_compiles_the_smallest_problem() -> None:
    code = ("import sys\n"
            "from hetpilot.planner import assign\n"
            "assert 'cvxpy' not in sys.modules\n"
            "assign.warm_up()\n"
            "assert 'cvxpy' in sys.modules and assign.lp_problem.cache_info().currsize == 1\n")
    _run_python(code)


def test_pairs_restrict_the_search_to_those_structures_on_all_devices() -> None:
    cluster = catalog.make_cluster([("A100", 4), ("V100", 4)])
    model = catalog.MODELS["gpt2-small"]()
    job = Job(global_batch=64, microbatch_size=4, schedules=("1f1b", "gpipe"))
    every = candidate_plans(cluster, model, job)
    only = candidate_plans(cluster, model, job, pairs=[("host", "gpipe")])
    assert only and {c.label for c in only} == {"all/host"}
    assert all(c.plan.schedule == "gpipe" and len(c.plan.devices) == 8 for c in only)
    assert any(c.label.startswith("baseline/") for c in every)


def _controller_after(cluster: Cluster, model: Model, job: Job, slots: int, budget: int
                      ) -> tuple[float, list[int]]:
    """The ``fastest`` controller's iteration time after ``slots`` slots on an unchanged
    cluster, and what its carried descent planned in each slot."""
    from hetpilot.planner.controller import Controller, ControllerConfig

    ctl = Controller(model, job, ControllerConfig(policy="fastest", hysteresis=0.0,
                                                  iterations_per_slot=10**9,  # any gain pays
                                                  local_search_budget=budget))
    spent, before, t = [], 0, float("inf")
    for _ in range(slots):
        t = ctl.step(cluster).iteration_s
        spent.append(ctl.local_search_planned - before)
        before = ctl.local_search_planned
    return t, spent


def test_controller_carries_the_local_search_over_slots_to_make_plans_result() -> None:
    """The controller spends at most ``local_search_budget`` plannings per schedule per slot
    (plus re-planning where its descents stand) and resumes the next slot; on the 5-device
    cases where the local search matters it reaches make_plan's plan within 12 slots, and
    spends next to nothing once every descent has stopped. Without it, 4 of them stay more
    than 2% slower than make_plan."""
    behind = 0
    for seed in range(18, 28):
        cluster, model, job = _uneven_case(seed, devices=5)
        try:
            want = evaluate(cluster, model, make_plan(cluster, model, job), job.global_batch)
        except InfeasibleError:
            continue
        assert want.iteration_s is not None
        got, spent = _controller_after(cluster, model, job, 12, budget=24)
        assert got <= want.iteration_s * 1.02, seed
        schedules = len(job.schedules)
        assert max(spent) <= schedules * (24 + 4), spent
        assert spent[-1] <= schedules * 4, spent  # stopped: re-plans where it stands
        plain, _ = _controller_after(cluster, model, job, 2, budget=0)
        behind += plain > want.iteration_s * 1.02
    assert behind >= 3, behind


def test_carried_descent_starts_afresh_when_the_cluster_changes() -> None:
    """A device slowed 4x: the next slot scans again (from the mapping carried over) and
    reaches make_plan's plan on the new cluster; prices, or a speed 5% off (a daemon's
    measurements move every slot), do not restart the scan."""
    from hetpilot.planner.carried_descent import CarriedDescent

    for seed in range(18, 28):
        cluster, model, job = _uneven_case(seed, devices=5)
        found = candidate_plans(cluster, model, job, focus=3)
        if found:
            break
    descent = CarriedDescent(24)
    for _ in range(15):
        descent(cluster, model, job, found)
    settled = descent.planned
    pricier = replace(cluster, devices=tuple(replace(d, price_per_hour=d.price_per_hour + 1.0)
                                             for d in cluster.devices))
    descent(pricier, model, job, candidate_plans(pricier, model, job, focus=3))
    assert descent.planned - settled <= 4 * len(job.schedules)
    settled = descent.planned
    noisy = replace(cluster, devices=tuple(replace(d, tflops=d.tflops * 1.05) if i == 0 else d
                                           for i, d in enumerate(cluster.devices)))
    descent(noisy, model, job, candidate_plans(noisy, model, job, focus=3))
    assert descent.planned - settled <= 4 * len(job.schedules)  # within the drift: no rescan
    slow = replace(cluster, devices=tuple(replace(d, tflops=d.tflops / 4) if i == 0 else d
                                          for i, d in enumerate(cluster.devices)))
    found = candidate_plans(slow, model, job, focus=3)
    want = evaluate(slow, model, make_plan(slow, model, job), job.global_batch).iteration_s
    assert want is not None
    before = descent.planned
    best = min(c.iteration_s for c in found)
    for _ in range(15):
        best = min([best, *(c.iteration_s for c in descent(slow, model, job, found))])
    assert descent.planned - before > 4 * len(job.schedules)
    assert best <= want * 1.02


@pytest.mark.parametrize("top", [1, 3])
@pytest.mark.parametrize(("hosts", "seed"), [(3, 0), (5, 1), (10, 2), (12, 3)])
def test_top_k_search_finds_the_same_fastest_plans(hosts: int, seed: int, top: int) -> None:
    """``top=k`` skips scoring plans provably slower than k already found: the k first
    candidates in make_plan's order (the TP search's quick plan for k = 1, make_plan's
    exact re-check for k = 3) are the full search's, on clusters small (every
    structure) and big (> 64 devices: focus ranking)."""
    from hetpilot.planner.search import _preference

    r = random.Random(seed)
    kinds = list(catalog.DEVICES)
    cluster = catalog.make_cluster([(r.choice(kinds), 8) for _ in range(hosts)])
    model = random_model(r.choice([12, 24]), seed)
    job = Job(global_batch=4 * len(cluster.devices), microbatch_size=1)
    full = sorted(candidate_plans(cluster, model, job, focus=top), key=_preference)
    quick = sorted(candidate_plans(cluster, model, job, focus=top, top=top), key=_preference)
    assert [(c.plan, c.iteration_s) for c in quick[:top]] == \
        [(c.plan, c.iteration_s) for c in full[:top]]
    assert len(quick) <= len(full)  # slower plans are not scored (where some are)


@pytest.mark.parametrize("seed", range(4))
def test_planner_vouches_for_a_plan_only_when_validate_plan_passes_it(seed: int) -> None:
    """The planner skips validate_plan for plans it built when its own check (devices,
    counts, batch, memory per class of groups) says they pass: on groups cut for one
    count and given another (memory tight, so some stages no longer fit), a device in two
    groups or one microbatch too many, its verdict is validate_plan's."""
    r = random.Random(seed)
    cluster = catalog.make_cluster([(r.choice(["V100", "T4", "A10G"]), 4) for _ in range(3)])
    model = random_model(12, seed)
    model = replace(model, layers=tuple(replace(x, act_mb=x.act_mb * 3) for x in model.layers))
    job = Job(global_batch=48, microbatch_size=2)
    planner = Planner(cluster, model, job)
    devices = list(cluster.devices)
    verdicts = set()
    for _ in range(60):
        r.shuffle(devices)
        size = r.choice([2, 3, 4])
        groups = [tuple(devices[i:i + size]) for i in range(0, len(devices), size)]
        if r.random() < 0.25:  # a device in two groups
            groups[-1] = (groups[0][0], *groups[-1][1:])
        schedule = r.choice(["1f1b", "gpipe"])
        counts = [1] * len(groups)
        for _ in range(job.microbatches - len(groups) + (r.random() < 0.25)):  # or one too many
            counts[r.randrange(len(groups))] += 1
        cuts, made = [], []
        for g, m in zip(groups, counts, strict=True):
            cut = planner.cut(g, r.randint(1, 4), schedule)
            # made at a count up to m: its recompute flags may not hold m in flight
            at = None if cut is None else planner.at(g, cut.bounds, r.randint(1, m), schedule)
            if cut is None or at is None:
                break
            cuts.append((g, cut))
            made.append(at)
        else:
            plan = Plan(microbatch_size=2, schedule=schedule, groups=tuple(
                Group(samples=2 * m, stages=tuple(
                    Stage(device=d.id, layers=(c.bounds[j], c.bounds[j + 1]),
                          recompute=c.recompute[j]) for j, d in enumerate(g)))
                for (g, _), m, c in zip(cuts, counts, made, strict=True)))
            try:
                validate_plan(cluster, model, plan, job.global_batch)
                ok = True
            except InvalidPlanError:
                ok = False
            assert _passes(planner, cuts, counts, made, schedule) == ok
            verdicts.add(ok)
    assert verdicts == {True, False}


def test_group_signatures_are_shared_only_for_a_clusters_own_devices() -> None:
    """A group's signature (speeds, memory, links) is shared across planners of clusters
    with the same network and device objects (the TP search's virtual clusters); a device
    id that another cluster puts on another host gets that cluster's links."""
    cluster = catalog.make_cluster([("A100", 2), ("A100", 2)], inter_host_gbps=10.0)
    a, b, c, _ = cluster.devices
    moved = replace(b, host=c.host)  # b's id, on the other host
    other = Cluster(devices=(a, moved, *cluster.devices[2:]), network=cluster.network)
    job = Job(global_batch=8, microbatch_size=1)
    model = uniform_model(4)
    first = Planner(cluster, model, job)._signature((a, b))
    assert Planner(cluster, model, job)._signature((a, b)) == first
    second = Planner(other, model, job)._signature((a, moved))
    assert second[1] != first[1] and second[1] == (other.link(a.id, b.id),)
    assert Planner(other, model, job)._signature((a, b)) == second  # b is not other's own


def test_group_numbers_are_kept_by_the_groups_object() -> None:
    """A structure's group numbers are each group's own (empty groups left out), and the
    same object asked again gets the same answer without numbering its groups again."""
    cluster = catalog.make_cluster([("A100", 2), ("V100", 2)], inter_host_gbps=10.0)
    a, b, c, d = cluster.devices
    sigs = Planner(cluster, uniform_model(4), Job(global_batch=8, microbatch_size=1)).sigs
    groups = ((a, b), (), (c, d), (a, c), (a, b))
    got = sigs.numbers(groups)
    assert got == tuple(sigs.of(g)[1] for g in groups if g)
    assert got[0] == got[3] and len(set(got)) == 3
    calls = []
    of = sigs.of
    sigs.of = lambda devs: calls.append(devs) or of(devs)  # type: ignore[method-assign]
    assert sigs.numbers(groups) == got and calls == []
    assert sigs.numbers(groups[:2]) == got[:1] and calls == [(a, b)]


def test_straggler_median_is_statistics_median() -> None:
    """search's median (kept out of start-up: statistics imports fractions and decimal)
    is statistics.median's float, odd and even counts."""
    import statistics

    from hetpilot.planner.search import _median

    r = random.Random(0)
    for n in [1, 2, 3, 4, 7, 8] * 50:
        values = [r.choice([r.uniform(0, 400), 312.0, 125.0]) for _ in range(n)]
        assert _median(values) == statistics.median(values)
