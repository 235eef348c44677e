"""Where hetpilot's model and Sailor's simulator part, plan by plan (issue 38, by hand).

For one cluster (A100 + V100 counts, converted as bench/sailor_compare.py does)
and each microbatch size, every degree pair of the two kinds, and on each the
search's quick v1 plan and its mixed pipelines in three orders per group (slow
devices first, as the search lays them out; fast first; and a "sandwich", the
slowest device first, the fast ones next, the rest of the slowest last, the
shape Sailor's planner picks on 96 + 160 and 192 + 576). Each plan is printed
with its time in spec 5 split into the slowest group's makespan and the sync,
three more readings of spec 5 (the sync with shared uplinks, ``robust``; the
makespan with transfers that do not overlap compute, ``blocking``, as Megatron's
1F1B without ``overlap_p2p_comm`` and Sailor's simulator run them), and Sailor's
score in its best form with its slowest pipeline and its sync::

    python bench/sailor_probe.py --sailor /path/to/sailor --gpus 96+160 --micro 1,2,4

The probe is for finding out why a case misses, not a planner: it plans every
degree pair (the search's descent visits a few) and does not refine cuts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path

from hetpilot.planner import tpsearch
from hetpilot.planner.errors import InfeasibleError
from hetpilot.planner.refmodel import GroupTimes, evaluate, group_makespan, group_op_times
from hetpilot.planner.structure_planner import Planner as StructurePlanner
from hetpilot.planner.structures import Structure, balanced_groups, searched_schedules
from hetpilot.planner.types import Cluster, Device, Job, Model, Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sailor_compare as sc  # a sibling script, not a package


def blocking_makespan(cluster: Cluster, model: Model, plan: Plan) -> float:
    """The slowest group's makespan when each forward ends with sending its output and
    each backward with sending its gradient (no transfer overlaps compute)."""
    out = 0.0
    for group in plan.groups:
        t = group_op_times(cluster, model, group, plan.microbatch_size)
        n = len(t.fwd)
        blocked = GroupTimes(
            tuple(f + (t.comm[j] if j + 1 < n else 0.0) for j, f in enumerate(t.fwd)),
            tuple(b + (t.comm[j - 1] if j else 0.0) for j, b in enumerate(t.bwd)),
            (0.0,) * len(t.comm))
        out = max(out, group_makespan(blocked, plan.schedule,
                                      group.samples // plan.microbatch_size))
    return out


def sandwich(group: Sequence[Device]) -> tuple[Device, ...]:
    """The slowest device first, the others fastest first, the rest of the slowest last."""
    slowest = min(d.tflops for d in group)
    by_speed = sorted(group, key=lambda d: -d.tflops)
    slow = [d for d in by_speed if d.tflops == slowest]
    return (slow[0], *(d for d in by_speed if d.tflops != slowest), *slow[1:])


def sailor_parts(sailor: sc.Sailor, plan: Plan, cluster: Cluster) -> tuple[str, float, float] | None:
    """Sailor's best form of the plan, its slowest pipeline and its sync; None where
    Sailor's check refuses it or a degree is not profiled."""
    if not sc._profiled(sailor, plan, cluster):
        return None
    if not sailor.sim.check_config_fits(sc.sailor_plan(plan, cluster, merge="none")[0]):
        return None
    best = None
    for merge in ("none", "samples", "cuts"):
        splan, micro = sc.sailor_plan(plan, cluster, merge=merge)
        with contextlib.redirect_stdout(io.StringIO()):  # Sailor prints every pipeline
            conv = sailor.rs.convert_homogeneous(splan, sailor.training_config)
            fwd, bwd, upd = sailor.time_tables(conv.mbs)
            pipe = max(sailor.sim.get_time_per_pipeline(
                p, conv.mbs, fwd, bwd, upd, sailor.sim.activation_sizes_per_layer, m)
                for p, m in zip(conv.pipeline_list, micro, strict=True))
            sync = sailor.sim.estimate_sync_time(conv)
        if best is None or pipe + sync < best[1] + best[2]:
            best = (merge, pipe, sync)
    return best


def candidates(virtual: tpsearch.TPChoice, model: Model, job: Job) -> list[tuple[str, Plan]]:
    """The quick v1 plan and the mixed pipelines in three orders, on a virtual cluster."""
    out = []
    with contextlib.suppress(InfeasibleError):
        out.append(("quick", tpsearch.quick_plan(virtual.cluster, model, job)))
    devices = virtual.cluster.devices
    if len({(d.tflops, d.memory_gb) for d in devices}) < 2:
        return out
    by_speed = sorted(devices, key=lambda d: -d.tflops)
    planner = StructurePlanner(virtual.cluster, model, job)
    schedule = searched_schedules(job)[0]
    counts = sorted({len(devices) // s for s in tpsearch.MIXED_STAGES
                     if s <= model.num_layers} - {0, 1})
    for k in counts:
        fast_first = balanced_groups(by_speed, k, slow_first=False)
        for name, groups in (("slow-first", [tuple(reversed(g)) for g in fast_first]),
                             ("fast-first", fast_first),
                             ("sandwich", [sandwich(g) for g in fast_first])):
            cand = planner.plan_structure(Structure(f"{name}-{k}", tuple(groups)), schedule)
            if cand is not None:
                out.append((f"{name}-{k}", cand.plan))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sailor", required=True, help="a Sailor checkout (a folder named sailor)")
    ap.add_argument("--gpus", required=True, help="A100+V100 counts, multiples of 4 (e.g. 96+160)")
    ap.add_argument("--micro", default="1,2,4", help="microbatch sizes")
    ap.add_argument("--top", type=int, default=20, help="rows printed, fastest in Sailor first")
    args = ap.parse_args(argv)
    try:
        a, v = (int(x) for x in args.gpus.split("+"))
    except ValueError:
        ap.error(f"--gpus: {args.gpus!r} is not A100+V100 counts")
    if a % sc.GPUS_PER_NODE or v % sc.GPUS_PER_NODE or a < 0 or v < 0:
        ap.error(f"--gpus: {args.gpus!r}: counts must be multiples of {sc.GPUS_PER_NODE}")
    sailor = sc.Sailor(Path(args.sailor))
    row = {f"{sc.KINDS[0]}_{sc.ZONE}": a, f"{sc.KINDS[1]}_{sc.ZONE}": v}
    rows = []
    for mbs in (int(m) for m in args.micro.split(",")):
        cluster, model = sc.hetpilot_inputs(sailor, row, mbs, tensor_parallel=True)
        job = Job(global_batch=sc.BATCH, microbatch_size=mbs, schedules=("1f1b",),
                  tensor_parallel=True)
        options = tpsearch.degrees(cluster, model)
        kinds = list(options)
        for degrees in itertools.product(*[(1, *options[k]) for k in kinds]):
            virtual = tpsearch.virtual_cluster(cluster, model, dict(zip(kinds, degrees,
                                                                        strict=True)), mbs)
            for name, vplan in candidates(virtual, model, job):
                plan = tpsearch._real_plan(vplan, virtual.members)
                judged = tpsearch._judged(cluster, model, job, plan)
                parts = sailor_parts(sailor, plan, cluster) if judged else None
                if judged is None or parts is None:
                    continue
                ev = evaluate(cluster, model, plan, sc.BATCH)
                assert ev.sync_s is not None
                rows.append((mbs, degrees, name, len(plan.groups), max(ev.makespans), ev.sync_s,
                             judged.seconds, judged.robust, blocking_makespan(cluster, model, plan),
                             parts[1] + parts[2], parts[0], parts[1], parts[2]))
    print(f"{a} + {v}: mbs, degrees (A100, V100), candidate, groups | spec 5: makespan + sync = "
          "T, robust T, blocking makespan | Sailor: T (form: pipeline + sync)")
    for r in sorted(rows, key=lambda r: r[9])[:args.top]:
        print(f"{r[0]} {r[1]} {r[2]:>14} {r[3]:>3} | {r[4]:.3f} + {r[5]:.3f} = {r[6]:.3f}, "
              f"{r[7]:.3f}, {r[8]:.3f} | {r[9]:.3f} ({r[10]}: {r[11]:.3f} + {r[12]:.3f})")
    if not rows:
        print("no plan that Sailor's check accepts")
        return 1
    best = min(rows, key=lambda r: r[6])
    print(f"spec 5's fastest: {best[0]} {best[1]} {best[2]}: {best[6]:.3f} in spec 5, "
          f"{best[9]:.3f} in Sailor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
