"""Compare policies on the scenario library; print a markdown table.

    .venv/bin/python bench/sim_compare.py examples/scenarios/spot-price.json \\
        [--policies lyapunov,static,budget-greedy,fastest] [--slots N] [--noise F --seed S]
        [--local-search-budget N]

Per policy: average iteration time (reference model on each slot's truth,
and with switching time charged), average cost rates, the same after the
transient (first tenth of the slots), the ratio to the budget, switches,
and the speed-up of lyapunov over each policy.
"""

from __future__ import annotations

import argparse
import time

from hetpilot.planner.controller import planner_search
from hetpilot.sim.engine import simulate, summarize
from hetpilot.sim.policies import CachedSearch
from hetpilot.sim.scenario import Timeline, load_scenario


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--policies", default="lyapunov,static,budget-greedy,fastest")
    ap.add_argument("--slots", type=int)
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--V", type=float, dest="V")
    ap.add_argument("--local-search-budget", type=int,
                    help="the controllers' plannings per schedule per slot (default: "
                         "ControllerConfig's; 0: no carried local search)")
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    tl = Timeline(sc, args.slots)
    search = CachedSearch(planner_search, size=256)
    rows = []
    for name in args.policies.split(","):
        t0 = time.perf_counter()
        recs = list(simulate(sc, name, slots=args.slots, noise=args.noise, seed=args.seed,
                             V=args.V, timeline=tl, search=search,
                             local_search_budget=args.local_search_budget))
        s = summarize(recs)
        s["wall_s"] = time.perf_counter() - t0
        rows.append(s)
    ref = rows[0]["avg_effective_iteration_s"]
    kinds = list(rows[0]["budgets"]) or ["price_per_hour"]
    head = ["policy", "avg T s", "avg T+switch s", f"{rows[0]['policy']} speed-up"]
    for k in kinds:
        head += [f"avg {k}", f"tail avg {k} / budget"]
    head += ["switches", "max Q", "wall s"]
    print(f"scenario `{args.scenario}`, {rows[0]['slots']} slots, noise {args.noise}, "
          f"seed {args.seed}, tail = after slot {rows[0]['transient_slots']}\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for s in rows:
        cells = [s["policy"], f"{s['avg_iteration_s']:.4f}", f"{s['avg_effective_iteration_s']:.4f}",
                 f"{s['avg_effective_iteration_s'] / ref:.2f}x"]
        for k in kinds:
            cells.append(f"{s[f'avg_{k}']:.3f}")
            b = s["tail_avg_budgets"].get(k)
            cells.append(f"{s[f'tail_avg_{k}'] / b:.4f}" if b else "-")
        cells += [str(s["switches"]), " ".join(f"{v:.1f}" for v in s["max_queues"].values()) or "-",
                  f"{s['wall_s']:.1f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
