"""The best any policy could do on a scenario's prices: an offline bound.

    .venv/bin/python bench/sim_oracle.py examples/scenarios/spot-price.json [--budgets 20,24,28]

The oracle knows every slot's truth in advance, pays nothing to switch, and
may split a slot between plans (time-sharing). Over the plans the controller
weighs each slot (``Controller.candidates``) it solves the linear program

    min  (1/T) sum_t sum_i x_ti T_ti
    s.t. (1/T) sum_t sum_i x_ti c_ti <= budget,  sum_i x_ti = 1,  x >= 0

with cvxpy, grouping slots whose truth is the same. Drift-plus-penalty
approaches this bound as V grows (O(1/V)); a plan chosen once cannot beat
it at the same average cost. One cost kind: ``price_per_hour``.
"""

from __future__ import annotations

import argparse

import cvxpy as cp
import numpy as np
from hetpilot.planner.controller import Controller, ControllerConfig, planner_search
from hetpilot.sim.policies import CachedSearch
from hetpilot.sim.scenario import Timeline, load_scenario

KIND = "price_per_hour"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario")
    ap.add_argument("--budgets", help="comma list of budgets (default: the scenario's)")
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    tl = Timeline(sc)
    ctl = Controller(sc.model, sc.job, ControllerConfig(iterations_per_slot=sc.iterations_per_slot),
                     search=CachedSearch(planner_search))
    states: dict[tuple[object, ...], list[int]] = {}
    truths = {}
    for t in range(sc.slots):
        truth = tl.truth(t)
        key = tuple((d.id, d.tflops, d.price_per_hour) for d in truth.devices) + truth.network.host_links
        states.setdefault(key, []).append(t)
        truths[key] = truth
    times, costs, weights = [], [], []
    for key, slots in states.items():
        cands = ctl.candidates(truths[key])
        times.append(np.array([c.iteration_s for c in cands]))
        costs.append(np.array([c.costs.get(KIND, 0.0) for c in cands]))
        weights.append(len(slots) / sc.slots)
    x = [cp.Variable(len(t), nonneg=True) for t in times]
    budget = cp.Parameter(nonneg=True)
    avg_t = sum(w * (xi @ t) for w, xi, t in zip(weights, x, times, strict=True))
    avg_c = sum(w * (xi @ c) for w, xi, c in zip(weights, x, costs, strict=True))
    problem = cp.Problem(cp.Minimize(avg_t), [avg_c <= budget] + [cp.sum(xi) == 1 for xi in x])
    budgets = ([float(b) for b in args.budgets.split(",")] if args.budgets
               else [sc.job.budgets[KIND]])
    print(f"{args.scenario}: {sc.slots} slots, {len(states)} distinct truths, "
          f"{sum(len(t) for t in times)} candidate plans")
    print("| budget $/h | oracle avg T s |")
    print("|---|---|")
    for b in budgets:
        budget.value = b
        problem.solve()
        shown = "infeasible" if problem.status != cp.OPTIMAL else f"{problem.value:.4f}"
        print(f"| {b:g} | {shown} |")


if __name__ == "__main__":
    main()
