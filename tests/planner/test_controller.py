"""The Lyapunov controller and the switching-cost model, on hand-made plans.

A fake tentative search offers one data-parallel plan per device subset, each
scored with the reference model, so every number here can be checked by hand.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hetpilot.planner.candidates import Candidate, plan_costs
from hetpilot.planner.control_policies import POLICY_CLASSES
from hetpilot.planner.controller import POLICIES, Controller, ControllerConfig
from hetpilot.planner.errors import InfeasibleError, ValidationError
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.switching import CHECKPOINT, layer_owners, switch_cost
from hetpilot.planner.types import Cluster, Device, Group, Job, Layer, Model, Network, Plan, Stage

MODEL = Model(
    name="two",
    layers=(
        Layer(name="l0", fwd_gflop=10.0, bwd_gflop=20.0, out_mb=1.0, act_mb=1.0, param_mb=100.0),
        Layer(name="l1", fwd_gflop=10.0, bwd_gflop=20.0, out_mb=1.0, act_mb=1.0, param_mb=100.0),
    ),
    optimizer_factor=3.0,
)
BATCH, MICRO = 64, 8


def _cluster(**tflops: float) -> Cluster:
    spec = {"a": (100.0, 4.0), "b": (50.0, 1.0), "c": (50.0, 1.0)}
    devices = []
    for name, (tf, price) in spec.items():
        devices.append(Device(id=f"{name}:0", host=name, tflops=tflops.get(name, tf),
                              memory_gb=80.0, price_per_hour=price, power_watts=100.0))
    return Cluster(devices=tuple(devices),
                   network=Network(intra_host_gbps=1000.0, inter_host_gbps=10.0, latency_us=0.0))


def _dp(devices: Sequence[str]) -> Plan:
    n = len(devices)
    micro = BATCH // MICRO
    counts = [micro // n + (1 if i < micro % n else 0) for i in range(n)]
    return Plan(microbatch_size=MICRO, schedule="1f1b", groups=tuple(
        Group(samples=c * MICRO, stages=(Stage(device=d, layers=(0, 2)),))
        for d, c in zip(devices, counts, strict=True)))


def _candidate(cluster: Cluster, plan: Plan, label: str = "") -> Candidate:
    ev = evaluate(cluster, MODEL, plan, BATCH)
    assert ev.valid and ev.iteration_s is not None, ev.error
    return Candidate(plan, ev.iteration_s, plan_costs(cluster, plan), label)


def subsets_search(cluster: Cluster, model: Model, job: Job) -> list[Candidate]:
    ids = [d.id for d in cluster.devices]
    return [_candidate(cluster, _dp(c), "+".join(c))
            for k in range(1, len(ids) + 1) for c in itertools.combinations(ids, k)]


def _job(budget: float | None = None, V: float = 10.0) -> Job:
    budgets = {} if budget is None else {"price_per_hour": budget}
    return Job(global_batch=BATCH, microbatch_size=MICRO, budgets=budgets, V=V)


def _ctl(budget: float | None = None, V: float = 10.0, **config: object) -> Controller:
    cfg = ControllerConfig(**config)  # type: ignore[arg-type]
    return Controller(MODEL, _job(budget, V), cfg, search=subsets_search)


# -- queues -------------------------------------------------------------------

def test_queue_update_follows_the_formula_every_slot() -> None:
    ctl = _ctl(budget=3.0, V=1.0, hysteresis=0.0)
    cluster = _cluster()
    q = 0.0
    picked = set()
    for t in range(30):
        d = ctl.step(cluster)
        assert d.slot == t
        price = d.costs["price_per_hour"]
        picked.add(price)
        q = max(q + price - 3.0, 0.0)
        assert d.queues["price_per_hour"] == pytest.approx(q)
    assert len(picked) > 1  # the queue made it trade speed for cost


def test_queue_zero_picks_fastest_and_score_is_drift_plus_penalty() -> None:
    ctl = _ctl(budget=3.0, V=1.0)
    cluster = _cluster()
    d0 = ctl.step(cluster)
    fastest = min(subsets_search(cluster, MODEL, _job()), key=lambda c: c.iteration_s)
    assert set(d0.plan.devices) == set(fastest.plan.devices)
    assert d0.queues["price_per_hour"] == pytest.approx(max(d0.costs["price_per_hour"] - 3.0, 0))
    # with a backlog, the choice minimises V*T + Q*c over the candidates
    q = d0.queues["price_per_hour"]
    d1 = ctl.step(cluster)
    cands = subsets_search(cluster, MODEL, _job())
    best = min(c.score(1.0, {"price_per_hour": q}) for c in cands)
    chosen = next(c for c in cands if c.plan == d1.plan)
    assert chosen.score(1.0, {"price_per_hour": q}) <= best + 0.02 * 1.0 * d0.iteration_s + 1e-9


def test_binding_budget_holds_on_average() -> None:
    # V large enough that the backlog rarely empties (a small V under-spends: O(1/V))
    ctl = _ctl(budget=3.0, V=500.0, hysteresis=0.0)
    cluster = _cluster()
    costs = [ctl.step(cluster).costs["price_per_hour"] for _ in range(400)]
    avg = sum(costs[40:]) / len(costs[40:])
    assert avg <= 3.0 * 1.01
    assert avg >= 3.0 * 0.99  # binding: the controller spends what it may to go faster
    assert max(costs) > 3.0  # ... by time-sharing with a plan above the budget


def test_budget_change_mid_run() -> None:
    ctl = _ctl(budget=1.0, V=1.0)
    cluster = _cluster()
    for _ in range(20):
        d = ctl.step(cluster)
    assert d.costs["price_per_hour"] <= 2.0
    ctl.set_budgets({"price_per_hour": 100.0, "power_watts": 500.0})
    assert ctl.queues["power_watts"] == 0.0
    for _ in range(50):
        d = ctl.step(cluster)
    assert d.queues["price_per_hour"] == 0.0
    assert d.costs["price_per_hour"] >= 4.0  # rich again: the fast device is back in use
    ctl.set_budgets({"power_watts": 500.0})
    assert set(ctl.queues) == {"power_watts"}
    ctl.set_budgets(V=7.5)
    assert ctl.V == 7.5


@pytest.mark.parametrize(("budgets", "V", "field"), [
    ({"dollars": 1.0}, None, "budgets.dollars"),
    ({"price_per_hour": -1.0}, None, "budgets.price_per_hour"),
    # 1 / b**2 (the default V's weight) would leave floating point: the queue went to
    # inf and the stored state could not be loaded again (daemon fuzz, seed 23)
    ({"power_watts": 1e-300}, None, "budgets.power_watts"),
    ({"power_watts": 1e300}, None, "budgets.power_watts"),  # b**2 raised OverflowError
    (None, -1.0, "V"),
])
def test_set_budgets_rejects_bad_values_naming_the_field(budgets, V, field) -> None:  # type: ignore[no-untyped-def]
    ctl = _ctl(budget=3.0)
    with pytest.raises(ValidationError) as err:
        ctl.set_budgets(budgets, V)
    assert err.value.field == field
    assert ctl.budgets == {"price_per_hour": 3.0}


def test_budget_below_cheapest_plan_warns_once_and_does_its_best() -> None:
    ctl = _ctl(budget=0.5, V=1.0)
    cluster = _cluster()
    decisions = [ctl.step(cluster) for _ in range(10)]
    warned = [w for d in decisions for w in d.warnings]
    assert len(warned) == 1 and warned[0].startswith("job.budgets.price_per_hour")
    assert decisions[-1].costs["price_per_hour"] == 1.0  # the cheapest single device
    assert decisions[-1].queues["price_per_hour"] > decisions[5].queues["price_per_hour"]


def test_settling_charges_the_price_the_last_slot_really_had() -> None:
    ctl = _ctl(budget=10.0)
    cheap = _cluster()
    d = ctl.step(cheap)
    assert d.queues["price_per_hour"] == 0.0
    # the next observation shows the last slot's prices were higher
    pricey = Cluster(devices=tuple(
        Device(id=x.id, host=x.host, tflops=x.tflops, memory_gb=x.memory_gb,
               price_per_hour=x.price_per_hour * 10, power_watts=x.power_watts)
        for x in cheap.devices), network=cheap.network)
    real = plan_costs(pricey, d.plan)["price_per_hour"]
    d2 = ctl.step(pricey)
    q1 = max(real - 10.0, 0.0)
    assert q1 > 0
    assert d2.queues["price_per_hour"] == pytest.approx(max(q1 + d2.costs["price_per_hour"] - 10.0, 0))


# -- down devices, infeasibility ---------------------------------------------------

def test_down_device_forces_a_switch_and_never_appears() -> None:
    ctl = _ctl()
    full = _cluster()
    d0 = ctl.step(full)
    assert "a:0" in d0.plan.devices
    down = full.without({"a:0"})
    d1 = ctl.step(down)
    assert d1.switched and d1.forced and d1.version == 2
    assert "a:0" not in d1.plan.devices
    assert any("a:0" in w for w in d1.warnings)
    # the parameters the fast device held come from the survivors or the checkpoint
    assert d1.switch_mb >= 0.0
    d2 = ctl.step(full)  # back: the controller may move back, it is not forced to
    assert not d2.forced


def test_nothing_fits_raises_and_leaves_state_alone() -> None:
    ctl = Controller(MODEL, _job(3.0), search=lambda c, m, j: [])
    with pytest.raises(InfeasibleError):
        ctl.step(_cluster())
    assert ctl.plan is None and ctl.version == 0 and ctl.queues == {"price_per_hour": 0.0}


def test_search_without_running_plan_keeps_running_plan() -> None:
    calls = []

    def flaky(cluster: Cluster, model: Model, job: Job) -> list[Candidate]:
        calls.append(1)
        return subsets_search(cluster, model, job) if len(calls) == 1 else []

    ctl = Controller(MODEL, _job(), search=flaky)
    d0 = ctl.step(_cluster())
    d1 = ctl.step(_cluster())
    assert d1.plan == d0.plan and not d1.switched


# -- hysteresis and switching cost -------------------------------------------------

def _two_plans(cluster: Cluster, model: Model, job: Job) -> list[Candidate]:
    return [_candidate(cluster, _dp(["b:0"]), "b"), _candidate(cluster, _dp(["c:0"]), "c")]


def _two_splits(cluster: Cluster, model: Model, job: Job) -> list[Candidate]:
    """b and c as two replicas, with 5:3 or 3:5 of the microbatches: switching is free."""
    out = []
    for nb in (5, 3):
        plan = Plan(microbatch_size=MICRO, schedule="1f1b", groups=(
            Group(samples=nb * MICRO, stages=(Stage(device="b:0", layers=(0, 2)),)),
            Group(samples=(8 - nb) * MICRO, stages=(Stage(device="c:0", layers=(0, 2)),))))
        out.append(_candidate(cluster, plan, f"b{nb}"))
    return out


def _alternating(n: int, hysteresis: float) -> int:
    ctl = Controller(MODEL, _job(), ControllerConfig(hysteresis=hysteresis), search=_two_splits)
    switches = 0
    for t in range(n):
        # measurement noise: b and c take turns at being 1% faster
        bump = {"b": 50.5, "c": 50.0} if t % 2 else {"b": 50.0, "c": 50.5}
        # ... and so does the faster split (the sample split is what differs)
        switches += ctl.step(_cluster(**bump)).switched and t > 0
    return switches


def test_hysteresis_stops_flapping_on_noise() -> None:
    assert _alternating(20, hysteresis=0.0) >= 15  # without it: every other slot
    assert _alternating(20, hysteresis=0.02) == 0


def test_switch_only_when_saving_over_the_slot_beats_moving_cost() -> None:
    # b is running; c becomes 20% faster. Moving 400 MB over 10 Gbit/s takes 0.32 s.
    def run(iterations: int) -> bool:
        ctl = Controller(MODEL, _job(), ControllerConfig(iterations_per_slot=iterations,
                                                         hysteresis=0.0), search=_two_plans)
        assert ctl.step(_cluster(c=40.0)).plan.devices == ("b:0",)
        return ctl.step(_cluster(c=60.0)).switched

    t_b = _candidate(_cluster(), _dp(["b:0"])).iteration_s
    saving_per_iteration = t_b - t_b * 50.0 / 60.0
    move_s = 800.0 * 8 / (1000 * 10.0)  # two layers x 100 MB x (1 + 3)
    needed = move_s / saving_per_iteration
    assert not run(int(needed * 0.5))
    assert run(int(needed * 2) + 1)


def test_state_round_trip_gives_the_same_decisions() -> None:
    a = _ctl(budget=3.0, V=1.0)
    cluster = _cluster()
    for _ in range(7):
        a.step(cluster)
    state = json.loads(json.dumps(a.to_state()))
    b = Controller.from_state(MODEL, _job(3.0, 1.0), state, search=subsets_search)
    assert b.version == a.version and b.plan == a.plan and b.queues == a.queues
    for _ in range(10):
        da, db = a.step(cluster), b.step(cluster)
        assert (da.plan, da.version, dict(da.queues)) == (db.plan, db.version, dict(db.queues))


def test_a_tiny_v_then_the_default_keeps_the_queues_finite_and_storable() -> None:
    """The daemon's fuzz campaign: a budget of 0 W fills its queue, V = 5e-324 (a
    valid request) then V = 0 carried that queue as q / V = inf; the state was stored
    with Infinity and refused when read back, so the job never planned again."""
    ctl = _ctl(budget=3.0, V=10.0)
    cluster = _cluster()
    ctl.step(cluster)
    ctl.set_budgets({"price_per_hour": 3.0, "power_watts": 0.0})
    ctl.step(cluster)
    ctl.set_budgets(V=5e-324)
    ctl.step(cluster)
    assert ctl.queues["power_watts"] > 0
    ctl.set_budgets(V=0.0)
    decision = ctl.step(cluster)
    assert all(math.isfinite(q) for q in decision.queues.values()), decision.queues
    cheapest = min(plan_costs(cluster, c.plan)["power_watts"]
                   for c in ctl.candidates(cluster))
    assert decision.costs["power_watts"] == cheapest  # the full queue: the fewest watts
    text = json.dumps(ctl.to_state(), allow_nan=False)
    resumed = Controller.from_state(MODEL, _job(3.0, 0.0), json.loads(text),
                                    search=subsets_search)
    assert resumed.queues == ctl.queues
    # a state stored before the bound, with an infinite queue, is read back
    old = json.loads(text)
    old["queues"]["power_watts"] = math.inf
    assert math.isfinite(Controller.from_state(MODEL, _job(3.0, 0.0), old,
                                               search=subsets_search).queues["power_watts"])


def test_from_state_names_bad_fields() -> None:
    state = _ctl(budget=3.0).to_state()
    state["queues"] = {"price_per_hour": "lots"}
    with pytest.raises(ValidationError) as err:
        Controller.from_state(MODEL, _job(3.0), state)
    assert err.value.field == "state.queues.price_per_hour"


# -- policies -----------------------------------------------------------------------

def test_every_policy_name_has_its_class() -> None:
    """ControllerConfig accepts the names of POLICIES; each must build a policy of that name."""
    assert sorted(POLICY_CLASSES) == sorted(POLICIES)
    for name in POLICIES:
        ctl = Controller(MODEL, _job(), ControllerConfig(policy=name))
        assert ctl._policy.name == name


def test_budget_greedy_fits_every_slot_and_fastest_ignores_budgets() -> None:
    cluster = _cluster()
    greedy = _ctl(budget=3.0, policy="budget-greedy")
    fastest = _ctl(budget=3.0, policy="fastest")
    for _ in range(5):
        g, f = greedy.step(cluster), fastest.step(cluster)
        assert g.costs["price_per_hour"] <= 3.0
    cands = subsets_search(cluster, MODEL, _job())
    assert f.iteration_s == pytest.approx(min(c.iteration_s for c in cands))
    assert f.costs["price_per_hour"] > 3.0
    fitting = [c for c in subsets_search(cluster, MODEL, _job()) if c.costs["price_per_hour"] <= 3]
    assert g.iteration_s == pytest.approx(min(c.iteration_s for c in fitting))


def test_static_keeps_its_plan_until_a_device_goes_down() -> None:
    ctl = _ctl(budget=3.0, policy="static")
    d0 = ctl.step(_cluster())
    for _ in range(3):
        assert ctl.step(_cluster(b=5.0)).plan == d0.plan  # slowed, yet kept
    gone = d0.plan.devices[0]
    d = ctl.step(_cluster().without({gone}))
    assert d.switched and gone not in d.plan.devices


def _fast_links(**tflops: float) -> Cluster:
    """Links so fast that the plan over all three devices is the fastest."""
    return replace(_cluster(**tflops), network=Network(intra_host_gbps=1e4, inter_host_gbps=1e4,
                                                       latency_us=0.0))


def test_static_drops_the_groups_of_a_down_device_and_takes_them_back() -> None:
    ctl = _ctl(policy="static")  # no budget: it picks the fastest plan, all three devices
    d0 = ctl.step(_fast_links())
    assert len(d0.plan.groups) == 3
    d1 = ctl.step(_fast_links().without({"b:0"}))
    assert d1.switched and d1.version == 2
    kept = [g.stages for g in d0.plan.groups if g.stages[0].device != "b:0"]
    assert [g.stages for g in d1.plan.groups] == kept  # nothing re-cut, nothing moved
    assert d1.plan.global_batch == BATCH and d1.switch_cost_s == 0.0
    assert any("wait for down devices" in w for w in d1.warnings)
    assert ctl.step(_fast_links().without({"b:0"})).plan == d1.plan and ctl.version == 2
    state = json.loads(json.dumps(ctl.to_state()))
    resumed = Controller.from_state(MODEL, _job(), state, ControllerConfig(policy="static"),
                                    search=subsets_search)
    back = resumed.step(_fast_links())  # b returns: the plan chosen once, whole again
    assert back.switched and back.plan == d0.plan and back.version == 3
    assert back.switch_cost_s > 0.0  # b receives its layers again


def test_static_replan_keeps_the_plan_it_re_planned() -> None:
    ctl = _ctl(policy="static-replan")
    d0 = ctl.step(_fast_links())
    d1 = ctl.step(_fast_links().without({"b:0"}))
    assert d1.switched and "b:0" not in d1.plan.devices
    d2 = ctl.step(_fast_links())
    assert not d2.switched and d2.plan == d1.plan != d0.plan


def test_config_is_validated() -> None:
    with pytest.raises(ValidationError, match=r"config\.policy"):
        ControllerConfig(policy="yolo")
    with pytest.raises(ValidationError, match=r"config\.hysteresis"):
        ControllerConfig(hysteresis=-1)
    with pytest.raises(ValidationError, match=r"config\.local_search_budget: must be >= 0"):
        ControllerConfig(local_search_budget=-1)


# -- switching cost -----------------------------------------------------------------

def test_switch_cost_counts_only_layers_a_device_did_not_hold() -> None:
    cluster = _cluster()
    old = _dp(["a:0", "b:0"])
    assert switch_cost(cluster, MODEL, old, old).mb == 0.0
    assert switch_cost(cluster, MODEL, None, old).seconds == 0.0
    # samples moved between the same stages: nothing to move
    shifted = Plan(microbatch_size=MICRO, schedule="1f1b", groups=(
        Group(samples=48, stages=old.groups[0].stages), Group(samples=16, stages=old.groups[1].stages)))
    assert switch_cost(cluster, MODEL, old, shifted).free
    # c joins: it needs both layers, 2 x 100 MB x (1 + 3), over a 10 Gbit/s link
    new = _dp(["a:0", "b:0", "c:0"])
    sw = switch_cost(cluster, MODEL, old, new)
    assert sw.mb == pytest.approx(800.0)
    assert dict(sw.received_mb) == {"c:0": pytest.approx(800.0)}
    assert sw.seconds == pytest.approx(800.0 * 8 / (1000 * 10.0))


def test_switch_cost_reads_the_checkpoint_when_holders_are_down() -> None:
    cluster = _cluster()
    old = _dp(["a:0"])
    new = Plan(microbatch_size=MICRO, schedule="1f1b", groups=(Group(samples=BATCH, stages=(
        Stage(device="b:0", layers=(0, 1)), Stage(device="c:0", layers=(1, 2)))),))
    alive = switch_cost(cluster, MODEL, old, new)
    dead = switch_cost(cluster.without({"a:0"}), MODEL, old, new)
    assert alive.mb == dead.mb == pytest.approx(800.0)
    # from a:0 both transfers leave one sender in turn (ties go to a live holder);
    # from the checkpoint they run in parallel
    assert alive.seconds == pytest.approx(2 * 400.0 * 8 / (1000 * 10.0))
    assert dead.seconds == pytest.approx(400.0 * 8 / (1000 * 10.0))
    assert layer_owners(new) == {"b:0": {0}, "c:0": {1}}
    assert CHECKPOINT.startswith("<")


# -- big clusters: cost-aware subsets searched narrowly -------------------------------

class _RecordingSearch:
    """A fake search that says which (cluster size, pairs) it was asked for."""

    def __init__(self, narrowable: bool) -> None:
        self.narrowable = narrowable
        self.calls: list[tuple[int, object]] = []

    def __call__(self, cluster: Cluster, model: Model, job: Job, *,
                 pairs: object = None) -> list[Candidate]:
        self.calls.append((len(cluster.devices), pairs))
        plan = _dp([cluster.devices[0].id])
        return [Candidate(plan, 1.0, plan_costs(cluster, plan), "all/host"),
                Candidate(plan, 2.0, plan_costs(cluster, plan), "baseline/even-dp")]


def _big(n: int = 80) -> Cluster:
    return Cluster(devices=tuple(Device(id=f"h{i // 8}:{i % 8}", host=f"h{i // 8}", tflops=100.0,
                                        memory_gb=80.0, price_per_hour=1.0 + (i % 3))
                                 for i in range(n)),
                   network=Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=5.0))


@pytest.mark.parametrize("narrowable", [True, False])
def test_big_cluster_cost_subsets_reuse_the_best_structures(narrowable: bool) -> None:
    search = _RecordingSearch(narrowable)
    Controller(MODEL, _job(budget=50.0), search=search).step(_big())
    assert search.calls[0] == (80, None)
    subsets = search.calls[1:]
    assert len(subsets) == 5 and all(n < 80 for n, _ in subsets)
    expected = [("host", "1f1b")] if narrowable else None
    assert all(p == expected for _, p in subsets)


def test_structure_pairs_reads_planner_labels() -> None:
    from hetpilot.planner.search import structure_pairs

    plan = _dp(["a:0"])
    custom = replace(plan, schedule="custom")
    found = [Candidate(plan, 3.0, {}, "all/dp"), Candidate(custom, 1.0, {}, "above35/host+eager2"),
             Candidate(plan, 0.5, {}, "baseline/megatron"), Candidate(plan, 2.0, {}, "all/host")]
    assert structure_pairs(found, 3) == [("host", "1f1b"), ("dp", "1f1b")]
    assert structure_pairs(found, 1) == [("host", "1f1b")]


def test_candidates_are_what_a_slot_weighs() -> None:
    ctl = _ctl(budget=3.0, V=1.0)
    cluster = _cluster()
    plans = {c.plan for c in ctl.candidates(cluster)}
    assert len(plans) == 7  # subsets_search's every non-empty subset of three devices
    assert ctl.step(cluster).plan in plans
    assert ctl.version == 1  # weighing does not step


def test_following_prices_beats_every_fixed_plan_at_the_same_average_cost() -> None:
    # device a's price swings 1 <-> 7 every 10 slots (mean 4): drift-plus-penalty
    # buys a when it is cheap, which no plan chosen once can do within the budget
    cheap, dear = _cluster(), Cluster(
        devices=tuple(replace(d, price_per_hour=7.0) if d.id == "a:0" else d
                      for d in _cluster().devices),
        network=_cluster().network)
    truth = [cheap if (t // 10) % 2 == 0 else dear for t in range(400)]
    budget = 3.5
    ctl = _ctl(budget=budget, V=200.0, hysteresis=0.0)
    times, costs = [], []
    for t, cluster in enumerate(truth):
        d = ctl.step(truth[t - 1] if t else cluster)  # it sees the previous slot's truth
        ev = evaluate(cluster, MODEL, d.plan, BATCH)
        assert ev.iteration_s is not None
        times.append(ev.iteration_s)
        costs.append(plan_costs(cluster, d.plan)["price_per_hour"])
    assert sum(costs[40:]) / len(costs[40:]) <= budget * 1.01
    ours = sum(times) / len(times)
    fixed = []
    for cand in subsets_search(cheap, MODEL, _job()):
        avg_cost = sum(plan_costs(c, cand.plan)["price_per_hour"] for c in truth) / len(truth)
        if avg_cost <= budget:
            fixed.append(cand.iteration_s)
    assert fixed and ours < min(fixed)
