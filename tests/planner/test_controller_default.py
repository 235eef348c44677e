"""The controller's default V (a job giving ``V = 0``): the learned exchange rate
between seconds and dollars, its debt, and time-sharing of two plans as a
schedule of slots whose switches are paid for (issue 17).

The fake searches offer data-parallel plans on the three-device cluster of
``test_controller.py`` (a: 100 TFLOP/s at $4/h; b and c: 50 TFLOP/s at $1/h;
a model of 3840 GFLOP per iteration, 800 MB of parameters and optimizer state),
so every number can be checked by hand: a alone takes 0.0384 s an iteration,
b alone 0.0768 s, and moving the whole model between two hosts over the
10 Gbit/s network takes 800 * 8 / 10000 = 0.64 s.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hetpilot.planner.candidates import Candidate, budget_multiplier, frontier, plan_costs
from hetpilot.planner.controller import Controller, ControllerConfig
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.types import Cluster, Device, Job, Layer, Model, Network

from .test_controller import (
    BATCH,
    MICRO,
    MODEL,
    _candidate,
    _cluster,
    _dp,
    _fast_links,
    subsets_search,
)

T_A, T_B = 0.0384, 0.0768
MOVE_S = 800.0 * 8 / (1000 * 10.0)


def _a_or_b(cluster: Cluster, model: Model, job: Job) -> list[Candidate]:
    return [_candidate(cluster, _dp([d]), d) for d in ("a:0", "b:0") if d in cluster.by_id]


def _default(budget: float, search=_a_or_b, **config: object) -> Controller:  # type: ignore[no-untyped-def]
    job = Job(global_batch=BATCH, microbatch_size=MICRO, budgets={"price_per_hour": budget}, V=0.0)
    return Controller(MODEL, job, ControllerConfig(**config), search=search)  # type: ignore[arg-type]


def _run(ctl: Controller, slots: int,
         cluster: Cluster | None = None) -> tuple[list[float], list[float], list[float], int]:
    """Costs, iteration times, switching seconds per slot, and plan versions."""
    cluster = cluster or _cluster()
    costs, times, moves = [], [], []
    for _ in range(slots):
        d = ctl.step(cluster)
        costs.append(d.costs["price_per_hour"])
        times.append(d.iteration_s)
        moves.append(d.switch_cost_s)
    return costs, times, moves, ctl.version


def test_the_hand_numbers() -> None:
    cluster = _cluster()
    a, b = _candidate(cluster, _dp(["a:0"])), _candidate(cluster, _dp(["b:0"]))
    assert a.iteration_s == pytest.approx(T_A) and b.iteration_s == pytest.approx(T_B)


def test_time_sharing_two_plans_beats_both_alone() -> None:
    """Budget $2/h, plans a ($4/h, 0.0384 s) and b ($1/h, 0.0768 s), 1000 iterations a slot.

    Alone: b fits and takes 0.0768 s; a takes 0.0384 s but costs twice the budget.
    The offline optimum mixes them: a share x of a with 4x + 1(1 - x) = 2, so
    x = 1/3, costs $2/h and takes (1/3) 0.0384 + (2/3) 0.0768 = 0.0640 s, 17%
    faster than b alone. The learned rate is the kink between them, 0.0384 / 3 =
    0.0128 s per $/h, where both are equally good.

    A plan runs whole slots, so the mix is a cycle of n slots with two switches
    of 0.64 s each. Mixing gains x (0.0768 - 0.0384) s = 0.0128 s an iteration,
    12.8 s a slot; the two switches must cost at most 10% of that over the
    cycle: 1.28 / n <= 1.28, n >= 1; holding one slot of a and two of b needs
    n >= 3. So n = 3 and band = 3 / (2 (1/(4-2) + 1/(2-1))) = 1: b while the
    schedule's running total E of cost over the budget is above -1, a while it
    is below 1. From E = 0: b (E = -1), a (E = +1), b (E = 0), b (-1), a (+1),
    ... one slot of a in three, $2/h on average, 2 switches a cycle: 66.7 plan
    versions per 100 slots, and an average iteration of 0.0640 s +
    2 * 0.64 s / (3 * 1000) = 0.06443 s with the switches charged.

    (``repay_slots`` is made huge so that the target stays the budget: no debt
    builds up here anyway, the schedule holds the budget slot by slot.
    ``mix_after=1`` lets the schedule start on the first slot; by default it
    waits until 25 slots have shown this frontier, checked at the end.)
    """
    ctl = _default(2.0, iterations_per_slot=1000, mix_overhead=0.1, repay_slots=10**6, mix_after=1)
    costs, times, moves, versions = _run(ctl, 300)
    assert sum(costs) / len(costs) == pytest.approx(2.0, rel=0.01)
    pattern = ["a" if c == 4.0 else "b" for c in costs]
    assert "".join(pattern[:9]) == "babbabbab"
    mean_t = sum(times) / len(times) + sum(moves) / (len(times) * 1000)
    assert mean_t == pytest.approx(0.0640 + 2 * MOVE_S / 3000, rel=0.01)
    assert mean_t < T_B  # better than the plan that fits, alone
    assert versions == pytest.approx(200, abs=3)  # 2 switches every 3 slots
    assert all(m == pytest.approx(MOVE_S) for m, p, q in zip(moves[1:], pattern, pattern[1:], strict=False)
               if p != q)
    late = _default(2.0, iterations_per_slot=1000, mix_overhead=0.1, repay_slots=10**6)
    late_costs, _, _, _ = _run(late, 40)
    assert set(late_costs[:24]) == {1.0} and 4.0 in late_costs[24:]  # no schedule before slot 25


def test_no_time_sharing_when_switches_cost_more_than_mixing_gains() -> None:
    """With 10 iterations a slot mixing gains 0.128 s a slot; two switches of
    0.64 s need a cycle of 1.28 / (0.1 * 0.128) = 100 slots, beyond the 50
    allowed: the controller keeps b, the plan that fits, and does not flap."""
    ctl = _default(2.0, iterations_per_slot=10)
    costs, _, _, versions = _run(ctl, 100)
    assert versions == 1
    assert set(costs) == {1.0}


def test_budget_on_a_plan_holds_that_plan() -> None:
    """Issue 17's flapping, by hand: with links fast enough that data
    parallelism scales, the frontier is b ($1/h, 0.0768 s), b + c ($2/h,
    0.03856 s: the gradient sync is nearly free) and a + b + c ($6/h,
    0.02901 s); a alone (0.0384 s at $4/h) lies above the chord from b + c to
    a + b + c. At a $2/h budget the rate that makes b + c the best runs from
    the slope on its right, (0.03856 - 0.02901) / 4 = 0.00239, to the slope on
    its left, 0.0768 - 0.03856 = 0.03824; the controller takes the middle
    (0.0203 s per $/h for the linear programme; the smoothed programme,
    ``learn_smoothing``, still leaks to the neighbours near the two ends, so
    its middle is a little lower), and keeps b + c: one plan version, no
    alternation between the plans either side of the budget."""
    cluster = _fast_links()
    ctl = _default(2.0, search=subsets_search, iterations_per_slot=1000)
    costs, _, _, versions = _run(ctl, 60, cluster)
    assert versions == 1
    assert set(costs) == {2.0}
    lam = ctl.to_state()["learned"]["price_per_hour"]
    assert 2 * 0.00239 < lam < 0.03824 / 2  # far from both kinks, not on an edge of the range
    hard = _default(2.0, search=subsets_search, iterations_per_slot=1000, learn_smoothing=0.0)
    _run(hard, 5, cluster)
    assert hard.to_state()["learned"]["price_per_hour"] == pytest.approx(0.5 * (0.00239 + 0.03824),
                                                                         rel=0.01)


def test_explicit_V_is_the_contract() -> None:
    """A job's own V keeps spec section 6: empty queue, the fastest plan first."""
    job = Job(global_batch=BATCH, microbatch_size=MICRO, budgets={"price_per_hour": 2.0}, V=1.0)
    ctl = Controller(MODEL, job, search=_a_or_b)
    d = ctl.step(_cluster())
    assert d.costs["price_per_hour"] == 4.0 and d.V == 1.0
    assert d.queues["price_per_hour"] == pytest.approx(2.0)


def test_default_V_reports_its_units() -> None:
    """V = default_v * b^2 / T_ref: T_ref is b's 0.0768 s (the fastest plan that fits)."""
    ctl = _default(2.0, iterations_per_slot=1000)
    assert ctl.V == 0.0 and ctl.effective_V is None
    d = ctl.step(_cluster())
    assert pytest.approx(25.0 * 4 / T_B) == d.V
    assert ctl.effective_V == pytest.approx(d.V)


def test_default_V_state_round_trip_gives_the_same_decisions() -> None:
    a = _default(2.0, iterations_per_slot=1000)
    cluster = _cluster()
    for _ in range(7):
        a.step(cluster)
    state = json.loads(json.dumps(a.to_state()))
    job = Job(global_batch=BATCH, microbatch_size=MICRO, budgets={"price_per_hour": 2.0}, V=0.0)
    b = Controller.from_state(MODEL, job, state, ControllerConfig(iterations_per_slot=1000),
                              search=_a_or_b)
    for _ in range(10):
        da, db = a.step(cluster), b.step(cluster)
        assert (da.plan, da.version, dict(da.queues)) == (db.plan, db.version, dict(db.queues))


def test_setting_the_same_budgets_again_changes_nothing() -> None:
    """The daemon re-applies the job's budgets and V after every restart."""
    ctl = _default(2.0, iterations_per_slot=1000)
    for _ in range(5):
        ctl.step(_cluster())
    before = ctl.to_state()
    ctl.set_budgets({"price_per_hour": 2.0}, 0.0)
    assert ctl.to_state() == before


def test_switching_between_default_and_explicit_V_keeps_the_shadow_price() -> None:
    ctl = _default(2.0, iterations_per_slot=1000)
    for _ in range(4):
        d = ctl.step(_cluster())
    lam = d.queues["price_per_hour"] / d.V  # seconds per $/h the queue stood for
    ctl.set_budgets(V=5.0)
    assert ctl.queues["price_per_hour"] == pytest.approx(5.0 * lam)
    with pytest.raises(ValidationError):
        ctl.set_budgets(V=-1.0)


def test_debt_is_repaid() -> None:
    """Budget $4.5/h: a alone ($4/h) is the fastest plan and fits, so the rate is 0
    and the controller banks $0.5/h a slot. One slot a costs $40/h (seen a slot
    late, as reports arrive). The rate is learned from what the choices paid,
    so that slot stays in the window as a slot where a paid $40/h: the debt and
    that reserve are repaid on b ($1/h) for a few slots, and then a runs again
    for good (the run stays under the budget: nothing faster than a exists)."""
    base = _cluster()
    dear = Cluster(devices=tuple(
        Device(id=d.id, host=d.host, tflops=d.tflops, memory_gb=d.memory_gb,
               price_per_hour=d.price_per_hour * (10 if d.id == "a:0" else 1),
               power_watts=d.power_watts) for d in base.devices), network=base.network)
    truth = [dear if t == 20 else base for t in range(120)]
    ctl = _default(4.5, search=subsets_search, iterations_per_slot=1000)
    paid = []
    for t, cl in enumerate(truth):
        d = ctl.step(truth[t - 1] if t else cl)
        paid.append(plan_costs(cl, d.plan)["price_per_hour"])
    assert paid[:21] == [4.0] * 20 + [40.0]
    assert min(paid[21:40]) < 4.0  # repaying
    assert paid[40:] == [4.0] * 80  # repaid
    assert 4.0 <= sum(paid) / len(paid) <= 4.5
    assert sum(1 for c in paid if c < 4.0) <= 12  # $36/h-slots over budget, $3.5/h a slot on b


# -- frontier and the learned rate --------------------------------------------------------

def test_frontier_is_the_lower_convex_hull() -> None:
    pts = [(1, 0.4), (2, 0.2), (2, 0.3), (3, 0.1), (4, 0.081), (4.5, 0.09), (5, 0.0687),
           (6, 0.05), (9, 0.038)]
    c, t = frontier(pts)
    # (5, 0.0687) lies above the chord from (4, 0.081) to (6, 0.05): 0.0655
    assert c.tolist() == [1, 2, 3, 4, 6, 9]
    assert t.tolist() == [0.4, 0.2, 0.1, 0.081, 0.05, 0.038]


def test_smoothed_rate_follows_the_target_where_the_lp_pins_it() -> None:
    """Two plans, a ($4/h, 0.0384 s) and b ($1/h, 0.0768 s), in every slot of the window.
    For any target between $1/h and $4/h the linear programme's rate is their kink,
    s = 0.0384 / 3 = 0.0128 s per $/h: a debt that lowers the target moves nothing.

    Smoothed (temperature tau = 0.01 * 0.0384 s), a slot takes a with probability
    p = 1 / (1 + exp(3 (lam - s) / tau)), so spending 1 + 3 p = b_t needs
    lam = s + (tau / 3) ln((1 - p) / p) with p = (b_t - 1) / 3: at $2/h
    s + 0.000128 ln 2, at $3/h s - 0.000128 ln 2. The rate rises as the target
    falls, and goes to the kink as the temperature does."""
    f = frontier([(1.0, 0.0768), (4.0, 0.0384)])
    s, tau = 0.0384 / 3, 0.01 * 0.0384
    for target, sign in ((2.0, 1.0), (3.0, -1.0)):
        assert budget_multiplier([f, f], target) == pytest.approx(s)
        assert budget_multiplier([f, f], target, smooth=0.01) == pytest.approx(
            s + sign * tau / 3 * math.log(2), rel=1e-6)
        assert budget_multiplier([f, f], target, smooth=1e-6) == pytest.approx(s, rel=1e-6)
    rates = [budget_multiplier([f, f], b, smooth=0.01) for b in (1.5, 2.0, 2.5, 3.0, 3.5)]
    assert all(x is not None and y is not None and x > y
               for x, y in itertools.pairwise(rates))  # strictly: the debt always moves it
    # the budget on a plan: the smoothed rate keeps to the range that makes it the best
    g = frontier([(1.0, 0.0768), (2.0, 0.03856), (6.0, 0.02901)])
    lam = budget_multiplier([g], 2.0, smooth=0.01)
    assert lam is not None and 2 * 0.00239 < lam < 0.03824 / 2


def test_smoothed_rate_beyond_the_steepest_segment() -> None:
    """One slot, plans (1, 1.0 s) and (2, 0.99 s): the segment's slope is s = 0.01, and
    the bisection's first upper bound is 2 s. Smoothed (tau = 0.01 * 0.99 s), the dear plan
    has probability p = 1 / (1 + exp((lam - s) / tau)), so a budget of 1.1 (p = 0.1) needs
    lam = s + tau ln 9 = 0.0318, beyond that bound: the search must go on past it."""
    f = frontier([(1.0, 1.0), (2.0, 0.99)])
    assert budget_multiplier([f], 1.1, smooth=0.01) == pytest.approx(
        0.01 + 0.0099 * math.log(9), rel=1e-6)


def test_budget_multiplier_by_hand() -> None:
    f = frontier([(1, 0.4), (2, 0.2), (3, 0.1), (4, 0.081), (6, 0.05), (9, 0.038)])
    # between plans: the slope of their segment (a tie, to be mixed)
    assert budget_multiplier([f], 5.0) == pytest.approx((0.081 - 0.05) / 2)
    # on a plan: the middle of the slopes on either side
    assert budget_multiplier([f], 4.0) == pytest.approx(0.5 * ((0.1 - 0.081) / 1 + (0.081 - 0.05) / 2))
    assert budget_multiplier([f], 9.0) == 0.0
    assert budget_multiplier([f], 0.5) is None
    # two slots, one where the budget buys much less: one rate for both
    g = (f[0] * 2, f[1])
    lam = budget_multiplier([f, g], 4.0)
    assert lam is not None

    def spend(lam: float) -> float:
        return float(np.mean([fr[0][np.argmin(fr[1] + lam * fr[0])] for fr in (f, g)]))

    assert spend(lam * 1.001) <= 4.0 < spend(lam * 0.999)


def test_oracle_dual_matches_the_primal_lp() -> None:
    """sim/oracle.py solves the LP of bench/sim_oracle.py by its dual; cvxpy agrees."""
    cp = pytest.importorskip("cvxpy")
    from hetpilot.sim.oracle import oracle_from_points

    rng = np.random.default_rng(3)
    times, costs = [], []
    for _ in range(12):
        n = int(rng.integers(3, 9))
        c = rng.uniform(1, 10, n)
        times.append(rng.uniform(0.8, 1.2, n) / c)
        costs.append(c * rng.uniform(0.5, 1.5))
    w = np.full(12, 1 / 12)
    for budget in (3.0, 5.0):
        ours = oracle_from_points(times, costs, w, budget)
        x = [cp.Variable(len(t), nonneg=True) for t in times]
        avg_t = sum(wi * (xi @ t) for wi, xi, t in zip(w, x, times, strict=True))
        avg_c = sum(wi * (xi @ c) for wi, xi, c in zip(w, x, costs, strict=True))
        problem = cp.Problem(cp.Minimize(avg_t), [avg_c <= budget] + [cp.sum(xi) == 1 for xi in x])
        problem.solve()
        assert ours.iteration_s == pytest.approx(problem.value, rel=1e-6)


# -- the demo's cluster with the real planner (issue 17's flapping) ------------------------------

def _demo() -> tuple[Cluster, Model]:
    devices = []
    for host, tflops, count, price in (("hostA", 1e-4, 2, 3.0), ("hostB", 5e-5, 1, 2.0),
                                       ("hostC", 2.5e-5, 1, 1.0)):
        for i in range(count):
            devices.append(Device(id=f"{host}:{i}", host=host, tflops=tflops, memory_gb=16.0,
                                  price_per_hour=price, power_watts=100.0))

    def lin(name: str, i: int, o: int) -> Layer:
        f = 2 * i * o / 1e9
        return Layer(name=name, fwd_gflop=f, bwd_gflop=2 * f, out_mb=4 * o / 1e6,
                     act_mb=4 * (i + o) / 1e6, param_mb=4 * (i * o + o) / 1e6)

    model = Model(name="mlp", optimizer_factor=3.0,
                  layers=(lin("fc1", 64, 128), lin("fc2", 128, 128), lin("fc3", 128, 10)))
    return Cluster(devices=tuple(devices), network=Network(
        intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=50.0)), model


def test_demo_cluster_holds_the_four_dollar_plan() -> None:
    """$3/$6 alternation every 1-2 slots at a $4/h budget (issue 17): the plan
    offline planning finds at $4/h (a fast device with the slowest one) is among
    the candidates, and the default keeps it."""
    from hetpilot.planner.search import candidate_plans

    cluster, model = _demo()
    job = Job(global_batch=64, microbatch_size=4, budgets={"price_per_hour": 4.0}, V=0.0)
    at_budget = [c for c in candidate_plans(cluster, model, job)
                 if c.costs["price_per_hour"] == 4.0]
    assert at_budget
    ctl = Controller(model, job, ControllerConfig(iterations_per_slot=50))
    decisions = [ctl.step(cluster) for _ in range(14)]
    assert ctl.version == 1
    assert {d.costs["price_per_hour"] for d in decisions} == {4.0}
    best = min(at_budget, key=lambda c: c.iteration_s)
    ev = evaluate(cluster, model, decisions[-1].plan, 64)
    assert ev.iteration_s == pytest.approx(best.iteration_s, rel=1e-6)
    assert math.isfinite(decisions[-1].V) and decisions[-1].V > 0


# -- the one-slot lag: learning from what the choices paid (issue 17) ------------------------

def test_budget_multiplier_learns_from_what_the_choices_paid() -> None:
    """Two slots with one frontier as seen, $1 0.4 s, $2 0.2 s, $4 0.1 s (slopes 0.2
    and 0.05 s per $/h); the second slot's prices doubled after it was decided
    (the controller sees a slot's prices one slot late), so its choices paid
    $2, $4, $8. Budget $2.5/h.

    As seen: the $2 plan in both slots spends $2 <= 2.5, so the rate is the
    kink 0.05 between $2 and $4, and a share (2.5 - 2) / (4 - 2) = 1/4 of the
    tied slots takes $4. As paid: the $2 plan in both pays (2 + 4) / 2 = $3 >
    2.5; the $1 plan pays (1 + 2) / 2 = 1.5; the rate is the kink 0.2 between
    $1 and $2 and a share (2.5 - 1.5) / (3 - 1.5) = 2/3 takes $2."""
    from hetpilot.planner.candidates import tie_share

    f = frontier([(1, 0.4), (2, 0.2), (4, 0.1)])
    seen = budget_multiplier([f, f], 2.5)
    assert seen == pytest.approx(0.05)
    assert tie_share([f, f], seen, 2.5) == pytest.approx(0.25)
    paid = [f[0], 2 * f[0]]
    lam = budget_multiplier([f, f], 2.5, paid=paid)
    assert lam == pytest.approx(0.2)
    assert tie_share([f, f], lam, 2.5, paid=paid) == pytest.approx(2 / 3)
    assert tie_share([f, f], 0.1, 2.5, paid=paid) == 0.0  # no tie at 0.1


def test_lagged_reference_by_hand() -> None:
    """Plans cheap ($1, 1 s) and dear ($3, 0.5 s) in two slots; the second
    slot's prices double after it is decided (seen $1/$3, paid $2/$6); budget $2.5/h.

    Knowing both slots' prices (the oracle): dear in the first ($3), cheap in
    the second ($2): $2.5/h, 0.75 s. Deciding on the prices seen, both slots
    tie at one rate 0.25 (1 + 0.25 = 0.5 + 0.75); dear everywhere pays
    (3 + 6) / 2 = 4.5, cheap 1.5, so a third dear: 0.5 / 3 + 1 * 2 / 3 = 0.8333 s."""
    from hetpilot.sim.oracle import lagged_from_points, oracle_from_points

    t = np.array([1.0, 0.5])
    seen = [np.array([1.0, 3.0])] * 2
    paid = [np.array([1.0, 3.0]), np.array([2.0, 6.0])]
    full = oracle_from_points([t, t], paid, [0.5, 0.5], 2.5)
    assert full.iteration_s == pytest.approx(0.75)
    lag = lagged_from_points([t, t], seen, paid, 2.5)
    assert lag.iteration_s == pytest.approx(0.5 / 3 + 2 / 3)
    assert lag.cost == pytest.approx(2.5)
    assert lag.multiplier == pytest.approx(0.25)


def test_a_large_debt_is_repaid_at_a_bounded_rate() -> None:
    """The frontier of test_budget_on_a_plan_holds_that_plan: b ($1/h, 0.0768 s),
    b + c ($2/h, 0.03856 s), a + b + c ($6/h, 0.02901 s); slopes 0.03824 and
    0.00239 s per $/h. At a $3/h budget the rate is the kink 0.00239 between
    b + c and a + b + c (the controller time-shares them; the smoothed rate,
    ``learn_smoothing``, lies within 5% of the kink).

    A debt of $30/h-slots spread over 25 slots would ask for $1.8/h, below b +
    c: the rate would jump 16-fold to 0.03824 and the controller would repay on
    b alone, twice as slow. The rate may be at most (1 + repay_rate) = 2 times
    the budget's, so the horizon doubles to 50 slots: the target is 3 - 30 / 50
    = $2.4/h, the rate stays near 0.00239 (the linear programme's stays on it;
    the smoothed one rises a little with the debt), and the debt is repaid by
    running less of a + b + c, never b."""
    cluster = _fast_links()
    ctl = _default(3.0, search=subsets_search, iterations_per_slot=1000)
    for _ in range(5):
        ctl.step(cluster)
    assert ctl.to_state()["learned"]["price_per_hour"] == pytest.approx(0.00239, rel=0.05)
    ctl._rate.debt["price_per_hour"] = 30.0
    costs = []
    for _ in range(20):
        costs.append(ctl.step(cluster).costs["price_per_hour"])
        if len(costs) == 1:
            assert ctl._rate.horizon == 50
            assert ctl._rate.target("price_per_hour", 3.0) == pytest.approx(3.0 - 30.0 / 50,
                                                                           rel=0.01)
        # the smoothed rate rises with the debt, but no further than twice the budget's
        assert 0.00239 * 0.95 < ctl.to_state()["learned"]["price_per_hour"] < 2 * 0.00239
    assert 1.0 not in costs  # never b alone
    assert ctl._rate.debt["price_per_hour"] < 30.0  # repaying


@pytest.mark.parametrize("budget", [1e-200, 5e-324, 1e-10])
def test_a_vanishing_budget_is_refused_naming_the_field(budget: float) -> None:
    """A positive budget below MIN_BUDGET (1e-9) is refused: the default V weighs a queue
    by 1 / b**2 and rescales queues by it, which left floating point (the daemon fuzz
    found 1e-200 dividing by zero, and 1e-300 sending a queue to inf, after which the
    stored state could not be loaded again). 0 ("spend nothing") and 1e-9 are taken."""
    with pytest.raises(ValidationError) as err:
        _default(budget)
    assert err.value.field == "job.budgets.price_per_hour"
    for ok in (0.0, 1e-9):
        ctl = _default(ok)
        costs, _, _, _ = _run(ctl, 3)
        cheapest = min(c.costs["price_per_hour"] for c in _a_or_b(_cluster(), MODEL, ctl.job))
        assert costs[-1] == pytest.approx(cheapest)  # nothing fits: the cheapest plan
