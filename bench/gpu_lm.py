"""A GPT-2-small LM: hetpilot's one-stage plan against a plain PyTorch loop, and the
planner's prediction against the measured iteration (issue 14's GPU check).

Three measurements of the same model, batch, microbatch size and dtype on one device:

1. **plain**: ``nn.Sequential`` of the job's layers, AdamW, gradient accumulation over
   the microbatches, ``torch.autocast`` for bfloat16/float16 (a ``GradScaler`` for
   float16), each microbatch copied from pinned host memory without blocking: what a
   user would write;
2. **hetpilot**: :class:`hetpilot.trainer.runtime.Trainer` (one rank: NCCL on a GPU,
   gloo on a CPU) running the one-stage plan of the whole model;
3. **predicted**: what the daemon would plan with: the job's layers timed on the
   device (:func:`hetpilot.trainer.speeds.measure_layer_times`, CUDA events),
   :func:`hetpilot.planner.measured.fit_speeds` on the profile's FLOPs, and spec 5's
   iteration time of the same plan (:func:`hetpilot.planner.refmodel.evaluate`);
4. **corrected**: the first prediction's layer times after
   :class:`hetpilot.trainer.calibration.StageCalibration` saw the trainer's stage
   timings (op seconds per microbatch, each round of the hetpilot loop taken as one
   slot), as rank 0 of ``hetpilot train --daemon`` sends them to the daemon; the same
   layer times when no correction was due.

Reported: seconds per iteration (median of ``--steps`` timed iterations after
``--warmup``, each between device synchronisations), tokens/s, model FLOPs
utilisation (the profile's FLOP count of forward plus backward, over the device's
dense peak for the dtype: ``--peak-tflops``, or a table for H100/H200), hetpilot
against plain (target: within 10%) and measured against predicted (target: within
10%).

Model (defaults): GPT-2 small, 12 blocks, d 768, 12 heads, sequence 512, vocabulary
50304 (``hetpilot.trainer.examples.gpt``: tied embedding and head), batch 32,
microbatch 8, integer token ids from the example's arithmetic sequences.

Run on a GPU machine (commands for bench/RESULTS-gpu.md)::

    .venv/bin/python bench/gpu_lm.py --dtype bfloat16 --steps 300
    .venv/bin/python bench/gpu_lm.py --dtype float32 --steps 200

``--tiny`` is a small model for a CPU smoke run: its figures are a CPU's and not the
issue's (the output says so).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.planner.measured import DeviceTimes, effective_model, fit_speeds
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.serde import cluster_from_dict, model_from_dict, plan_from_dict
from hetpilot.trainer.calibration import StageCalibration, stage_ratio
from hetpilot.trainer.examples import gpt
from hetpilot.trainer.launch import free_port
from hetpilot.trainer.profile import profile_model
from hetpilot.trainer.runtime import Trainer, TrainerConfig
from hetpilot.trainer.speeds import as_measurement, measure_layer_times
from torch import nn

DEVICE_ID = "dev:0"
PEAK_TFLOPS = {  # dense peaks from the vendor's data sheets (SXM parts)
    "H100": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "H200": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _batches(dataset: Any, batch: int) -> Any:
    """Endless (ids, targets) batches in order, wrapping over the data set."""
    n = len(dataset) // batch * batch
    x, y = dataset.tensors
    while True:
        for i in range(0, n, batch):
            yield x[i:i + batch], y[i:i + batch]


def _plain(job: dict[str, Any], args: argparse.Namespace, dev: torch.device,
           compute: torch.dtype | None) -> list[float]:
    """Seconds of each timed iteration of the plain PyTorch loop."""
    model = nn.Sequential(*copy.deepcopy(job["layers"])).to(dev)  # one deepcopy: ties kept
    opt = job["optimizer"](list(model.parameters()))
    scaler = torch.amp.GradScaler(dev.type) if compute == torch.float16 else None
    autocast = ((lambda: torch.autocast(dev.type, dtype=compute)) if compute is not None
                else contextlib.nullcontext)
    micro, batch = args.micro, args.batch
    times: list[float] = []
    batches = _batches(job["dataset"], batch)
    for step in range(args.warmup + args.steps):
        x_all, y_all = next(batches)
        x_all, y_all = x_all.pin_memory() if dev.type == "cuda" else x_all, y_all
        _sync(dev)
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for i in range(0, batch, micro):
            x = x_all[i:i + micro].to(dev, non_blocking=True)
            y = y_all[i:i + micro].to(dev, non_blocking=True)
            with autocast():
                loss = job["loss"](model(x), y) * (micro / batch)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        _sync(dev)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    return times


def _plan(n_layers: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"microbatch_size": args.micro, "schedule": "1f1b", "groups": [
        {"samples": args.batch, "stages": [{"device": DEVICE_ID, "layers": [0, n_layers]}]}]}


def _hetpilot(job: dict[str, Any], args: argparse.Namespace, dev: torch.device,
              dtype: torch.dtype | None, merge: bool = True
              ) -> tuple[list[float], dict[str, Any]]:
    """Seconds of each timed iteration of hetpilot's trainer on the one-stage plan, and
    the slot record of the timed iterations (the fields the stage-timing correction reads)."""
    trainer = Trainer(job["layers"], job["loss"], job["optimizer"], job["dataset"],
                      TrainerConfig(global_batch=args.batch, device_id=DEVICE_ID, device=dev,
                                    dtype=dtype, merge_optimizers=merge))
    trainer.switch(plan_from_dict(_plan(len(job["layers"]), args)))
    times: list[float] = []
    ops = [0.0, 0.0, 0]
    for step in range(args.warmup + args.steps):
        if trainer.iteration >= trainer.iterations_per_epoch:  # wrap the data set
            trainer.iteration, trainer.epoch = 0, trainer.epoch + 1
        _sync(dev)
        started = time.perf_counter()
        stats = trainer.train_step()[0]
        _sync(dev)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
            assert stats is not None
            ops = [ops[0] + stats.fwd_s, ops[1] + stats.bwd_s, ops[2] + stats.microbatches]
    per_mb = max(int(ops[2]), 1)
    record = {"rank": 0, "plan_version": 1, "group": 0, "stage": 0,
              "fwd_s": ops[0] / per_mb, "bwd_s": ops[1] / per_mb}
    return times, record


def _predicted(job: dict[str, Any], args: argparse.Namespace, dev: torch.device,
               dtype: torch.dtype | None, compute: torch.dtype | None, profiled: Any,
               chain: int | None = None) -> tuple[float, float, float, dict[str, Any]]:
    """(predicted iteration s, fitted TFLOP/s, model GFLOP per iteration, the layer
    times as the trainer sends them); ``chain``: measure_layer_times' (None: its default)."""
    x = job["dataset"].tensors[0][:args.micro]
    times = measure_layer_times(job["layers"], x, args.micro, device=dev,
                                autocast_dtype=compute, chain=chain,
                                loss=(job["loss"], job["dataset"].tensors[1][:args.micro]))
    measurement = as_measurement(times, args.micro, str(dtype))
    return (*_predict_from(job, args, profiled, measurement), measurement)


def _profiled(job: dict[str, Any], args: argparse.Namespace, dtype: torch.dtype | None) -> Any:
    """The job's spec model, profiled on the CPU (once: it is the same for every
    prediction)."""
    x = job["dataset"].tensors[0][:args.micro]
    return model_from_dict(profile_model(job["layers"], x, name="gpt2-small", dtype=dtype))


def _predict_from(job: dict[str, Any], args: argparse.Namespace, profiled: Any,
                  measurement: dict[str, Any]) -> tuple[float, float, float]:
    """(predicted iteration s, fitted TFLOP/s, model GFLOP per iteration) from layer
    times, as the daemon plans with them."""
    fit = fit_speeds({DEVICE_ID: DeviceTimes(measurement["microbatch"],
                                             measurement["layers"])},
                     [la.fwd_gflop for la in profiled.layers],
                     [la.bwd_gflop for la in profiled.layers])
    model = effective_model(profiled, fit)
    cluster = cluster_from_dict({
        "devices": [{"id": DEVICE_ID, "host": "h", "memory_gb": 1e6,
                     "tflops": fit.tflops[DEVICE_ID]}],
        "network": {"intra_host_gbps": 1.0, "inter_host_gbps": 1.0}})
    ev = evaluate(cluster, model, plan_from_dict(_plan(len(job["layers"]), args)), args.batch)
    gflop = args.batch * sum(la.fwd_gflop + la.bwd_gflop for la in profiled.layers)
    return ev.iteration_s, fit.tflops[DEVICE_ID], gflop


def _peak(args: argparse.Namespace, dev: torch.device) -> float | None:
    if args.peak_tflops:
        return float(args.peak_tflops)
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    kind = args.dtype if args.dtype != "float32" or not args.tf32 else "tf32"
    return next((table[kind] for key, table in PEAK_TFLOPS.items() if key in name), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--steps", type=int, default=200, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternate the plain loop and hetpilot this many times")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--tf32", action="store_true", help="float32 matmuls on TF32 tensor cores")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense peak for the dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true",
                    help="a small model for a CPU smoke run (not the issue's figures)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--one-by-one", action="store_true",
                    help="also run hetpilot with the layers' optimizers stepped one by one "
                         "(merge_optimizers=False), each round, to compare")
    args = ap.parse_args()
    if args.tiny:
        args.seq, args.d_model, args.heads, args.blocks, args.vocab = 32, 64, 4, 2, 256
        args.batch, args.micro = min(args.batch, 16), min(args.micro, 4)
    if args.batch % args.micro or args.steps < 1 or args.rounds < 1:
        ap.error("--batch must be a multiple of --micro, and --steps, --rounds >= 1")
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    dtype = getattr(torch, args.dtype)
    compute = dtype if dtype in (torch.bfloat16, torch.float16) else None
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    if dev.type != "cuda":
        print("NOT A GPU: this runs on the CPU; the figures are a CPU's, not issue 14's "
              "GPU check", file=sys.stderr)
    job = gpt(vocab=args.vocab, seq_len=args.seq, d_model=args.d_model, heads=args.heads,
              blocks=args.blocks)
    job["dataset"] = torch.utils.data.TensorDataset(*job["dataset"].tensors)
    params = sum(p.numel() for p in nn.Sequential(*job["layers"]).parameters())
    print(f"{where}: GPT {args.blocks} blocks, d {args.d_model}, seq {args.seq}, vocab "
          f"{args.vocab} ({params / 1e6:.1f} M parameters), {args.dtype}"
          f"{' (TF32 matmuls)' if args.tf32 else ''}, batch {args.batch}, microbatch "
          f"{args.micro}; {args.warmup} warm-up + {args.steps} timed iterations per run, "
          f"{args.rounds} rounds")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    # The two loops alternate (plain, hetpilot) for --rounds rounds and the prediction is
    # made before and after: at microbatch 8 in bfloat16 both loops are bound by the
    # host's kernel launches, and the same loop's time moved 0.076-0.117 s between three
    # H100 machines, so only figures of one run, side by side, are compared.
    # the predictions profile on the CPU and time copies: a copy of the job's layers made
    # before the trainer moves them to the device and trains them
    untouched = {**job, "layers": copy.deepcopy(job["layers"])}
    try:
        profiled = _profiled(untouched, args, dtype)
        predicted_runs = [_predicted(untouched, args, dev, dtype, compute, profiled)]
        # the same, each layer timed alone (chain 1: how layers were timed before lease I)
        unchained_run = _predicted(untouched, args, dev, dtype, compute, profiled, chain=1)
        unchained = unchained_run[0]
        op_ratios: list[tuple[float, float]] = []  # stage op time / each measurement's
        plain_times: list[float] = []
        our_times: list[float] = []
        alone_times: list[float] = []
        ratios: list[float] = []
        plan = plan_from_dict(_plan(len(job["layers"]), args))
        sent: list[Any] = []
        calibration = StageCalibration([predicted_runs[0][3]], lambda v: plan, sent.append)
        for _ in range(args.rounds):
            p, (o, record) = _plain(job, args, dev, compute), _hetpilot(job, args, dev, dtype)
            plain_times += p
            our_times += o
            if args.one_by_one:
                alone_times += _hetpilot(job, args, dev, dtype, merge=False)[0]
            ratios.append(statistics.median(o) / statistics.median(p))
            chained_r, unchained_r = (stage_ratio(record, plan, m)
                                      for m in (predicted_runs[0][3], unchained_run[3]))
            op_ratios.append((chained_r or math.nan, unchained_r or math.nan))
            calibration(record)
        predicted_runs.append(_predicted(untouched, args, dev, dtype, compute, profiled))
        corrected = _predict_from(untouched, args, profiled, calibration.measurements[0])[0]
    finally:
        dist.destroy_process_group()
    plain, ours = statistics.median(plain_times), statistics.median(our_times)
    predicted = statistics.mean(p[0] for p in predicted_runs)
    tflops = statistics.mean(p[1] for p in predicted_runs)
    gflop = predicted_runs[0][2]
    tokens = args.batch * args.seq
    peak = _peak(args, dev)
    rows = {"plain PyTorch loop": plain, "hetpilot, one-stage plan": ours}
    if alone_times:
        rows["hetpilot, the layers' optimizers one by one"] = statistics.median(alone_times)
    print("\n| run | iteration s | tokens/s | model TFLOP/s | MFU |\n|---|---|---|---|---|")
    for name, t in rows.items():
        achieved = gflop / t / 1000
        mfu = f"{achieved / peak:.1%}" if peak else "n/a (no peak known)"
        print(f"| {name} | {t:.4f} | {tokens / t:,.0f} | {achieved:.1f} | {mfu} |")
    print(f"\nhetpilot / plain: {ours / plain:.3f}x the time (target <= 1.10); per round "
          + ", ".join(f"{r:.3f}" for r in ratios))
    print(f"predicted {predicted:.4f} s (mean of "
          + " and ".join(f"{p[0]:.4f}" for p in predicted_runs)
          + f", before and after; layers timed on the device: {tflops:.1f} effective "
          f"TFLOP/s), measured {ours:.4f} s: {(ours / predicted - 1) * 100:+.1f}% "
          f"(target within 10%)")
    print(f"layers timed one at a time (chain 1), right after the first: {unchained:.4f} s, "
          f"measured {(ours / unchained - 1) * 100:+.1f}%")
    print("op time per microbatch in training / the measurement's, per round (first "
          "measurement; chain 1): " + ", ".join(f"{a:.3f}; {b:.3f}" for a, b in op_ratios))
    fixes = ", ".join(f"{f:.3g}x" for _, f in calibration.corrections) or "none due"
    print(f"corrected from the stage timings ({fixes}): the first prediction "
          f"{predicted_runs[0][0]:.4f} s becomes {corrected:.4f} s, measured "
          f"{(ours / corrected - 1) * 100:+.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "args": vars(args), "params": params,
                       "plain_s": plain, "hetpilot_s": ours, "predicted_s": predicted,
                       "round_ratios": ratios,
                       "predictions_s": [p[0] for p in predicted_runs],
                       "corrected_s": corrected, "unchained_s": unchained,
                       "op_ratios": op_ratios,
                       "one_by_one_s": statistics.median(alone_times) if alone_times else None,
                       "corrections": [f for _, f in calibration.corrections],
                       "fitted_tflops": tflops, "gflop_per_iteration": gflop,
                       "peak_tflops": peak}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
