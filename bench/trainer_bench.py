"""Trainer benchmark: hetpilot plan vs torch.distributed.pipelining (even split) vs even DP.

EMULATED heterogeneity: 4 CPU ranks (gloo, one thread each) with relative
speeds 1, 1, 0.5, 0.25, in one of two modes:

* ``--mode target`` (default): rank r is a device of ``base_tflops * speed_r``
  TFLOP/s; each op sleeps until its FLOPs (``torch.utils.flop_counter``, the
  profile) at that speed have elapsed since it started. As long as the real
  compute is shorter than the target, measured times follow the emulated
  devices, not the contention of 4 ranks on 2 shared cores;
* ``--mode ratio`` (the first benchmark): a rank of speed s sleeps (1/s - 1)
  times each op's measured compute time.

All three methods run side by side in one invocation on one model.

Steps:
1. measure the model profile (and, in ratio mode, per-layer forward/backward
   seconds); measure p2p latency/bandwidth and all-reduce time over gloo
   between the ranks;
2. turn the measurements into a spec cluster and model (target mode: the
   emulated tflops and the profiled GFLOP; ratio mode: tflops = relative speed
   and GFLOP such that a 1 TFLOP/s device takes the measured time), and ask
   the planner (``hetpilot.planner.search.make_plan``) for the plan;
3. run even DP, the hetpilot plan (live switches between them, cost recorded)
   with hetpilot's runtime, and an even 4-stage split with
   torch.distributed.pipelining's Schedule1F1B; report samples/s and the
   reference model's prediction for the runtime's plans.

Run: .venv/bin/python bench/trainer_bench.py [--mode target --base-tflops 0.008] [--iterations 4]
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
from hetpilot.planner.serde import cluster_from_dict, model_from_dict, plan_from_dict, plan_to_dict
from hetpilot.planner.types import Job
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.profile import layer_times, profile_model
from hetpilot.trainer.runtime import Trainer, TrainerConfig
from torch import nn

SPEEDS = (1.0, 1.0, 0.5, 0.25)


def make_layers(num_layers: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(num_layers)]


def dataset(size: int, width: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(size, width, generator=gen), torch.randn(size, width, generator=gen)
    )


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, box: dict[str, float]) -> Any:  # type: ignore[override]
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        box = ctx.box
        took = time.perf_counter() - box["t"]
        time.sleep(max(0.0, box["bwd_t"] - took) if box["bwd_t"] else (box["f"] - 1.0) * took)
        return grad, None, None


class _End(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, box: dict[str, float]) -> Any:  # type: ignore[override]
        ctx.box = box
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.box["t"] = time.perf_counter()
        return grad, None


class Slowed(nn.Module):
    """EMULATION for the torch.distributed.pipelining baseline: sleep (f-1) x compute
    (ratio mode), or until ``fwd_t`` / ``bwd_t`` seconds per microbatch (target mode)."""

    def __init__(self, inner: nn.Module, factor: float, fwd_t: float = 0.0,
                 bwd_t: float = 0.0) -> None:
        super().__init__()
        self.inner = inner
        self.box = {"f": factor, "t": 0.0, "fwd_t": fwd_t, "bwd_t": bwd_t}
        self.anchor = nn.Parameter(torch.zeros(()), requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.box["f"] == 1.0 and not self.box["fwd_t"]:
            return self.inner(x)
        started = time.perf_counter()
        y = self.inner(_Start.apply(x, self.anchor, self.box))
        took = time.perf_counter() - started
        time.sleep(max(0.0, self.box["fwd_t"] - took) if self.box["fwd_t"]
                   else (self.box["f"] - 1.0) * took)
        return _End.apply(y, self.box)


def _net_worker(rank: int, world: int, out: str, width: int, micro: int) -> None:
    torch.set_num_threads(1)
    small = torch.zeros(micro * width)
    times = []
    for _ in range(20):  # ping-pong 0 <-> 1: one-way time of an activation message
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            dist.send(small, 1)
            dist.recv(small, 1)
        elif rank == 1:
            dist.recv(small, 0)
            dist.send(small, 0)
        times.append((time.perf_counter() - started) / 2)
    large = torch.zeros(1_000_000)  # 4 MB: bandwidth
    bw = []
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            dist.send(large, 1)
            dist.recv(large, 1)
        elif rank == 1:
            dist.recv(large, 0)
            dist.send(large, 0)
        bw.append((time.perf_counter() - started) / 2)
    big = torch.zeros(4_000_000)  # 16 MB
    ar = []
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(big)
        ar.append(time.perf_counter() - started)
    if rank == 0:
        Path(out, "net.json").write_text(json.dumps(
            {"p2p_s": statistics.median(times), "p2p_bytes": small.numel() * 4,
             "p2p_large_s": statistics.median(bw), "p2p_large_bytes": large.numel() * 4,
             "allreduce_s": statistics.median(ar), "allreduce_bytes": big.numel() * 4}))


def run_ranks(worker: Any, tmp: str, cfg: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """Spawn 4 ranks of ``worker(rank, world, tmp, cfg)``; each rank's rank{r}.json and the wall s."""
    started = time.monotonic()
    spawn(worker, 4, (tmp, cfg), 580)
    wall = time.monotonic() - started
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(4)], wall


def _time_steps(step: Any, iterations: int) -> float:
    step()  # warm up
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    dist.barrier()
    return (time.perf_counter() - started) / iterations


def _bench_worker(rank: int, world: int, out: str, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    width, layers_n, batch, its = cfg["width"], cfg["layers"], cfg["batch"], cfg["iterations"]
    target = cfg["mode"] == "target"
    factor = 1.0 if target else 1.0 / SPEEDS[rank]
    tflops = cfg["base_tflops"] * SPEEDS[rank] if target else None
    gflop = cfg["layer_gflop"]
    results: dict[str, Any] = {}
    trainer = Trainer(
        make_layers(layers_n, width), nn.functional.mse_loss,
        lambda p: torch.optim.SGD(p, lr=1e-4),
        dataset(batch * (4 * its + 8), width),
        TrainerConfig(global_batch=batch, device_id=f"emu:{rank}", slowdown=factor,
                      emulate_tflops=tflops, layer_gflop=gflop if target else None),
    )
    for name in ("even-dp", "hetpilot", "even-dp-again"):
        plan = plan_from_dict(cfg["plans"][name.replace("-again", "")])
        switch = trainer.switch(plan)
        stage_times: list[Any] = []

        def step(stage_times: list[Any] = stage_times) -> None:
            stats, _ = trainer.train_step()
            if stats is not None:
                stage_times.append((stats.fwd_s, stats.bwd_s, stats.wait_s, stats.sync_s,
                                    stats.microbatches))

        it_s = _time_steps(step, its)
        results[name] = {"iteration_s": it_s, "switch": switch, "stage": stage_times[-1:]}
    # torch.distributed.pipelining, even split, 1F1B
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    per = layers_n // world
    fwd_t = bwd_t = 0.0
    if tflops is not None:
        scale = cfg["micro"] / (1000.0 * tflops)
        fwd_t = scale * sum(g[0] for g in gflop[rank * per : (rank + 1) * per])
        bwd_t = scale * sum(g[1] for g in gflop[rank * per : (rank + 1) * per])
    mod = Slowed(nn.Sequential(*make_layers(layers_n, width)[rank * per : (rank + 1) * per]),
                 factor, fwd_t, bwd_t)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=batch // cfg["micro"],
                         loss_fn=nn.functional.mse_loss)
    optim = torch.optim.SGD(mod.parameters(), lr=1e-4)
    data = dataset(batch, width)
    x, y = data.tensors

    def pp_step() -> None:
        optim.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()
        optim.step()

    results["torch-pipelining-even"] = {"iteration_s": _time_steps(pp_step, its)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _proportional(devices: list[tuple[list[str], float]], job: Job, layers: int,
                  cuts: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    micro_total = job.global_batch // job.microbatch_size
    total = sum(s for _, s in devices)
    counts = [max(1, round(micro_total * s / total)) for _, s in devices]
    counts[0] += micro_total - sum(counts)
    groups = []
    for (devs, _), c in zip(devices, counts, strict=True):
        stages = [{"device": d, "layers": list((cuts or {}).get(d, (0, layers)))} for d in devs]
        groups.append({"samples": c * job.microbatch_size, "stages": stages})
    return {"microbatch_size": job.microbatch_size, "schedule": "1f1b", "groups": groups}


def _hetpilot_plan(cluster: Any, model: Any, job: Job, layers: int) -> tuple[Any, str]:
    """The planner's plan; while the planner is unavailable, the best of a few
    speed-proportional candidates as the reference model scores them."""
    try:
        from hetpilot.planner.search import make_plan

        return make_plan(cluster, model, job), "hetpilot.planner.search.make_plan"
    except Exception as exc:  # the planner is being built concurrently
        reason = f"{type(exc).__name__}: {exc}"
    speeds = {d.id: d.tflops for d in cluster.devices}
    ids = sorted(speeds)
    cut = max(1, min(layers - 1, round(layers * speeds[ids[2]] / (speeds[ids[2]] + speeds[ids[3]]))))
    candidates = [
        _proportional([([d], speeds[d]) for d in ids], job, layers),
        _proportional([([d], speeds[d]) for d in ids[:3]], job, layers),
        _proportional([([ids[0]], speeds[ids[0]]), ([ids[1]], speeds[ids[1]]),
                       ([ids[2], ids[3]], speeds[ids[2]] + speeds[ids[3]])], job, layers,
                      {ids[2]: (0, cut), ids[3]: (cut, layers)}),
    ]
    scored = [(evaluate(cluster, model, plan_from_dict(c), job.global_batch).iteration_s, c)
              for c in candidates]
    best = min((t, c) for t, c in scored if t is not None)[1] if scored else candidates[0]
    return plan_from_dict(best), f"reference-model-scored fallback (planner failed: {reason})"


def _inrun_prediction(cluster: Any, model: Any, plan: Any, ranks: list[dict[str, Any]],
                      name: str) -> float:
    """Reference model (spec 5.2/5.3) fed with the stage times the ranks measured in the run."""
    from hetpilot.planner.refmodel import group_op_times, pipeline_makespan, sync_time
    from hetpilot.trainer.plans import check_plan

    orders = check_plan(plan, [d.id for d in cluster.devices], model.num_layers, plan.global_batch)
    spans = []
    for gi, group in enumerate(plan.groups):
        comm = group_op_times(cluster, model, group, plan.microbatch_size).comm
        fwd, bwd = [], []
        for stage in group.stages:
            f, b, _, _, mb = ranks[int(stage.device.split(":")[1])][name]["stage"][0]
            fwd.append(f / mb)
            bwd.append(b / mb)
        spans.append(pipeline_makespan(fwd, bwd, comm, orders[gi]))
    return max(spans) + sync_time(cluster, model, plan.groups)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--batch", type=int, default=176)
    ap.add_argument("--mode", choices=("target", "ratio"), default="target",
                    help="EMULATION: target-time (FLOPs at an emulated speed) or sleep-ratio")
    ap.add_argument("--base-tflops", type=float, default=0.008,
                    help="target mode: emulated TFLOP/s of a speed-1 rank")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = args.mode == "target"
    speeds = ", ".join(f"{s:g}" for s in SPEEDS)
    if target:
        print(f"EMULATED heterogeneity (target-time): 4 CPU ranks of "
              f"{', '.join(f'{args.base_tflops * s:g}' for s in SPEEDS)} TFLOP/s "
              f"(relative {speeds}); each op sleeps until FLOPs / speed has elapsed")
    else:
        print(f"EMULATED heterogeneity (sleep-ratio): 4 CPU ranks, relative speeds {speeds} "
              "(slower ranks sleep)")
    layers = make_layers(args.layers, args.width)
    sample = torch.randn(args.micro, args.width)
    prof = profile_model(layers, sample, name="bench-mlp")
    layer_gflop = [(la["fwd_gflop"], la["bwd_gflop"]) for la in prof["layers"]]
    times = layer_times(layers, sample, repeats=7)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_net_worker, 4, (tmp, args.width, args.micro), 120)
        net = json.loads(Path(tmp, "net.json").read_text())
        real = sum(f + b for f, b in times)
        if target:  # the profiled FLOPs; the emulated speeds are the cluster's tflops
            slowest = args.micro * sum(f + b for f, b in layer_gflop) / (
                1000.0 * args.base_tflops * max(SPEEDS))
            print(f"real compute of one microbatch through all layers (alone): {real:.4f} s; "
                  f"emulated on the fastest rank: {slowest:.4f} s "
                  f"({slowest / real:.1f}x headroom)")
        else:  # spec model: a 1 TFLOP/s device takes the measured time
            for layer, (f, b) in zip(prof["layers"], times, strict=True):
                layer["fwd_gflop"] = f / args.micro * 1000.0
                layer["bwd_gflop"] = b / args.micro * 1000.0
        model = model_from_dict(prof)
        p2p_gbps = net["p2p_large_bytes"] * 8 / 1e9 / net["p2p_large_s"]
        ar_gbps = 2 * 3 / 4 * net["allreduce_bytes"] * 8 / 1e9 / net["allreduce_s"]
        cluster = cluster_from_dict({
            "devices": [{"id": f"emu:{r}", "host": "local", "memory_gb": 100.0,
                         "tflops": s * args.base_tflops if target else s}
                        for r, s in enumerate(SPEEDS)],
            "network": {"intra_host_gbps": ar_gbps, "inter_host_gbps": ar_gbps,
                        "latency_us": net["p2p_s"] * 1e6},
        })
        job = Job(global_batch=args.batch, microbatch_size=args.micro,
                  schedules=("1f1b", "gpipe"))
        het, source = _hetpilot_plan(cluster, model, job, args.layers)
        print(f"hetpilot plan from: {source}")
        even = {"microbatch_size": args.batch // 4, "schedule": "1f1b",
                "groups": [{"samples": args.batch // 4,
                            "stages": [{"device": f"emu:{r}", "layers": [0, args.layers]}]}
                           for r in range(4)]}
        plans = {"hetpilot": plan_to_dict(het), "even-dp": even}
        cfg = {"width": args.width, "layers": args.layers, "batch": args.batch,
               "micro": args.micro, "iterations": args.iterations, "plans": plans,
               "mode": args.mode, "base_tflops": args.base_tflops, "layer_gflop": layer_gflop}
        ranks, wall = run_ranks(_bench_worker, tmp, cfg)
    print(f"measured: p2p one-way {net['p2p_s'] * 1e6:.0f} us for {net['p2p_bytes']} B; "
          f"p2p {p2p_gbps:.2f} Gbit/s (4 MB); all-reduce of {net['allreduce_bytes'] / 1e6:.0f} MB in {net['allreduce_s']:.3f} s "
          f"(ring-equivalent {ar_gbps:.2f} Gbit/s)")
    print(f"hetpilot plan: {json.dumps(plans['hetpilot'])}")
    rows = []
    for name in ("hetpilot", "even-dp", "torch-pipelining-even"):
        it_s = max(r[name]["iteration_s"] for r in ranks)
        pred = inrun = None
        if name in plans:
            plan = plan_from_dict(plans[name])
            pred = evaluate(cluster, model, plan, args.batch).iteration_s
            inrun = _inrun_prediction(cluster, model, plan, ranks, name)
        rows.append((name, it_s, args.batch / it_s, pred, inrun))
    print(f"{'method':24s} {'iteration_s':>12s} {'samples/s':>10s} "
          f"{'pred(emulated)' if target else 'pred(profile)':>14s} {'error':>8s} {'pred(in-run)':>13s} {'error':>8s}")
    for name, it_s, sps, pred, inrun in rows:
        cells = []
        for p in (pred, inrun):
            cells.append((f"{p:.4f}", f"{(it_s / p - 1) * 100:+.1f}%") if p else ("-", "-"))
        print(f"{name:24s} {it_s:12.4f} {sps:10.1f} {cells[0][0]:>14s} {cells[0][1]:>8s} "
              f"{cells[1][0]:>13s} {cells[1][1]:>8s}")
    from hetpilot.planner.refmodel import sync_time

    for name in ("hetpilot", "even-dp"):
        plan = plan_from_dict(plans[name])
        it_s = max(r[name]["iteration_s"] for r in ranks)
        stage = [r[name]["stage"][0] for r in ranks if r[name]["stage"]]
        sync = max(st[3] for st in stage)
        busy = max(st[0] + st[1] + st[2] + st[3] for st in stage)
        print(f"{name}: gradient sync measured {sync:.3f} s (model {sync_time(cluster, model, plan.groups):.3f} s); "
              f"outside fwd/bwd/recv/sync (optimizer step, data, barrier) {it_s - busy:+.3f} s")
    best_base = max(rows[1][2], rows[2][2])
    print(f"speed-up of hetpilot over the better baseline: {rows[0][2] / best_base:.2f}x")
    for name in ("hetpilot", "even-dp-again"):
        sw = [r[name]["switch"] for r in ranks]
        sent = sum(s["bytes_sent"] for s in sw)
        took = max(s["total_s"] for s in sw)
        bound = sent / (p2p_gbps * 1e9 / 8)
        print(f"switch into {name.replace('-again', '')}: {sent / 1e6:.2f} MB moved in "
              f"{took:.3f} s; bytes/p2p bandwidth = {bound:.3f} s, overhead {took - bound:.3f} s")
    print(f"(bench wall {wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
