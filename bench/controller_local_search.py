"""The controller's carried local search on the published profiles: how many slots it
takes to reach ``hetpilot plan``'s plan.

    .venv/bin/python bench/controller_local_search.py [--slots 20] [--only vgg16] [--budget 24]

For each case of ``bench/planner_profiles.py`` on 5-16 devices: the fastest candidate of
the search alone (what the controller had before it carried a local search), the plan of
``make_plan`` (the search plus a 300-planning local search per schedule at once), and the
``fastest`` controller (hysteresis 0, budgets off, slots of 10^9 iterations so that any
faster plan is worth its switch) stepping ``--slots`` slots on the same
cluster with ``local_search_budget`` ``--budget``: its plan's iteration time after 1, 5 and
all slots, the first slot at which it is within 0.01% of make_plan's, the largest step
time and the mappings its descent planned. Prints only the cases where the controller's
first slot differs from make_plan's; the last line counts all.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=20)
    ap.add_argument("--only")
    ap.add_argument("--budget", type=int, default=24)
    args = ap.parse_args()
    import planner_profiles as pp
    from hetpilot.planner.controller import Controller, ControllerConfig
    from hetpilot.planner.errors import InfeasibleError
    from hetpilot.planner.refmodel import evaluate
    from hetpilot.planner.search import candidate_plans, make_plan

    print(f"controller local_search_budget {args.budget}, {args.slots} slots, fastest policy, "
          "hysteresis 0, 10^9 iterations a slot; iteration times in s (spec v1 reference "
          "model)\n")
    print("| case | devices | search alone | make_plan | slot 1 | slot 5 | "
          f"slot {args.slots} | reaches make_plan at slot | max step s | planned |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = reached = 0
    for case in pp.cases(False, args.only):
        n = len(case.cluster.devices)
        if not 5 <= n <= 16:
            continue
        model = pp.load_model(case.model_case)
        job = replace(case.job, budgets={}, V=0.0)
        try:
            alone = min(c.iteration_s for c in candidate_plans(case.cluster, model, job, focus=3))
            want = evaluate(case.cluster, model, make_plan(case.cluster, model, job),
                            job.global_batch).iteration_s
        except InfeasibleError:
            continue
        assert want is not None
        ctl = Controller(model, job, ControllerConfig(
            policy="fastest", hysteresis=0.0, iterations_per_slot=10**9,
            local_search_budget=args.budget))
        times, steps = [], []
        for _ in range(args.slots):
            t0 = time.perf_counter()
            times.append(ctl.step(case.cluster).iteration_s)
            steps.append(time.perf_counter() - t0)
        at = next((i + 1 for i, t in enumerate(times) if t <= want * 1.0001), None)
        cases += 1
        reached += at is not None
        if at == 1:
            continue
        print(f"| {case.name} | {n} | {alone:.4f} | {want:.4f} | {times[0]:.4f} | "
              f"{times[min(4, args.slots - 1)]:.4f} | {times[-1]:.4f} | "
              f"{at if at is not None else 'not in ' + str(args.slots)} | {max(steps):.2f} | "
              f"{ctl.local_search_planned} |", flush=True)
    print(f"\n{reached} of {cases} cases reach make_plan's plan within {args.slots} slots")


if __name__ == "__main__":
    main()
