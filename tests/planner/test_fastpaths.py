"""Shortcuts that keep `hetpilot plan` fast at thousands of microbatches, each checked
against the plain path it replaces: the same answer (bit for bit where the plain
path is the reference model's), and cvxpy imported only by an LP that needs it."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hetpilot.planner import assign, catalog
from hetpilot.planner.refmodel import (
    GroupTimes,
    builtin_makespan_1f1b,
    builtin_makespan_gpipe,
    group_makespan,
    pipeline_makespan,
    sync_time,
    sync_time_literal,
)
from hetpilot.planner.schedules import Op, inflight, order, warmup_order
from hetpilot.planner.sync_readings import sync_readings
from hetpilot.planner.types import Cluster, Device, Group, Link, Network, Stage

from .helpers import random_model

# -- op orders ---------------------------------------------------------------------


def _plain_warmup_order(warmup: int, m: int) -> tuple[Op, ...]:
    """The order as the spec words it, one op at a time."""
    w = max(0, min(warmup, m))
    ops: list[Op] = [(False, k) for k in range(w)]
    for i in range(m - w):
        ops.append((False, w + i))
        ops.append((True, i))
    ops.extend((True, k) for k in range(m - w, m))
    return tuple(ops)


def _plain_inflight(ops: tuple[Op, ...]) -> int:
    live = peak = 0
    for is_bwd, _ in ops:
        live += -1 if is_bwd else 1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("m", [*range(0, 13), 63, 64, 65, 2047, 2048, 2049, 4097])
def test_orders_are_the_plain_orders_and_know_their_peak(m: int) -> None:
    for warmup in range(-1, 10):
        got = warmup_order(warmup, m)
        want = _plain_warmup_order(warmup, m)
        assert got == want and hash(got) == hash(want) and tuple(got) == want
        assert inflight(got) == _plain_inflight(want) == inflight(want)
    for stages in (1, 2, 5):
        for j in range(stages):
            assert order("1f1b", stages, j, m) == _plain_warmup_order(stages - 1 - j, m)
            gpipe = order("gpipe", stages, j, m)
            assert gpipe == tuple((False, k) for k in range(m)) + tuple((True, k) for k in range(m))
            assert inflight(gpipe) == _plain_inflight(tuple(gpipe))


def test_inflight_of_any_order_is_the_plain_scan() -> None:
    r = random.Random(3)
    for _ in range(500):
        ops = tuple((r.random() < 0.5, r.randrange(9)) for _ in range(r.randrange(0, 40)))
        assert inflight(ops) == _plain_inflight(ops)


def test_orders_pickle_and_compare_as_tuples() -> None:
    got = order("1f1b", 4, 1, 7)
    back = pickle.loads(pickle.dumps(got))
    assert back == got and inflight(back) == inflight(tuple(got)) == 3
    assert {got: 1}[tuple(got)] == 1


# -- the reference simulation of the built-in schedules ------------------------------


def _random_times(r: random.Random, n: int) -> tuple[tuple[float, ...], ...]:
    digits = r.choice([0, 1, 17])  # few digits: many equal times, ties in every max

    def value(hi: float) -> float:
        v = r.uniform(0.0, hi)
        return round(v, digits) if digits < 17 else v

    fwd = tuple(value(2.0) for _ in range(n))
    bwd = tuple(value(4.0) for _ in range(n))
    comm = tuple(value(1.5) if r.random() < 0.8 else 0.0 for _ in range(n - 1))
    return fwd, bwd, comm


@pytest.mark.parametrize("seed", range(6))
def test_builtin_simulations_are_the_reference_bit_for_bit(seed: int) -> None:
    r = random.Random(seed)
    for _ in range(300):
        n = r.randint(1, 12)
        fwd, bwd, comm = _random_times(r, n)
        m = r.choice([1, 2, 3, n, n + 1, r.randint(1, 2 * n + 3), r.randint(1, 80)])
        for schedule, fast in (("1f1b", builtin_makespan_1f1b), ("gpipe", builtin_makespan_gpipe)):
            orders = [order(schedule, n, j, m) for j in range(n)]
            want = pipeline_makespan(fwd, bwd, comm, orders)
            assert fast(fwd, bwd, comm, m) == want, (schedule, fwd, bwd, comm, m)
            assert group_makespan(GroupTimes(fwd, bwd, comm), schedule, m) == want


def test_builtin_simulations_at_thousands_of_microbatches() -> None:
    r = random.Random(11)
    for n in (1, 8, 42):
        fwd, bwd, comm = _random_times(r, n)
        for schedule, fast in (("1f1b", builtin_makespan_1f1b), ("gpipe", builtin_makespan_gpipe)):
            orders = [order(schedule, n, j, 4096) for j in range(n)]
            assert fast(fwd, bwd, comm, 4096) == pipeline_makespan(fwd, bwd, comm, orders)


# -- the assignment LP ----------------------------------------------------------------


def _random_lp(r: random.Random) -> tuple[list[float], list[float], list[float], int, list[int]]:
    k = r.randint(1, 6)
    fill = [r.uniform(0.0, 5.0) if r.random() < 0.9 else 0.0 for _ in range(k)]
    cycle = [10 ** r.uniform(-3, 0) for _ in range(k)]
    count = [r.randint(1, 100) for _ in range(k)]
    total = r.randint(1, 5000)
    cap = [float(r.choice([total, r.randint(1, total)])) for _ in range(k)]
    while sum(c * n for c, n in zip(cap, count, strict=True)) < total:
        cap = [c * 2 for c in cap]
    return fill, cycle, cap, total, count


def test_closed_form_is_the_lp_optimum_cvxpy_finds() -> None:
    """Where it answers, the closed form is feasible, no worse than cvxpy's optimum, and
    within cvxpy's tolerance of its solution (the optimum is unique there)."""
    r = random.Random(1)
    answered = 0
    for _ in range(400):
        fill, cycle, cap, total, count = _random_lp(r)
        got = assign.closed_form(fill, cycle, cap, total, count)
        if got is None:
            continue
        answered += 1
        lp = assign.lp_problem(len(fill))._solve(fill, cycle, cap, total, count)
        a, b, n = np.asarray(fill), np.asarray(cycle), np.asarray(count)
        assert np.all(got >= 0) and np.all(got <= np.asarray(cap))
        assert float(n @ got) == pytest.approx(total, rel=1e-12)
        t_closed, t_lp = float(np.max(a + b * got)), float(np.max(a + b * lp))
        assert t_closed <= t_lp * (1 + 1e-12)
        assert t_closed == pytest.approx(t_lp, rel=1e-7)
        assert np.allclose(got, lp, rtol=1e-5, atol=1e-5 * max(1.0, float(np.max(lp))))
    assert answered > 100


def test_closed_form_declines_lps_with_an_active_bound() -> None:
    # the second class's fill alone outlasts the first's share of all microbatches
    assert assign.closed_form([0.0, 100.0], [1.0, 1.0], [10.0, 10.0], 10) is None
    # a cap binds (a gpipe memory limit)
    assert assign.closed_form([0.0, 0.0], [1.0, 1.0], [2.0, 100.0], 10) is None
    # outside the LP's domain: left to cvxpy, which reports it
    assert assign.closed_form([0.0, 0.0], [0.0, 1.0], [10.0, 10.0], 10) is None
    both = assign.closed_form([0.0, 0.0], [1.0, 1.0], [100.0, 100.0], 10)
    assert both is not None and both.tolist() == [5.0, 5.0]


@pytest.mark.parametrize("seed", range(3))
def test_assignment_with_the_exact_lp_is_cvxpys(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    r = random.Random(seed)
    same = face = 0
    for _ in range(150):
        k = r.randint(2, 8)
        n_classes = r.randint(1, k)
        classes = [r.randrange(n_classes) for _ in range(k)]
        a = [r.uniform(0, 5) for _ in range(n_classes)]
        b = [10 ** r.uniform(-3, 0) for _ in range(n_classes)]
        total = r.randint(k, 3000)
        fill, cycle = [a[c] for c in classes], [b[c] for c in classes]

        def span(g: int, m: int, fill: list[float] = fill, cycle: list[float] = cycle) -> float:
            return fill[g] + cycle[g] * m + 0.01 * (m % 3)  # near affine, as makespans are

        got = []
        for closed in (True, False):
            monkeypatch.setattr(assign, "CLOSED_FORM", closed)
            assign._SOLVED.clear()
            got.append(assign.assign_microbatches(span, fill, cycle, [total] * k, total, classes))
        count = [classes.count(c) for c in range(n_classes)]
        if sum(n * min(total, (max(a) - ac) / bc)
               for n, ac, bc in zip(count, a, b, strict=True)) <= total:
            assert got[0] == got[1]  # the LP's optimum is unique: the same point, the same floors
            same += 1
        else:
            # a class's fill outlasts the others' need: the LP's optimal face is more than a
            # point, cvxpy lands inside it and water_fill on its min-max corner; the
            # assignments may differ, their makespan does not
            assert got[0] is not None and got[1] is not None and sum(got[0]) == total
            assert max(span(g, m) for g, m in enumerate(got[0])) == \
                max(span(g, m) for g, m in enumerate(got[1]))
            face += 1
    assert same > 50 and face > 10


# -- imports --------------------------------------------------------------------------

_HEAVY = ("cvxpy", "scipy", "sklearn", "torch", "grpc")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_planner_imports_no_solver_and_no_heavy_module() -> None:
    code = ("import sys\n"
            "import hetpilot.planner, hetpilot.planner.search, hetpilot.planner.cli\n"
            "import hetpilot.planner.assign, hetpilot.planner.refmodel, hetpilot.cli\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {_HEAVY!r})\n"
            "assert not bad, bad\n")
    _run(code)


def test_a_1024_device_plan_imports_no_solver_and_no_heavy_module() -> None:
    """The issue-15 case (1024 devices, 4 kinds, 42 layers, 4096 microbatches): every
    assignment LP has its optimum inside the bounds, so nothing imports cvxpy."""
    code = ("import sys\n"
            "from hetpilot.planner import catalog\n"
            "from hetpilot.planner.search import make_plan\n"
            "from hetpilot.planner.types import Job\n"
            "kinds = ['H100', 'A100', 'V100', 'A10G']\n"
            "cluster = catalog.make_cluster([(kinds[i % 4], 8) for i in range(128)])\n"
            "job = Job(global_batch=4096, microbatch_size=1, schedules=('1f1b', 'gpipe', 'custom'))\n"
            "plan = make_plan(cluster, catalog.MODELS['llama-13b'](), job)\n"
            "assert plan.global_batch == 4096\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {_HEAVY!r})\n"
            "assert not bad, bad\n")
    _run(code)


def _lp_optimum(fill: list[float], cycle: list[float], m: np.ndarray) -> float:
    return float(np.max(np.asarray(fill) + np.asarray(cycle) * m))


def test_water_fill_is_an_lp_optimum_and_cvxpys_where_that_is_unique() -> None:
    """On random LPs, bounds active or not: water_fill's point is feasible, its time is
    cvxpy's optimum (never worse), and where the optimum is unique (f(t*) = N, every
    case but a class whose fill alone outlasts the others' need) it is cvxpy's point
    to cvxpy's tolerance."""
    r = random.Random(5)
    bounded = degenerate = 0
    for _ in range(500):
        fill, cycle, cap, total, count = _random_lp(r)
        if r.random() < 0.3:  # a slow class whose fill outlasts the rest: the degenerate face
            fill[r.randrange(len(fill))] = 50.0
        got = assign.water_fill(fill, cycle, cap, total, count)
        assert got is not None
        lp = assign.lp_problem(len(fill))._solve(fill, cycle, cap, total, count)
        n = np.asarray(count, dtype=float)
        assert np.all(got >= 0) and np.all(got <= np.asarray(cap))
        assert float(n @ got) == pytest.approx(total, rel=1e-12)
        t_fill, t_lp = _lp_optimum(fill, cycle, got), _lp_optimum(fill, cycle, lp)
        assert t_fill <= t_lp * (1 + 1e-12)
        assert t_fill == pytest.approx(t_lp, rel=1e-7)
        if assign.closed_form(fill, cycle, cap, total, count) is None:
            bounded += 1
        a, b, caps = np.asarray(fill), np.asarray(cycle), np.asarray(cap)
        if float(n @ np.minimum(caps, (max(fill) - a) / b)) > total * (1 + 1e-9):
            degenerate += 1
            # the lexicographic min-max point: the classes at max(fill) get nothing,
            # and the rest is the same LP over them
            last = a >= max(fill)
            assert np.all(got[last] == 0)
            rest = [i for i in range(len(fill)) if not last[i]]
            sub = assign.lp_problem(len(rest))._solve(
                [fill[i] for i in rest], [cycle[i] for i in rest], [cap[i] for i in rest],
                total, [count[i] for i in rest])
            assert _lp_optimum([fill[i] for i in rest], [cycle[i] for i in rest], got[rest]) \
                == pytest.approx(_lp_optimum([fill[i] for i in rest], [cycle[i] for i in rest],
                                             sub), rel=1e-7)
        else:
            assert np.allclose(got, lp, rtol=1e-5, atol=1e-5 * max(1.0, float(np.max(lp))))
    assert bounded > 100 and degenerate > 50


def test_water_fill_by_hand() -> None:
    # a cap binds: class 0 takes its 2, class 1 the other 8
    assert assign.water_fill([0.0, 0.0], [1.0, 1.0], [2.0, 100.0], 10).tolist() == [2.0, 8.0]
    # class 1's fill (100) outlasts class 0 taking all 10: class 1 gets none
    assert assign.water_fill([0.0, 100.0], [1.0, 1.0], [10.0, 10.0], 10).tolist() == [10.0, 0.0]
    # the same with two more classes: the rest share by min-max (both finish at 6)
    got = assign.water_fill([0.0, 2.0, 100.0], [1.0, 1.0, 1.0], [50.0, 50.0, 50.0], 10)
    assert got is not None and got.tolist() == [6.0, 4.0, 0.0]
    # caps too small, or a cycle of 0: outside the domain
    assert assign.water_fill([0.0, 0.0], [1.0, 1.0], [2.0, 2.0], 10) is None
    assert assign.water_fill([0.0, 0.0], [0.0, 1.0], [10.0, 10.0], 10) is None



# -- gradient sync ---------------------------------------------------------------------


def _random_tp_groups(r: random.Random, cluster: Cluster, n_layers: int) -> list[Group]:
    """Groups of stages of mixed degrees (1, 2, 4 devices of one host), random cuts."""
    free: dict[str, list[str]] = {}
    for dev in cluster.devices:
        free.setdefault(dev.host, []).append(dev.id)
    groups = []
    for _ in range(r.randint(2, 5)):
        n = r.randint(1, min(3, n_layers))
        bounds = [0, *sorted(r.sample(range(1, n_layers), n - 1)), n_layers]
        stages = []
        for j in range(n):
            host = r.choice([h for h, ids in free.items() if ids] or [""])
            if not host:
                return groups
            t = r.choice([t for t in (1, 2, 4) if t <= len(free[host])])
            devices = tuple(free[host][:t])
            del free[host][:t]
            stages.append(Stage(device=devices[0], devices=devices,
                                layers=(bounds[j], bounds[j + 1])))
        groups.append(Group(samples=4, stages=tuple(stages)))
    return groups


@pytest.mark.parametrize("seed", range(6))
def test_sync_readings_are_the_literal_sync_bit_for_bit(seed: int) -> None:
    """Both readings of the sync from one pass: the literal reference's floats, on plans
    whose groups split layers differently (degrees 1, 2, 4; unsplittable layers; tp_max)."""
    r = random.Random(seed)
    cluster = catalog.make_cluster([(r.choice(list(catalog.DEVICES)), r.choice([4, 8]))
                                    for _ in range(r.randint(3, 6))],
                                   slow_links=[(0, 1, 5.0)])
    base = random_model(r.choice([3, 7, 12]), seed)
    model = replace(base, layers=tuple(
        replace(layer, tp_comm_mb=r.uniform(1, 20), tp_max=r.choice([None, 2, 4]),
                tp_allreduces=2) if r.random() < 0.7 else layer for layer in base.layers))
    for _ in range(30):
        groups = _random_tp_groups(r, cluster, model.num_layers)
        want = (sync_time_literal(cluster, model, groups),
                sync_time_literal(cluster, model, groups, shared_uplinks=True))
        assert sync_readings(cluster, model, groups) == want
        assert (sync_time(cluster, model, groups),
                sync_time(cluster, model, groups, shared_uplinks=True)) == want


def test_sync_time_of_groups_that_do_not_tile_is_the_literal_reading() -> None:
    """A device in two groups (an invalid plan) still gets the literal reading's sum."""
    cluster = catalog.make_cluster([("A100", 2), ("A100", 2)])
    model = random_model(4, 0)
    ids = [d.id for d in cluster.devices]
    twice = [Group(samples=4, stages=(Stage(device=ids[0], layers=(0, 2)),
                                      Stage(device=ids[1], layers=(2, 4)))),
             Group(samples=4, stages=(Stage(device=ids[0], layers=(0, 4)),)),
             Group(samples=4, stages=(Stage(device=ids[2], layers=(0, 4)),))]
    literal = sync_time_literal(cluster, model, twice)
    assert sync_time(cluster, model, twice) == literal
    assert sync_readings(cluster, model, twice)[0] != literal  # the one pass assumes a tiling


def test_model_tokens_are_shared_by_equal_models_and_let_go_of_dropped_ones() -> None:
    """A daemon's planning process sees a new model each time measurements change it:
    the token table must not hold them all, and a token is never given twice."""
    import gc

    from hetpilot.planner import structure_planner as sp

    base = random_model(6, 5)
    twin = replace(base)
    assert twin is not base and sp.model_token(twin) == sp.model_token(base)
    before = len(sp._MODEL_TOKENS)
    seen = set()
    for k in range(200):  # models a long-running process plans once each
        model = replace(base, name=f"slot-{k}")
        seen.add(sp.model_token(model))
        del model
    gc.collect()
    assert len(seen) == 200  # distinct models, distinct tokens (none reused)
    assert len(sp._MODEL_TOKENS) <= before + 1
    assert sp.model_token(base) not in seen


@pytest.mark.parametrize("per_pair", ["none", "hosts", "devices", "both"])
def test_path_links_are_link_pair_by_pair(per_pair: str) -> None:
    """A group's links in one call are the per-pair lookups' tuples, with and without
    per-pair links in the network (the plain network takes the hosts-only path)."""
    rng = random.Random(7)
    devices = tuple(Device(id=f"h{h}:{i}", host=f"h{h}", tflops=10.0, memory_gb=16.0)
                    for h in range(4) for i in range(3))
    hosts = [Link(a="h0", b="h2", gbps=7.0), Link(a="h3", b="h1", gbps=3.0, latency_us=40.0)]
    pairs = [Link(a="h1:0", b="h1:2", gbps=900.0), Link(a="h2:1", b="h0:0", gbps=11.0)]
    network = Network(intra_host_gbps=2400.0, inter_host_gbps=25.0, latency_us=5.0,
                      host_links=tuple(hosts) if per_pair in ("hosts", "both") else (),
                      device_links=tuple(pairs) if per_pair in ("devices", "both") else ())
    cluster = Cluster(devices=devices, network=network)
    ids = [d.id for d in devices]
    plain = Cluster(devices=devices, network=network)  # link() alone, no shared memo
    for _ in range(200):
        path = rng.sample(ids, rng.randint(1, len(ids)))
        got = cluster.path_links(path)
        assert got == tuple(plain.link(path[i], path[i + 1]) for i in range(len(path) - 1))
    if per_pair == "none":
        assert cluster.path_links(["h0:0", "h0:1", "h1:0"]) == ((2400.0, 5e-6), (25.0, 5e-6))
    with pytest.raises(KeyError):
        cluster.path_links(["h0:0", "x:0"])
