"""The 4-rank emulated trainer bench's tensor-parallel case (issue 40): a plan with a 2-way
tensor-parallel stage against the best plan without, measured and predicted side by side.

EMULATED devices (target-time, as ``bench/trainer_bench.py --mode target``): 4 CPU ranks
(gloo, one thread each) declared as devices of ``base_tflops * speed`` TFLOP/s with
relative speeds 1, 1, 0.5, 0.25 on one host; each stage's forward and backward of a
microbatch last at least their FLOPs at that speed. A tensor-parallel stage's ops last
what spec 5.6 gives them (:func:`hetpilot.trainer.placement.emulated_targets`: each split
layer's work / t, plus its all-reduces over the measured gloo link); the all-reduces and
the split compute themselves are real (torch.distributed.tensor over gloo).

Job: ``hetpilot.trainer.examples:gpt_tp`` (q/k/v and the MLP's up projection colwise,
attention output and down projection rowwise), profiled with its ``tp_plan`` (the
``tp_comm_mb`` / ``tp_allreduces`` that ``hetpilot profile`` writes). The global batch is
one microbatch, too small for data parallelism: without tensor parallelism the best plan
(``hetpilot.planner.search.make_plan``) runs on one device; with it
(``hetpilot.planner.tpsearch.make_tp_plan``, or the 2-way stage on the two fast devices
when the planner picks another degree) the blocks split over two.

Steps: measure the gloo network (as trainer_bench does); build the spec cluster (the
emulated speeds, the measured link) and model (the profile); plan; one
:class:`~hetpilot.trainer.runtime.Trainer` on 4 ranks switches live between the two plans
``--repeats`` times (alternating), warms up one iteration per visit and times
``--iterations``; measured: the median per-iteration time over the visits; predicted:
:func:`hetpilot.planner.refmodel.evaluate`.

Run: .venv/bin/python bench/trainer_tp.py [--base-tflops 0.002 --micro 8 --iterations 3 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.search import make_plan
from hetpilot.planner.serde import cluster_from_dict, model_from_dict, plan_from_dict, plan_to_dict
from hetpilot.planner.tpsearch import make_tp_plan
from hetpilot.planner.types import Job
from hetpilot.trainer.examples import gpt_tp
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.profile import layer_times, profile_model
from hetpilot.trainer.runtime import Trainer, TrainerConfig
from trainer_bench import SPEEDS, _net_worker, run_ranks


def _job(cfg: dict[str, Any]) -> dict[str, Any]:
    return gpt_tp(vocab=cfg["vocab"], seq_len=cfg["seq_len"], d_model=cfg["d_model"],
                  heads=cfg["heads"], blocks=cfg["blocks"])


def _worker(rank: int, world: int, out: str, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    job = _job(cfg)
    trainer = Trainer(
        job["layers"], job["loss"], job["optimizer"], job["dataset"],
        TrainerConfig(global_batch=cfg["batch"], device_id=f"emu:{rank}",
                      emulate_tflops=cfg["base_tflops"] * SPEEDS[rank],
                      layer_gflop=cfg["layer_gflop"], split_model=model_from_dict(cfg["profile"]),
                      tp_link=tuple(cfg["tp_link"]), tp_plan=job["tp_plan"],
                      overlap_sync=False))
    results: dict[str, list[float]] = {name: [] for name in cfg["plans"]}
    switches: dict[str, list[float]] = {name: [] for name in cfg["plans"]}
    order = list(cfg["plans"])
    for rep in range(cfg["repeats"]):
        for name in order if rep % 2 == 0 else order[::-1]:
            switches[name].append(trainer.switch(plan_from_dict(cfg["plans"][name]))["total_s"])
            trainer.train_step()  # warm up (a new mesh's first collectives)
            dist.barrier()
            started = time.perf_counter()
            for _ in range(cfg["iterations"]):
                trainer.train_step()
            dist.barrier()
            results[name].append((time.perf_counter() - started) / cfg["iterations"])
    Path(out, f"rank{rank}.json").write_text(json.dumps({"iteration_s": results,
                                                         "switch_s": switches}))


def _two_way(plan: Any) -> bool:
    return any(len(s.devices) == 2 for g in plan.groups for s in g.stages)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-tflops", type=float, default=0.002,
                    help="EMULATED TFLOP/s of a speed-1 rank")
    ap.add_argument("--micro", type=int, default=8, help="microbatch = global batch")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg: dict[str, Any] = {"vocab": 256, "seq_len": args.seq_len, "d_model": args.d_model,
                           "heads": 4, "blocks": args.blocks, "batch": args.micro,
                           "base_tflops": args.base_tflops, "iterations": args.iterations,
                           "repeats": args.repeats}
    print(f"EMULATED devices (target-time): 4 CPU ranks of "
          f"{', '.join(f'{args.base_tflops * s:g}' for s in SPEEDS)} TFLOP/s on one host; "
          "each stage op sleeps until its FLOPs at that speed (split work / t plus the "
          "all-reduces for a tensor-parallel stage, spec 5.6) have elapsed")
    job = _job(cfg)
    sample = job["dataset"][: args.micro][0]
    prof = profile_model(job["layers"], sample, name="gpt_tp", tp_plan=job["tp_plan"])
    cfg["profile"] = prof
    cfg["layer_gflop"] = [(la["fwd_gflop"], la["bwd_gflop"]) for la in prof["layers"]]
    real = sum(f + b for f, b in layer_times(job["layers"], sample, repeats=5))
    emulated = args.micro * sum(f + b for f, b in cfg["layer_gflop"]) / (1000 * args.base_tflops)
    print(f"real compute of the batch through all layers (alone): {real:.4f} s; emulated on "
          f"the fastest rank: {emulated:.4f} s ({emulated / real:.1f}x headroom)")
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_net_worker, 4, (tmp, args.d_model * args.seq_len, args.micro), 120)
        net = json.loads(Path(tmp, "net.json").read_text())
        ar_gbps = 2 * 3 / 4 * net["allreduce_bytes"] * 8 / 1e9 / net["allreduce_s"]
        lat = net["p2p_s"]
        cfg["tp_link"] = (ar_gbps, lat)
        cluster = cluster_from_dict({
            "devices": [{"id": f"emu:{r}", "host": "local", "memory_gb": 100.0,
                         "tflops": s * args.base_tflops} for r, s in enumerate(SPEEDS)],
            "network": {"intra_host_gbps": ar_gbps, "inter_host_gbps": ar_gbps,
                        "latency_us": lat * 1e6}})
        model = model_from_dict(prof)
        job_spec = Job(global_batch=args.micro, microbatch_size=args.micro,
                       schedules=("1f1b",), tensor_parallel=True)
        without = make_plan(cluster, model, Job(global_batch=args.micro,
                                                microbatch_size=args.micro, schedules=("1f1b",)))
        tp, source = make_tp_plan(cluster, model, job_spec, make_plan), "make_tp_plan"
        if not _two_way(tp):
            tp = plan_from_dict({"microbatch_size": args.micro, "schedule": "1f1b", "groups": [
                {"samples": args.micro, "stages": [{"devices": ["emu:0", "emu:1"],
                                                    "layers": [0, model.num_layers]}]}]})
            source = "the 2-way stage on emu:0, emu:1 (make_tp_plan chose another degree)"
        plans = {"2-way TP": plan_to_dict(tp), "best without TP": plan_to_dict(without)}
        cfg["plans"] = plans
        ranks, wall = run_ranks(_worker, tmp, cfg)
    print(f"measured gloo: all-reduce of {net['allreduce_bytes'] / 1e6:.0f} MB in "
          f"{net['allreduce_s']:.3f} s (ring-equivalent {ar_gbps:.2f} Gbit/s), one-way "
          f"{lat * 1e6:.0f} us; TP plan from {source}")
    for name, plan_d in plans.items():
        print(f"{name}: {json.dumps(plan_d)}")
    print(f"{'plan':18s} {'measured s':>11s} {'predicted s':>12s} {'error':>7s}  visits (s)")
    measured = {}
    for name, plan_d in plans.items():
        visits = [max(r["iteration_s"][name][i] for r in ranks) for i in range(args.repeats)]
        it_s = measured[name] = statistics.median(visits)
        pred = evaluate(cluster, model, plan_from_dict(plan_d), args.micro).iteration_s
        assert pred is not None
        print(f"{name:18s} {it_s:11.4f} {pred:12.4f} {(it_s / pred - 1) * 100:+6.1f}%  "
              f"{', '.join(f'{v:.4f}' for v in visits)}")
    print(f"speed-up of the 2-way TP plan over the best without: "
          f"{measured['best without TP'] / measured['2-way TP']:.2f}x measured")
    sw = {name: statistics.median(max(r["switch_s"][name][i] for r in ranks)
                                  for i in range(args.repeats)) for name in plans}
    print(f"switch into each (median): {', '.join(f'{k} {v:.3f} s' for k, v in sw.items())}")
    print(f"(bench wall {wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
