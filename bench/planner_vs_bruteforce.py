"""hetpilot's planner against brute force on small random heterogeneous cases.

    .venv/bin/python bench/planner_vs_bruteforce.py --cases 300 [--first-seed 0]
    .venv/bin/python bench/planner_vs_bruteforce.py --cases 90 --devices 5   # ~4 min

Each case: 3-4 devices (or ``--devices``; 4-5 layers from 5 devices on) of speeds up to 8x apart and memory from a third of the whole
model's footprint to 4 times it, one host each or two hosts with fast and slow links,
sometimes a link override; 4-8 layers, sometimes a heavy embedding first or a heavy
output layer last; optimizer factor 1, 3 or 7; microbatch 1-4, global batch 8-32;
1f1b, gpipe or both. Both plans are scored with the reference model (spec v1 section 5);
brute force (``planner/bruteforce.py``) is the optimum over every device subset, split
into ordered groups, cut, recompute choice and sample split. Prints the distribution of
hetpilot / brute force and the cases more than 2% slower. CPU only; no devices are
emulated (plans are only scored).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from typing import Any

from hetpilot.planner.bruteforce import brute_force
from hetpilot.planner.errors import InfeasibleError
from hetpilot.planner.refmodel import evaluate, stage_memory_mb
from hetpilot.planner.search import make_plan
from hetpilot.planner.types import Cluster, Device, Job, Layer, Link, Model, Network, Stage


def make_model(r: random.Random, n_layers: int) -> tuple[Model, str]:
    layers: list[dict[str, Any]] = []
    for i in range(n_layers):
        layers.append(dict(name=f"l{i}", fwd_gflop=r.uniform(5, 30), bwd_gflop=r.uniform(10, 60),
                           out_mb=r.uniform(1, 20), act_mb=r.uniform(50, 400), param_mb=r.uniform(50, 600)))
    shape = r.choice(["plain", "plain", "embed_first", "big_last", "both"])
    if shape in ("embed_first", "both"):  # embedding: many params, little compute
        layers[0].update(fwd_gflop=r.uniform(0.5, 3), bwd_gflop=r.uniform(1, 6),
                         param_mb=r.uniform(1500, 4000), act_mb=r.uniform(20, 100))
    if shape in ("big_last", "both"):  # big output layer: params and compute
        layers[-1].update(fwd_gflop=r.uniform(20, 60), bwd_gflop=r.uniform(40, 120),
                          param_mb=r.uniform(1500, 4000), act_mb=r.uniform(200, 800))
    opt = r.choice([1.0, 3.0, 7.0])
    return Model(name=f"fz-{shape}", optimizer_factor=opt,
                 layers=tuple(Layer(**spec) for spec in layers)), shape


def full_mem_gb(model: Model, micro: int, flight: int) -> float:
    st = Stage(device="x", layers=(0, model.num_layers))
    return stage_memory_mb(model, st, micro, flight) / 1000.0


def make_case(seed: int, devices: int | None = None) -> tuple[Cluster, Model, Job, dict[str, Any]]:
    """One random case; ``devices`` fixes the device count (default: 3 or 4). Five or more
    devices get 4-5 layers, so that brute force stays within minutes."""
    r = random.Random(seed)
    n = r.choice([3, 4, 4])
    if devices is not None:
        n = devices
    n_layers = r.randint(4, 8) if n == 3 else r.randint(4, 7) if n == 4 else r.randint(4, 5)
    model, shape = make_model(r, n_layers)
    micro = r.choice([1, 2, 4])
    gb = r.choice([m for m in range(8, 33) if m % micro == 0])
    base = r.choice([20.0, 50.0, 150.0])
    mults = [1.0, 1.5, 2.0, 3.0, 4.0, 8.0]
    speed_mode = r.choice(["mixed", "two_kinds", "one_fast"])
    if speed_mode == "mixed":
        tf = [base * r.choice(mults) for _ in range(n)]
    elif speed_mode == "two_kinds":
        a, b = base, base * r.choice(mults[1:])
        tf = [r.choice([a, b]) for _ in range(n)]
    else:
        tf = [base] * n
        tf[r.randrange(n)] = base * r.choice(mults[2:])
    # memory relative to whole-model footprint (1f1b with 1 in flight, no recompute)
    whole = full_mem_gb(model, micro, 1)
    mem_mode = r.choice(["ample", "some_small", "all_small", "mixed"])
    mem = []
    for _ in range(n):
        if mem_mode == "ample":
            f = r.uniform(1.5, 4)
        elif mem_mode == "some_small":
            f = r.choice([r.uniform(0.3, 0.8), r.uniform(1.2, 3)])
        elif mem_mode == "all_small":
            f = r.uniform(0.4, 0.9)
        else:
            f = r.uniform(0.3, 2.5)
        mem.append(round(whole * f, 3))
    host_mode = r.choice(["one_each", "two_hosts"])
    if host_mode == "one_each":
        hosts = [f"h{i}" for i in range(n)]
    else:
        hosts = (["h0", "h0", "h1", "h1"] if n == 4
                 else r.choice([["h0", "h0", "h1"], ["h0", "h1", "h1"]]) if n == 3
                 else ["h0"] * (n // 2) + ["h1"] * (n - n // 2))
    intra = r.choice([200.0, 600.0, 2400.0])
    inter = r.choice([5.0, 10.0, 25.0, 100.0]) if host_mode == "two_hosts" else r.choice([10.0, 25.0, 100.0, 400.0])
    lat = r.choice([0.0, 5.0, 20.0, 100.0])
    ids = [f"d{i}" for i in range(n)]
    device_links: list[Link] = []
    host_links: list[Link] = []
    if r.random() < 0.4:
        for _ in range(r.randint(1, 2)):
            a, b = r.sample(ids, 2)
            device_links.append(Link(a=a, b=b, gbps=r.choice([2.0, 5.0, 50.0, 1000.0]),
                                     latency_us=r.choice([None, 1.0, 200.0])))
    uniq_hosts = sorted(set(hosts))
    if len(uniq_hosts) >= 2 and r.random() < 0.3:
        a, b = r.sample(uniq_hosts, 2)
        host_links.append(Link(a=a, b=b, gbps=r.choice([3.0, 40.0, 200.0]), latency_us=r.choice([None, 50.0])))
    devices = tuple(Device(id=ids[i], host=hosts[i], tflops=tf[i], memory_gb=mem[i],
                           price_per_hour=1.0, power_watts=100.0) for i in range(n))
    cluster = Cluster(devices=devices, network=Network(intra_host_gbps=intra, inter_host_gbps=inter,
                                                       latency_us=lat, host_links=tuple(host_links),
                                                       device_links=tuple(device_links)))
    sched = r.choice([("1f1b", "gpipe"), ("1f1b", "gpipe"), ("1f1b",), ("gpipe",)])
    job = Job(global_batch=gb, microbatch_size=micro, schedules=sched)
    meta = dict(seed=seed, n=n, layers=n_layers, shape=shape, speed_mode=speed_mode, mem_mode=mem_mode,
                host_mode=host_mode, gb=gb, micro=micro, M=gb // micro, schedules=list(sched),
                opt=model.optimizer_factor, n_dlinks=len(device_links), n_hlinks=len(host_links), lat=lat)
    return cluster, model, job, meta


def _shape(plan: Any) -> str:
    return "; ".join(f"{'->'.join(g.devices)} {g.samples} "
                     f"{[tuple(s.layers) for s in g.stages]}" for g in plan.groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=None,
                    help="devices per case (default: 3 or 4 at random; 5+ take minutes a case)")
    args = ap.parse_args()
    ratios: list[float] = []
    plan_s: list[float] = []
    worse: list[str] = []
    for seed in range(args.first_seed, args.first_seed + args.cases):
        cluster, model, job, meta = make_case(seed, args.devices)
        _, bf_plan = brute_force(cluster, model, job)
        t0 = time.perf_counter()
        try:
            plan = make_plan(cluster, model, job)
        except InfeasibleError:
            plan = None
        plan_s.append(time.perf_counter() - t0)
        if bf_plan is None:
            ratios.append(1.0 if plan is None else math.nan)
            continue
        ours = (evaluate(cluster, model, plan, job.global_batch).iteration_s
                if plan is not None else math.inf)
        ratio = ours / evaluate(cluster, model, bf_plan, job.global_batch).iteration_s
        ratios.append(ratio)
        if ratio > 1.02:
            worse.append(f"seed {seed} ({meta['n']} devices, {meta['layers']} layers, "
                         f"{meta['shape']}, {'/'.join(job.schedules)}): {ratio:.3f}x; "
                         f"hetpilot {_shape(plan) if plan else 'infeasible'}; "
                         f"brute force {_shape(bf_plan)}")
    finite = sorted(r for r in ratios if not math.isnan(r))
    q = statistics.quantiles(finite, n=100) if len(finite) > 1 else finite * 99
    print(f"# hetpilot vs brute force: {len(ratios)} cases (seeds {args.first_seed}.."
          f"{args.first_seed + args.cases - 1}); scored plans only, nothing emulated")
    print(f"- over 1.02x: {len(worse)}; median {statistics.median(finite):.4f}x, p90 "
          f"{q[89]:.4f}x, p99 {q[98]:.4f}x, max {finite[-1]:.4f}x")
    print(f"- hetpilot planning time: median {statistics.median(plan_s):.3f} s, "
          f"max {max(plan_s):.2f} s")
    nan = sum(math.isnan(r) for r in ratios)
    if nan:
        print(f"- {nan} case(s) where brute force found no plan but hetpilot did (invalid?)")
    for line in worse:
        print(f"  - {line}")


if __name__ == "__main__":
    main()
