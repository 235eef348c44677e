"""Time one controller slot on the 1024-device scenario, on one core.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sim_controller_1024.py [--steps 6]

Measures separately, side by side in one process:
- ``search``: one call of the planner's ``candidate_plans`` on the cluster;
- ``controller``: one ``Controller.step`` given that search's candidates
  (settling the queues, re-scoring the running plan with the reference model,
  scoring every candidate, switching costs, queue update), alternating
  between the nominal cluster and one with 32 slowed devices so that the
  running plan is re-evaluated and switches are priced each step;
- ``full slots`` (``--full``, measured first, each configuration from cold
  memos): every slot of the scenario with the default search, cost-aware
  subsets off and on, split into slots right after an event (the cluster
  changed: groups must be re-cut) and steady slots (the memo of cuts
  answers).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from hetpilot.planner.controller import Controller, ControllerConfig
from hetpilot.planner.memos import clear_memos
from hetpilot.planner.search import candidate_plans
from hetpilot.sim.scenario import Scenario, Timeline, load_scenario

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default=str(ROOT / "examples/scenarios/cluster-1024.json"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--full", action="store_true", help="also time full steps, search included")
    args = ap.parse_args()
    sc = load_scenario(args.scenario)
    tl = Timeline(sc)
    if args.full:  # first, on cold memos: nothing below has searched these clusters yet
        _full_slots(sc, tl)
    clusters = [tl.truth(0), tl.truth(5)]  # nominal; 32 devices slowed
    t0 = time.perf_counter()
    found = {id(c): candidate_plans(c, sc.model, sc.job) for c in clusters}
    search_s = (time.perf_counter() - t0) / len(clusters)
    print(f"devices {len(clusters[0].devices)}, candidates {len(found[id(clusters[0])])}")
    print(f"search (candidate_plans), mean of {len(clusters)}: {search_s:.3f} s")

    def lookup(cluster, model, job):  # type: ignore[no-untyped-def]
        return found.get(id(cluster), [])

    ctl = Controller(sc.model, sc.job, ControllerConfig(cost_subsets=False), search=lookup)
    ctl.step(clusters[0])
    times = []
    switched = 0
    for i in range(args.steps):
        t = time.perf_counter()
        d = ctl.step(clusters[(i + 1) % 2])
        times.append(time.perf_counter() - t)
        switched += d.switched
    print(f"controller step without search: median {statistics.median(times):.3f} s, "
          f"max {max(times):.3f} s over {args.steps} steps ({switched} switched)")


def _full_slots(sc: Scenario, tl: Timeline) -> None:
    """Every slot of the scenario, search included, as the simulator drives it
    (the controller sees the previous slot's truth). CPU seconds of this
    process, so that another job on the other core does not count."""
    events = sorted({e.slot for e in sc.events})
    for subsets in (False, True):
        clear_memos()  # each configuration starts cold, like a daemon just started
        ctl = Controller(sc.model, sc.job, ControllerConfig(cost_subsets=subsets,
                                                            iterations_per_slot=sc.iterations_per_slot))
        changed, steady = [], []
        for t in range(sc.slots):
            seen = max(t - 1, 0)
            start = time.process_time()
            ctl.step(tl.truth(seen))
            cpu = time.process_time() - start
            (changed if t == 0 or seen in events else steady).append(cpu)
        print(f"full slots, search included, cost_subsets={subsets}: "
              f"{len(changed)} slots after a change (the first included): median {statistics.median(changed):.2f} s, "
              f"max {max(changed):.2f} s; {len(steady)} steady slots: median {statistics.median(steady):.2f} s, "
              f"max {max(steady):.2f} s; after a change, slot by slot: "
              f"{', '.join(f'{t:.2f}' for t in changed)}")

if __name__ == "__main__":
    main()
