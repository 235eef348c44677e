"""Fidelity of the reference model with job-measured speeds (issue 14): predicted vs measured.

REAL CPU compute, no emulation: 2 gloo ranks (one thread each) on this machine's
2 shared cores run an MLP whose layers are unequal (8 Linear layers mixing widths
512 and 1024, + Tanh, float32), so where a pipeline is cut matters.

Method (one spawn; everything is measured in it):

1. measurement rounds: the gloo network between the 2 ranks as
   ``bench/trainer_bench.py`` measures it (one-way time of an activation-sized
   message, 4 MB p2p, 16 MB all-reduce), then each rank times the job's layers on
   its own device with :func:`hetpilot.trainer.speeds.measure_layer_times` at the
   microbatch size, both ranks at once (what ``hetpilot train`` sends the daemon
   on Attach). A round runs before the first plan visit (the "Attach" round),
   before every later repeat, and after the last one;
2. the plans (fixed from the profile, the same in every run): even DP, uneven DP
   (3:5), a 2-stage 1F1B pipeline cut where the profiled GFLOP split most evenly,
   the same with GPipe, the cut nearest 80:20, the balanced 1F1B with recompute
   on stage 0;
3. one :class:`~hetpilot.trainer.runtime.Trainer` runs them, switching live; each
   repeat visits every plan (in alternating order), warms up one iteration, then
   times ``--iterations`` iterations, each between two barriers;
4. prediction: per layer, the median time over the rounds; the fit
   (:func:`hetpilot.planner.measured.fit_speeds`) gives device TFLOP/s and
   per-layer effective GFLOP, applied to the profile
   (:func:`~hetpilot.planner.measured.effective_model` on
   :func:`~hetpilot.trainer.profile.profile_model`); the spec cluster has the 2
   devices on one host and one link as the job measures it on Attach
   (:func:`hetpilot.trainer.linkprobe.measure_links`, what the daemon plans the
   job with: the 2-rank all-reduce's bandwidth, and the larger of the idle and
   the busy one-way time of an activation message; medians over the rounds);
   the prediction before that measurement existed (the all-reduce's
   ring-equivalent bandwidth, the idle ping-pong) is printed beside it;
   :func:`hetpilot.planner.refmodel.evaluate`
   predicts each plan. Measured: the median of the plan's timed iterations.
   Also shown: the prediction from the Attach round alone, and the "in-run"
   prediction (spec 5.2/5.3 fed with the per-microbatch stage times measured in
   the run), which separates errors of the layer times from the rest.

The machine is shared with other work that this container cannot see; each
round and visit records how many cores the other processes used (``/proc/stat``
busy time minus the two ranks' CPU time), and the comparison is printed twice:
over all rounds and visits, and over the quiet ones (other processes below
``--quiet-cores``). The selection is by the machine's load, never by the result.

Gradient sync: the reference model (spec 5.3) adds the all-reduce after the
pipeline, so the compared runs use ``overlap_sync=False`` (sync after the
backward, bucket by bucket). The two DP plans also run with ``overlap_sync=True``
(the runtime's default: the all-reduce overlaps the last backward), reported
beside the comparison.

Run: .venv/bin/python bench/trainer_fidelity.py [--batch 256 --micro 32 --iterations 3 --repeats 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hetpilot.planner.measured import DeviceTimes, effective_model, fit_speeds
from hetpilot.planner.refmodel import (
    evaluate,
    group_op_times,
    pipeline_makespan,
    sync_time,
)
from hetpilot.planner.serde import cluster_from_dict, model_from_dict, plan_from_dict
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.linkprobe import measure_links, synthetic_op_ms
from hetpilot.trainer.plans import check_plan
from hetpilot.trainer.profile import profile_model
from hetpilot.trainer.runtime import Trainer, TrainerConfig
from hetpilot.trainer.speeds import measure_layer_times
from torch import nn

WORLD = 2
WIDTHS = (512, 1024, 1024, 1024, 512, 512, 512, 1024, 512)
"""Layer i is Linear(WIDTHS[i], WIDTHS[i+1]) + Tanh: 8 layers of 0.25-1 M parameters."""


def make_layers(widths: tuple[int, ...]) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(widths)]


def dataset(size: int, widths: tuple[int, ...]) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(size, widths[0], generator=gen),
                                          torch.randn(size, widths[-1], generator=gen))


def _measure_net(rank: int, msg_floats: int) -> dict[str, float]:
    """trainer_bench's gloo measurement (rank 0's view), a bare barrier's time, and the link
    as the job measures it (:func:`_job_links`, added by the caller)."""
    def ping(buf: torch.Tensor, n: int) -> float:
        times = []
        for _ in range(n):
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - started) / 2)
        return statistics.median(times)

    small, large, big = torch.zeros(msg_floats), torch.zeros(1_000_000), torch.zeros(4_000_000)
    p2p_s, large_s = ping(small, 20), ping(large, 3)
    ar = []
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(big)
        ar.append(time.perf_counter() - started)
    bar = []
    for _ in range(20):
        started = time.perf_counter()
        dist.barrier()
        bar.append(time.perf_counter() - started)
    return {"p2p_s": p2p_s, "p2p_bytes": small.numel() * 4,
            "p2p_large_s": large_s, "p2p_large_bytes": large.numel() * 4,
            "allreduce_s": statistics.median(ar), "allreduce_bytes": big.numel() * 4,
            "barrier_s": statistics.median(bar)}


def _job_links(msg_bytes: int, op_ms: float) -> dict[str, float]:
    """The link as ``hetpilot train`` measures it on Attach and the daemon plans the job with
    it (:func:`hetpilot.trainer.linkprobe.measure_links`): latency (the larger of the idle
    and the busy one-way time of an activation message) and the all-reduce's bandwidth."""
    (t,) = measure_links("cpu", msg_bytes=msg_bytes, op_ms=op_ms).values()
    return {"link_latency_s": t.latency_s, "link_gbps": t.gbps,
            "busy_p2p_s": t.busy_latency_s, "link_idle_s": t.idle_latency_s}


def _plans(widths: tuple[int, ...], batch: int, micro: int) -> dict[str, dict[str, Any]]:
    """The compared plans (names -> plan dicts). The cuts come from the profile, so the
    plan set is the same in every run: the balanced cut splits the profiled GFLOP most
    evenly, the unbalanced one puts closest to 80% of them on stage 0."""
    torch.manual_seed(2)
    prof = profile_model(make_layers(widths), torch.randn(micro, widths[0]), name="fidelity-mlp")
    work = [la["fwd_gflop"] + la["bwd_gflop"] for la in prof["layers"]]
    n, total = len(work), sum(work)
    devs = [f"cpu:{r}" for r in range(WORLD)]
    m_total = batch // micro

    def dp(first_mb: int) -> dict[str, Any]:
        return {"microbatch_size": micro, "schedule": "1f1b", "groups": [
            {"samples": first_mb * micro, "stages": [{"device": devs[0], "layers": [0, n]}]},
            {"samples": (m_total - first_mb) * micro,
             "stages": [{"device": devs[1], "layers": [0, n]}]}]}

    def pipe(cut: int, schedule: str, recompute: bool = False) -> dict[str, Any]:
        first: dict[str, Any] = {"device": devs[0], "layers": [0, cut]}
        if recompute:
            first["recompute"] = True
        return {"microbatch_size": micro, "schedule": schedule, "groups": [
            {"samples": batch, "stages": [first, {"device": devs[1], "layers": [cut, n]}]}]}

    best = min(range(1, n), key=lambda c: max(sum(work[:c]), sum(work[c:])))
    skew = min((c for c in range(1, n) if c != best),
               key=lambda c: abs(sum(work[:c]) / total - 0.8))
    return {
        "even-dp": dp(m_total // 2),
        "uneven-dp": dp(max(1, round(m_total * 3 / 8))),
        f"pp-1f1b-cut{best}": pipe(best, "1f1b"),
        f"pp-gpipe-cut{best}": pipe(best, "gpipe"),
        f"pp-1f1b-cut{skew}": pipe(skew, "1f1b"),
        f"pp-1f1b-cut{best}-recompute0": pipe(best, "1f1b", recompute=True),
    }


def _cluster_model(cfg: dict[str, Any], net: dict[str, float],
                   times: list[list[tuple[float, float]]], job_links: bool = True
                   ) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Profile, fit (one time list per rank), spec cluster and effective model. The link:
    as the job measured it (``job_links``, what the daemon plans with), else as before the
    job's link measurement (all-reduce ring-equivalent bandwidth, idle ping-pong)."""
    widths, micro = tuple(cfg["widths"]), cfg["micro"]
    torch.manual_seed(2)
    prof = profile_model(make_layers(widths), torch.randn(micro, widths[0]), name="fidelity-mlp")
    profiled = model_from_dict(prof)
    fit = fit_speeds({f"cpu:{r}": DeviceTimes(micro, dict(enumerate(t)))
                      for r, t in enumerate(times)},
                     [la.fwd_gflop for la in profiled.layers],
                     [la.bwd_gflop for la in profiled.layers])
    k = WORLD
    ar_gbps = 2 * (k - 1) / k * net["allreduce_bytes"] * 8 / 1e9 / net["allreduce_s"]
    gbps, latency_s = ((net["link_gbps"], net["link_latency_s"]) if job_links
                       else (ar_gbps, net["p2p_s"]))
    cluster_d = {
        "devices": [{"id": f"cpu:{r}", "host": "local", "memory_gb": 100.0,
                     "tflops": fit.tflops[f"cpu:{r}"]} for r in range(WORLD)],
        "network": {"intra_host_gbps": gbps, "inter_host_gbps": gbps,
                    "latency_us": latency_s * 1e6},
    }
    info = {"cluster": cluster_d, "model": prof,
            "fit": {"tflops": fit.tflops, "fwd_gflop": list(fit.fwd_gflop),
                    "bwd_gflop": list(fit.bwd_gflop), "rms_log_error": fit.rms_log_error},
            "profiled_gflop": [(la.fwd_gflop, la.bwd_gflop) for la in profiled.layers],
            "ar_gbps": ar_gbps}
    return cluster_from_dict(cluster_d), effective_model(profiled, fit), fit, info


def _predict(cluster: Any, model: Any, plans: dict[str, dict[str, Any]],
             batch: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name, plan in plans.items():
        ev = evaluate(cluster, model, plan_from_dict(plan), batch)
        out[name] = {"iteration_s": ev.iteration_s, "sync_s": ev.sync_s,
                     "makespans": list(ev.makespans)}
    return out


def _median_times(rounds: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Per layer, the median forward and the median backward over measurement rounds."""
    return [(statistics.median(r[i][0] for r in rounds), statistics.median(r[i][1] for r in rounds))
            for i in range(len(rounds[0]))]


def _median_net(nets: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(n[k] for n in nets) for k in nets[0]}


def _busy_jiffies() -> int:
    """Busy jiffies of the whole machine (/proc/stat: all but idle and iowait)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return user + nice + system + irq + softirq + steal


class _Segment:
    """Wall time, this rank's CPU time (all its threads) and the machine's busy jiffies
    over a stretch both ranks enter and leave at a barrier: the other processes' CPU use
    is the machine's minus the two ranks'."""

    def __enter__(self) -> dict[str, float]:
        dist.barrier()
        self.out: dict[str, float] = {}
        self.marks = (time.perf_counter(), time.process_time(), _busy_jiffies())
        return self.out

    def __exit__(self, *exc: object) -> None:
        dist.barrier()
        wall, cpu, jif = self.marks
        self.out.update(wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu,
                        busy_jiffies=_busy_jiffies() - jif)


def _worker(rank: int, world: int, out: str, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    widths, micro, batch = tuple(cfg["widths"]), cfg["micro"], cfg["batch"]
    layers = make_layers(widths)
    gen = torch.Generator().manual_seed(3)
    sample = torch.randn(micro, widths[0], generator=gen)
    rounds: list[dict[str, Any]] = []

    def measure() -> None:
        """One round: the network, then the layer times on both ranks at once (as a job's
        ranks measure them on Attach)."""
        with _Segment() as seg:
            net = _measure_net(rank, micro * max(widths))
            dist.barrier()
            times = measure_layer_times(layers, sample, micro, device="cpu",
                                        repeats=cfg["measure_repeats"])
            # as hetpilot train does: ops of a quarter of a microbatch through the model
            whole = [sum(f + b for f, b in times)]
            dist.broadcast_object_list(whole, src=0)
            net.update(_job_links(micro * max(widths) * 4, synthetic_op_ms(whole[0])))
        rounds.append({"net": net, "times": times, "seg": seg})

    measure()
    plans = _plans(widths, batch, micro)
    trainer = Trainer(layers, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=1e-4),
                      dataset(batch * 4, widths),
                      TrainerConfig(global_batch=batch, device_id=f"cpu:{rank}",
                                    overlap_sync=False))
    runs = [(name, False) for name in plans]
    runs += [(name, True) for name in ("even-dp", "uneven-dp")]
    visits: list[dict[str, Any]] = []

    def step() -> Any:
        if trainer.iteration >= trainer.iterations_per_epoch:  # wrap the small data set
            trainer.iteration, trainer.epoch = 0, trainer.epoch + 1
        return trainer.train_step()[0]

    for rep in range(cfg["repeats"]):
        if rep:
            measure()
        for name, overlap in runs if rep % 2 == 0 else runs[::-1]:
            # read when the switch rebuilds the grad sync
            trainer.config = dataclasses.replace(trainer.config, overlap_sync=overlap)
            trainer.switch(plan_from_dict(plans[name]))
            visit: dict[str, Any] = {"key": name + (" (overlap)" if overlap else ""),
                                     "iters": [], "stats": []}
            with _Segment() as seg:
                step()  # warm up
                for _ in range(cfg["iterations"]):
                    dist.barrier()
                    started = time.perf_counter()
                    st = step()
                    dist.barrier()
                    visit["iters"].append(time.perf_counter() - started)
                    visit["stats"].append((st.fwd_s, st.bwd_s, st.wait_s, st.sync_s,
                                           st.microbatches))
            visit["seg"] = seg
            visits.append(visit)
    trainer.switch(plan_from_dict(plans["even-dp"]))
    measure()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, {"visits": visits, "rounds": rounds})
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps({"plans": plans, "ranks": every}))


def _foreign(segs: list[dict[str, float]]) -> float:
    """Cores the other processes used over a segment (rank 0's wall clock)."""
    hz = os.sysconf("SC_CLK_TCK")
    return (segs[0]["busy_jiffies"] / hz - sum(s["cpu_s"] for s in segs)) / segs[0]["wall_s"]


def _effective(info: dict[str, Any]) -> Any:
    prof = dict(info["model"])
    prof["layers"] = [dict(la, fwd_gflop=f, bwd_gflop=b) for la, f, b in
                      zip(prof["layers"], info["fit"]["fwd_gflop"], info["fit"]["bwd_gflop"],
                          strict=True)]
    return model_from_dict(prof)


def _stage_medians(visits: list[dict[str, Any]]) -> dict[str, float]:
    """One rank's medians over ``visits``: per-microbatch forward / backward; per iteration
    wait (receives), exposed sync and outside (the iteration minus all of those: data, loss,
    optimizer step, barrier, sends)."""
    rows = [r for v in visits for r in v["stats"]]
    its = [t for v in visits for t in v["iters"]]
    return {
        "fwd": statistics.median(r[0] / r[4] for r in rows),
        "bwd": statistics.median(r[1] / r[4] for r in rows),
        "wait": statistics.median(r[2] for r in rows),
        "sync": statistics.median(r[3] for r in rows),
        "outside": statistics.median(t - (r[0] + r[1] + r[2] + r[3])
                                     for t, r in zip(its, rows, strict=True)),
    }


def _inrun(info: dict[str, Any], plan_d: dict[str, Any],
           per_rank: list[list[dict[str, Any]]]) -> float:
    """Spec 5.2/5.3 fed with the median per-microbatch stage times measured in the run."""
    cluster = cluster_from_dict(info["cluster"])
    model = _effective(info)
    plan = plan_from_dict(plan_d)
    orders = check_plan(plan, [d.id for d in cluster.devices], model.num_layers,
                        plan.global_batch)
    spans = []
    for gi, group in enumerate(plan.groups):
        comm = group_op_times(cluster, model, group, plan.microbatch_size).comm
        fwd, bwd = [], []
        for stage in group.stages:
            med = _stage_medians(per_rank[int(stage.device.split(":")[1])])
            fwd.append(med["fwd"])
            bwd.append(med["bwd"])
        spans.append(pipeline_makespan(fwd, bwd, comm, orders[gi]))
    return max(spans) + sync_time(cluster, model, plan.groups)


def _kind(plan: dict[str, Any]) -> str:
    groups = plan["groups"]
    if len(groups) > 1:
        return "DP " + "/".join(str(g["samples"]) for g in groups)
    stages = groups[0]["stages"]
    cut = stages[0]["layers"][1]
    rc = ", recompute on stage 0" if stages[0].get("recompute") else ""
    return f"PP {plan['schedule']} [0,{cut})+[{cut},{stages[1]['layers'][1]}){rc}"


def _err(measured: float, predicted: float) -> str:
    return f"{(measured / predicted - 1) * 100:+.1f}%"


def _report(cfg: dict[str, Any], plans: dict[str, dict[str, Any]],
            ranks: list[dict[str, Any]], quiet: bool, limit: float) -> bool:
    """Print the comparison over all rounds and visits, or over the quiet ones only
    (other processes below ``limit`` cores). False when there is nothing to compare."""
    n_rounds = len(ranks[0]["rounds"])
    round_load = [_foreign([r["rounds"][i]["seg"] for r in ranks]) for i in range(n_rounds)]
    use_r = [i for i in range(n_rounds) if not quiet or round_load[i] < limit]
    n_visits = len(ranks[0]["visits"])
    visit_load = [_foreign([r["visits"][i]["seg"] for r in ranks]) for i in range(n_visits)]
    use_v = [i for i in range(n_visits) if not quiet or visit_load[i] < limit]
    keys = [*plans, "even-dp (overlap)", "uneven-dp (overlap)"]
    by_key = {k: [i for i in use_v if ranks[0]["visits"][i]["key"] == k] for k in keys}
    title = (f"QUIET rounds and visits only (other processes < {limit:g} cores)" if quiet
             else "ALL rounds and visits")
    print(f"\n### {title}")
    if len(use_r) < 3 or any(len(by_key[k]) < 2 for k in plans):
        print(f"not enough (at least 3 rounds and 2 visits per plan): {len(use_r)} of "
              f"{n_rounds} rounds, visits per plan "
              + ", ".join(f"{k} {len(v)}" for k, v in by_key.items() if k in plans))
        return False
    print(f"other processes: {statistics.mean(round_load[i] for i in use_r):.2f} cores on "
          f"average over the {len(use_r)} of {n_rounds} measurement rounds used, "
          f"{statistics.mean(visit_load[i] for i in use_v):.2f} over the {len(use_v)} of "
          f"{n_visits} plan visits used (all: rounds "
          + " ".join(f"{x:.2f}" for x in round_load) + ")")
    net = _median_net([r["rounds"][i]["net"] for r in ranks[:1] for i in use_r])
    times = [_median_times([r["rounds"][i]["times"] for i in use_r]) for r in ranks]
    cluster, model, _, info = _cluster_model(cfg, net, times)
    predicted = _predict(cluster, model, plans, cfg["batch"])
    attach_c, attach_m, _, attach = _cluster_model(
        cfg, ranks[0]["rounds"][0]["net"], [r["rounds"][0]["times"] for r in ranks])
    attach_pred = _predict(attach_c, attach_m, plans, cfg["batch"])
    p2p_gbps = net["p2p_large_bytes"] * 8 / 1e9 / net["p2p_large_s"]
    print(f"link as the job measures it (median of rounds; the prediction's): "
          f"{net['link_gbps']:.2f} Gbit/s (2-rank all-reduce), latency "
          f"{net['link_latency_s'] * 1e6:.0f} us (busy {net['busy_p2p_s'] * 1e6:.0f} us, "
          f"idle {net['link_idle_s'] * 1e6:.0f} us)")
    print(f"network (median of rounds): p2p one-way {net['p2p_s'] * 1e6:.0f} us "
          f"({net['p2p_bytes']:.0f} B), p2p {p2p_gbps:.2f} Gbit/s (4 MB), all-reduce 16 MB in "
          f"{net['allreduce_s'] * 1e3:.1f} ms (ring-equivalent {info['ar_gbps']:.2f} Gbit/s), "
          f"barrier {net['barrier_s'] * 1e6:.0f} us")
    print("network by round (p2p one-way us / all-reduce 16 MB ms / busy p2p us): " + ", ".join(
        f"{1e6 * ranks[0]['rounds'][i]['net']['p2p_s']:.0f}/"
        f"{1e3 * ranks[0]['rounds'][i]['net']['allreduce_s']:.1f}/"
        f"{1e6 * ranks[0]['rounds'][i]['net']['busy_p2p_s']:.0f}" for i in use_r))
    for label, fit_info in (("first round only (= Attach)", attach),
                            (f"median of {len(use_r)} rounds", info)):
        fit = fit_info["fit"]
        print(f"fit, {label}: " + ", ".join(f"{d} {t * 1000:.1f} GFLOP/s"
                                            for d, t in fit["tflops"].items())
              + f"; rms_log_error {fit['rms_log_error']:.3f}")
    print("layer  profiled fwd/bwd GFLOP/sample  fitted fwd/bwd   measured fwd+bwd ms: "
          "rank 0 median [min-max] ; rank 1 median [min-max] over the rounds used")
    for i, ((pf, pb), f, b) in enumerate(zip(info["profiled_gflop"], info["fit"]["fwd_gflop"],
                                             info["fit"]["bwd_gflop"], strict=True)):
        cells = []
        for r in ranks:
            per = [1e3 * sum(r["rounds"][j]["times"][i]) for j in use_r]
            cells.append(f"{statistics.median(per):.2f} [{min(per):.2f}-{max(per):.2f}]")
        print(f"{i:5d}  {pf:.5f}/{pb:.5f}                {f:.5f}/{b:.5f}  " + " ; ".join(cells))
    per_key = {k: [[r["visits"][i] for i in by_key[k]] for r in ranks] for k in keys}
    rows = []
    for name, plan in plans.items():
        samples = [t for v in per_key[name][0] for t in v["iters"]]
        rows.append((name, _kind(plan), predicted[name]["iteration_s"],
                     statistics.median(samples), attach_pred[name]["iteration_s"],
                     _inrun(info, plan, per_key[name]), samples))
    print()
    print("| plan | kind | predicted s | measured s, median (n) | error | measured p10-p90 "
          "| predicted from Attach round | error | in-run prediction | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, kind, pred, meas, pred_a, inrun, samples in rows:
        lo, hi = (statistics.quantiles(samples, n=10)[::8] if len(samples) > 1
                  else (samples[0], samples[0]))
        print(f"| {name} | {kind} | {pred:.4f} | {meas:.4f} ({len(samples)}) | "
              f"{_err(meas, pred)} | {lo:.3f}-{hi:.3f} | {pred_a:.4f} | "
              f"{_err(meas, pred_a)} | {inrun:.4f} | {_err(meas, inrun)} |")
    worst = max(abs(m / p - 1) for _, _, p, m, *_ in rows)
    hits = sum(abs(m / p - 1) <= 0.10 for _, _, p, m, *_ in rows)
    print(f"\n{hits}/{len(rows)} plans within 10%; max |error| {worst * 100:.1f}%")
    for name in ("even-dp", "uneven-dp"):
        key = f"{name} (overlap)"
        if not per_key[key][0]:
            continue
        meas = statistics.median(t for v in per_key[key][0] for t in v["iters"])
        plain = next(r for r in rows if r[0] == name)[3]
        pred = predicted[name]["iteration_s"]
        print(f"{key}, overlap_sync=True: measured {meas:.4f} s ({plain:.4f} s with the sync "
              f"after the backward); prediction {pred:.4f} s: {_err(meas, pred)}")
    old_c, old_m, _, _ = _cluster_model(cfg, net, times, job_links=False)
    old_pred = _predict(old_c, old_m, plans, cfg["batch"])
    print(f"before the job measured its link (all-reduce ring-equivalent "
          f"{info['ar_gbps']:.2f} Gbit/s, idle ping-pong {net['p2p_s'] * 1e6:.0f} us as the "
          f"latency) the model predicted: "
          + ", ".join(f"{name} {old_pred[name]['iteration_s']:.4f} "
                      f"({_err(meas, old_pred[name]['iteration_s'])})"
                      for name, _, _, meas, *_ in rows))
    print("breakdown, medians: per microbatch, stage fwd+bwd in the run (the fit's); per "
          "iteration, wait in receives, exposed sync (the model's), outside = the rest "
          "(data, loss, sends, optimizer step, barrier):")
    for name, plan_d in plans.items():
        plan = plan_from_dict(plan_d)
        parts = []
        for group in plan.groups:
            op = group_op_times(cluster, model, group, plan.microbatch_size)
            for j, stage in enumerate(group.stages):
                med = _stage_medians(per_key[name][int(stage.device.split(":")[1])])
                parts.append(f"{stage.device} {1e3 * (med['fwd'] + med['bwd']):.1f} "
                             f"({1e3 * (op.fwd[j] + op.bwd[j]):.1f}) ms, wait "
                             f"{1e3 * med['wait']:.0f}, sync {1e3 * med['sync']:.0f} "
                             f"({1e3 * (predicted[name]['sync_s'] or 0.0):.0f}), outside "
                             f"{1e3 * med['outside']:.0f} ms")
        print(f"  {name}: " + "; ".join(parts))
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per visit")
    ap.add_argument("--repeats", type=int, default=8,
                    help="visits of every plan (alternating order), each but the first "
                         "preceded by a measurement round")
    ap.add_argument("--measure-repeats", type=int, default=3,
                    help="measure_layer_times repeats per round (3: what hetpilot train uses)")
    ap.add_argument("--quiet-cores", type=float, default=0.25,
                    help="a round or visit is quiet when the other processes on the machine "
                         "used fewer cores than this")
    ap.add_argument("--json", help="also write the raw measurements to this file")
    args = ap.parse_args()
    cfg = {"widths": list(WIDTHS), "batch": args.batch, "micro": args.micro,
           "iterations": args.iterations, "repeats": args.repeats,
           "measure_repeats": args.measure_repeats}
    print("REAL CPU compute (no emulation): 2 gloo ranks on a shared 2-core machine, "
          "one thread each")
    print(f"model: {len(WIDTHS) - 1} x (Linear + Tanh), widths {'-'.join(map(str, WIDTHS))}, "
          f"float32, MSE, SGD; batch {args.batch}, microbatch {args.micro}; "
          f"{args.repeats} visits x (1 warm-up + {args.iterations} timed iterations) per plan, "
          f"{args.repeats + 1} measurement rounds")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, WORLD, (tmp, cfg), 900)
        res = json.loads(Path(tmp, "result.json").read_text())
    wall = time.monotonic() - started
    if args.json:
        Path(args.json).write_text(json.dumps({"cfg": cfg, **res}))
    _report(cfg, res["plans"], res["ranks"], False, args.quiet_cores)
    _report(cfg, res["plans"], res["ranks"], True, args.quiet_cores)
    print(f"\n(bench wall {wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
