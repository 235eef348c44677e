"""Planner benchmark: plan quality against baselines, brute force and the ideal bound,
and planning latency against cluster size.

    .venv/bin/python bench/planner_bench.py            # full run, writes bench/RESULTS-planner.md
    .venv/bin/python bench/planner_bench.py --quick    # smaller, for a look

All times are reference-model iteration times (spec v1 section 5) on emulated
clusters built from bench-realistic device profiles (hetpilot.planner.catalog):
nothing here runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hetpilot.planner import catalog, serde
from hetpilot.planner.baselines import BASELINES
from hetpilot.planner.bruteforce import brute_force
from hetpilot.planner.errors import InfeasibleError
from hetpilot.planner.refmodel import evaluate, ideal_time
from hetpilot.planner.search import make_plan
from hetpilot.planner.types import Job, Layer, Model

ROOT = Path(__file__).resolve().parent

CASES = [
    # (name, hosts, inter-host Gbit/s, model, global batch, microbatch)
    ("A100+V100+T4 / gpt2-small", [("A100", 4), ("V100", 4), ("T4", 4)], 25.0, "gpt2-small", 256, 4),
    ("H100+A10G / bert-large", [("H100", 8), ("A10G", 4), ("A10G", 4)], 100.0, "bert-large", 512, 8),
    ("A100x2 + RTX3090x2 / gpt2-xl", [("A100", 8), ("A100", 8), ("RTX3090", 4), ("RTX3090", 4)],
     25.0, "gpt2-xl", 512, 2),
    ("H100+A100+V100+L4 / llama-7b", [("H100", 8), ("A100", 8), ("V100", 8), ("L4", 8)], 100.0,
     "llama-7b", 512, 1),
    ("A100x4 + V100x4 / llama-13b", [("A100", 8)] * 4 + [("V100", 8)] * 4, 100.0, "llama-13b",
     1024, 1),
    ("T4x4 + L4x2 / vgg16", [("T4", 4)] * 4 + [("L4", 4)] * 2, 10.0, "vgg16", 1024, 32),
    ("V100 + A10G + T4 / bert-large", [("V100", 4), ("A10G", 4), ("T4", 8)], 25.0, "bert-large",
     256, 4),
    ("H100 + 3x RTX3090 hosts / gpt2-small", [("H100", 2), ("RTX3090", 4), ("RTX3090", 4),
                                              ("RTX3090", 4)], 10.0, "gpt2-small", 256, 8),
]


def quality(quick: bool) -> tuple[list[str], list[float]]:
    rows = ["| case | devices | hetpilot (s) | even-dp | uniform-pp | megatron | balanced-homog. "
            "| best baseline / hetpilot | efficiency (ideal / T) | plan time (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    speedups = []
    for name, hosts, inter, model_name, batch, micro in CASES[: 3 if quick else None]:
        cluster = catalog.make_cluster(hosts, inter_host_gbps=inter)
        model = catalog.MODELS[model_name]()
        job = Job(global_batch=batch, microbatch_size=micro, schedules=("1f1b", "gpipe", "custom"))
        t0 = time.perf_counter()
        plan = make_plan(cluster, model, job)
        took = time.perf_counter() - t0
        ours = evaluate(cluster, model, plan, batch)
        assert ours.valid and ours.iteration_s is not None, ours.error
        base = {}
        for policy in BASELINES:
            try:
                res = evaluate(cluster, model, make_plan(cluster, model, job, policy=policy), batch)
                base[policy] = res.iteration_s if res.valid else math.inf
            except InfeasibleError:
                base[policy] = math.inf
        best = min(base.values())
        assert ours.iteration_s <= best * (1 + 1e-9), (name, ours.iteration_s, best)
        speedups.append(best / ours.iteration_s)
        cells = " | ".join("OOM" if math.isinf(v) else f"{v:.3f}" for v in base.values())
        rows.append(f"| {name} | {len(cluster.devices)} | {ours.iteration_s:.3f} | {cells} | "
                    f"{best / ours.iteration_s:.2f}x | {ideal_time(cluster, model, batch) / ours.iteration_s:.2f} | {took:.2f} |")
    return rows, speedups


def _tiny_model(n_layers: int, seed: int) -> Model:
    r = random.Random(seed)
    return Model(name=f"tiny{seed}", optimizer_factor=7.0, layers=tuple(
        Layer(name=f"l{i}", fwd_gflop=r.uniform(5, 40), bwd_gflop=r.uniform(10, 80),
              out_mb=r.uniform(1, 30), act_mb=r.uniform(50, 600), param_mb=r.uniform(50, 900))
        for i in range(n_layers)))


def small_cases(quick: bool) -> tuple[list[str], float]:
    rows = ["| case | devices | layers | brute force (s) | hetpilot (s) | gap |",
            "|---|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for seed in range(4 if quick else 12):
        r = random.Random(seed)
        n_dev = 4 if (quick or seed % 2 == 0) else 5
        kinds = [r.choice(list(catalog.DEVICES)) for _ in range(n_dev)]
        hosts = [(kinds[0], 2)] + [(k, 1) for k in kinds[2:]]
        cluster = catalog.make_cluster(hosts, inter_host_gbps=r.choice([10.0, 25.0, 100.0]))
        model = _tiny_model(r.choice([5, 6]) if n_dev == 5 else r.choice([5, 6, 7, 8]), seed)
        job = Job(global_batch=24, microbatch_size=4, schedules=("1f1b", "gpipe"))
        best, _ = brute_force(cluster, model, job)
        ours = evaluate(cluster, model, make_plan(cluster, model, job), job.global_batch)
        assert ours.valid and ours.iteration_s is not None
        gap = ours.iteration_s / best - 1
        worst = max(worst, gap)
        rows.append(f"| {'+'.join(kinds)} | {len(cluster.devices)} | {model.num_layers} | "
                    f"{best:.4f} | {ours.iteration_s:.4f} | {100 * gap:+.2f}% |")
    return rows, worst


def latency(quick: bool) -> list[str]:
    rows = ["| devices | hosts | model layers | wall time, in process (s) | wall time, `hetpilot plan` "
            "incl. start-up, one core, median of 3 (s) | CPU time of that process (s) |",
            "|---:|---:|---:|---:|---:|---:|"]
    model = catalog.MODELS["llama-13b"]()  # 42 layers
    kinds = ["H100", "A100", "V100", "A10G"]
    sizes = [16, 64, 256, 1024] if quick else [16, 64, 256, 1024, 4096]
    tmp = ROOT / ".tmp"
    tmp.mkdir(exist_ok=True)
    (tmp / "model.json").write_text(json.dumps(serde.model_to_dict(model)))
    for n in sizes:
        cluster = catalog.make_cluster([(kinds[i % 4], 8) for i in range(n // 8)])
        job = Job(global_batch=max(512, n * 2), microbatch_size=1, schedules=("1f1b", "gpipe", "custom"))
        t0 = time.perf_counter()
        make_plan(cluster, model, job)
        inproc = time.perf_counter() - t0
        (tmp / "cluster.json").write_text(json.dumps(serde.cluster_to_dict(cluster)))
        walls, cpus = [], []
        for _ in range(3):
            wall, cpu = _plan_subprocess(tmp, job.global_batch)
            walls.append(wall)
            cpus.append(cpu)
        rows.append(f"| {n} | {n // 8} | {model.num_layers} | {inproc:.2f} | "
                    f"{statistics.median(walls):.2f} (max {max(walls):.2f}) | "
                    f"{statistics.median(cpus):.2f} |")
    return rows


def _plan_subprocess(tmp: Path, batch: int) -> tuple[float, float]:
    """Wall and CPU seconds of one `hetpilot plan` process pinned to one core."""
    one_core = {min(os.sched_getaffinity(0))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hetpilot", "plan", "--cluster", str(tmp / "cluster.json"),
                    "--model", str(tmp / "model.json"), "--batch", str(batch),
                    "--microbatch", "1", "--out", str(tmp / "plan.json")], check=True,
                   preexec_fn=lambda: os.sched_setaffinity(0, one_core))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "RESULTS-planner.md"))
    args = parser.parse_args()
    q_rows, speedups = quality(args.quick)
    s_rows, worst = small_cases(args.quick)
    l_rows = latency(args.quick)
    geo = statistics.geometric_mean(speedups)
    text = "\n".join([
        "# Planner benchmark",
        "",
        "Reproduce: `.venv/bin/python bench/planner_bench.py` (2-core machine, CPU only; clusters",
        "are emulated from the device profiles in `planner/catalog.py`, times are reference-model",
        "iteration times of spec v1 section 5).",
        "",
        "## Iteration time: hetpilot against the baselines users would otherwise pick",
        "",
        *q_rows,
        "",
        f"Geometric-mean speedup over the best baseline: **{geo:.2f}x** "
        f"(never worse on any case: asserted).",
        "",
        "## Small cases against the brute-force optimum",
        "",
        "Exhaustive over device subsets, groupings, stage orders, cuts, forced recompute,",
        "microbatch splits, gpipe and 1f1b (`planner/bruteforce.py`).",
        "",
        *s_rows,
        "",
        f"Worst gap: **{100 * worst:+.2f}%** (target: within 2%).",
        "",
        "## Planning latency against cluster size (llama-13b, 42 layers)",
        "",
        *l_rows,
        "",
        "Start-up includes Python and the imports. cvxpy is imported only when an assignment LP",
        "has a bound active at its optimum (its interior optimum is closed-form, planner/assign.py);",
        "the import is about 0.85 s of CPU where it happens (here: 64 devices).",
        "",
    ])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
