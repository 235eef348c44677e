"""Time to accuracy under injected interference: static sync vs hetpilot sync
(re-planning through the gate) vs hetpilot async (PipeDream, staleness-aware).

    .venv/bin/python bench/adapt_tta.py [--microbatches 480] [--target 0.95]

Real parts: scikit-learn's digits data set (ships offline), an 8-layer MLP,
4 gloo ranks over loopback running :mod:`hetpilot.trainer.async_pipeline`.
**EMULATED**: device speeds 1, 1, 0.5, 0.5 (each forward takes
``layers x unit_s / speed``, backward twice that; the real compute runs and
the rest is slept) and the interference: rank 1 drops to ``--factor`` of its
speed at microbatch ``--at``.

- static sync: 1F1B with a flush, cut once for the quiet speeds, kept;
- hetpilot sync: the same, re-cut by the min-max partition on the slowed
  speeds once the gate admits it: the change is first seen one iteration
  after it starts and confirmed one iteration later (confirm_slots = 2);
- hetpilot async: PipeDream 1F1B with weight stashing, no flush; the number
  of stages and the cut come from the planner's staleness-aware objective
  (:func:`hetpilot.planner.asyncplan.choose_by_time_to_accuracy`: estimated
  time to accuracy over the fastest-first pipelines of 1-4 stages) with a
  staleness model fitted here from measured runs (sequential PipeDream
  replays with 1, 2, 3, 4 stages, microbatches to the target accuracy);
- hetpilot async, re-cut: the same, and the planner re-cuts the same ranks for
  the slowed speeds (:func:`hetpilot.planner.asyncplan.pipeline_cut`) at the
  microbatch where the gate admits the synchronous re-plan; the pipeline
  drains there, the layers move, and streaming resumes.

Accuracy is measured after each run on snapshots of the weights (test
split, 20%), so evaluation is not in the timed path. Writes a JSON summary
to stdout and the plot to ``--plot`` (bench/adapt_tta.png).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from hetpilot.adapt.staleness import fit, mean_staleness
from hetpilot.planner.asyncplan import choose_by_time_to_accuracy, cut_points, pipeline_cut
from hetpilot.planner.types import Cluster, Device, Job, Layer, Model, Network
from hetpilot.trainer.async_pipeline import Phase, PipeConfig, run_local
from hetpilot.trainer.testing.tta import LAYERS, Speeds, digits_mlp
from torch import nn


def _data() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(x))
    n_te = len(x) // 5
    te, tr = idx[:n_te], idx[n_te:]
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return f(x[tr]), torch.tensor(y[tr]), f(x[te]), torch.tensor(y[te])


def _acc(states: dict[int, dict[str, torch.Tensor]], xt: torch.Tensor, yt: torch.Tensor) -> float:
    layers = digits_mlp()
    for i, st in states.items():
        layers[i].load_state_dict(st)
    with torch.no_grad():
        return float((nn.Sequential(*layers)(xt).argmax(1) == yt).float().mean())


def _cuts(speeds: list[float]) -> tuple[int, ...]:
    """Contiguous min-max partition of equal layers over ranks in order (empty stages allowed)."""
    R, L = len(speeds), LAYERS
    best = {(R, L): (0.0, ())}
    for r in range(R - 1, -1, -1):
        for a in range(L, -1, -1):
            opts = []
            for b in range(a, L + 1) if r < R - 1 else [L]:
                if (r + 1, b) in best:
                    rest, tail = best[(r + 1, b)]
                    opts.append((max((b - a) / speeds[r], rest), (b, *tail)))
            if opts:
                best[(r, a)] = min(opts)
    return (0, *best[(0, 0)][1])


def _as_planner_input(speeds: list[float], microbatch: int, per_iteration: int,
                      unit_s: float) -> tuple[Cluster, Model, Job]:
    """The EMULATED ranks as the planner sees them: rank r is device ``r{r}`` with
    ``speeds[r]`` TFLOP/s; a layer's forward takes ``unit_s / speed`` per microbatch and
    its backward twice that; loopback transfers of a 32 x 128 float32 activation."""
    gflop = unit_s * 1000.0 / microbatch  # per sample, so that micro x gflop / (1000 x tflops) = unit_s
    devices = tuple(Device(id=f"r{r}", host="local", tflops=sp, memory_gb=16.0)
                    for r, sp in enumerate(speeds))
    cluster = Cluster(devices=devices, network=Network(intra_host_gbps=10.0, inter_host_gbps=10.0,
                                                       latency_us=50.0))
    act_mb = 128 * 4 / 1e6
    layers = tuple(Layer(name=f"l{i}", fwd_gflop=gflop, bwd_gflop=2 * gflop, out_mb=act_mb,
                         act_mb=act_mb, param_mb=0.07) for i in range(LAYERS))
    job = Job(global_batch=microbatch * per_iteration, microbatch_size=microbatch, schedules=("1f1b",))
    return cluster, Model(name="digits-mlp", layers=layers), job


def _curve(results: list[dict], xt: torch.Tensor, yt: torch.Tensor) -> list[tuple[float, float]]:
    by_k: dict[int, tuple[float, dict]] = {}
    for res in results:
        for k, t, st in res["snaps"]:
            t0, merged = by_k.get(k, (0.0, {}))
            by_k[k] = (max(t0, t), {**merged, **st})
    return [(t, _acc(st, xt, yt)) for k, (t, st) in sorted(by_k.items())]


def _replay(stages: int, xtr, ytr, xt, yt, mb: int, lr: float, n: int, target: float) -> int:
    """Sequential PipeDream replay (one cut per stage count): microbatches to target."""
    layers = digits_mlp()
    cuts = _cuts([1.0] * stages)
    mods = [nn.Sequential(*layers[cuts[j]:cuts[j + 1]]) for j in range(stages)]
    hist = [[{k: p.detach().clone() for k, p in m.named_parameters()}] for m in mods]
    perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(0))
    for k in range(n):
        idx = perm[(torch.arange(mb) + k * mb) % len(xtr)]
        h, used = xtr[idx], []
        for j, m in enumerate(mods):
            w = {a: t.clone().requires_grad_(True)
                 for a, t in hist[j][max(0, k - (stages - j - 1))].items()}
            used.append(w)
            h = torch.func.functional_call(m, w, (h,))
        nn.functional.cross_entropy(h, ytr[idx]).backward()
        for j in range(stages):
            hist[j].append({a: hist[j][-1][a] - lr * used[j][a].grad for a in used[j]})
        if (k + 1) % 8 == 0:
            with torch.no_grad():
                h = xt
                for j, m in enumerate(mods):
                    h = torch.func.functional_call(m, hist[j][-1], (h,))
                if float((h.argmax(1) == yt).float().mean()) >= target:
                    return k + 1
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=480)
    p.add_argument("--microbatch", type=int, default=32)
    p.add_argument("--per-iteration", type=int, default=4)
    p.add_argument("--unit-ms", type=float, default=2.0)
    p.add_argument("--at", type=int, default=64)
    p.add_argument("--factor", type=float, default=0.15)
    p.add_argument("--lr", type=float, default=0.05, help="async: per-microbatch step")
    p.add_argument("--sync-lr", type=float, default=0.2,
                   help="sync: one step per iteration of --per-iteration microbatches (linear scaling)")
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--plot", default="bench/adapt_tta.png")
    a = p.parse_args()
    torch.set_num_threads(1)
    xtr, ytr, xt, yt = _data()
    base = [1.0, 1.0, 0.5, 0.5]
    speeds = Speeds(tuple(base), hit=1, factor=a.factor, at=a.at)
    common = dict(make_layers=digits_mlp, data=(xtr, ytr), microbatch=a.microbatch,
                  microbatches=a.microbatches, per_iteration=a.per_iteration, lr=a.lr,
                  unit_s=a.unit_ms / 1000, speed=speeds, snapshot_every=a.per_iteration)
    sync = {**common, "lr": a.sync_lr}
    quiet = _cuts(base)
    slowed = list(base)
    slowed[1] *= a.factor
    hit_cuts = _cuts(slowed)
    # the gate: change starts in iteration at/M, is seen after it, confirmed one later
    replan_at = (a.at // a.per_iteration + 2) * a.per_iteration
    # staleness model from measured (replayed) runs
    t0 = time.perf_counter()
    measured = {S: _replay(S, xtr, ytr, xt, yt, a.microbatch, a.lr, a.microbatches, a.target)
                for S in (1, 2, 3, 4)}
    model = fit([mean_staleness(S) for S in measured], [measured[S] for S in measured])
    fit_s = time.perf_counter() - t0
    # async: the planner's staleness-aware objective picks the stages and the cut
    choices = choose_by_time_to_accuracy(*_as_planner_input(base, a.microbatch, a.per_iteration,
                                                            a.unit_ms / 1000), model,
                                         synchronous=False)
    best = choices[0]
    S_async, async_cuts = best.stages, tuple(cut_points(best.plan))
    # ... and re-cuts the same ranks for the slowed speeds, admitted by the gate at the
    # same point as the synchronous re-plan (the pipeline drains there)
    slowed_cluster, dmodel, djob = _as_planner_input(slowed, a.microbatch, a.per_iteration,
                                                    a.unit_ms / 1000)
    recut = pipeline_cut(slowed_cluster, dmodel, djob, [f"r{r}" for r in range(S_async)])
    async_hit_cuts = tuple(cut_points(recut)) if recut is not None else async_cuts
    runs = {}
    for name, world, cfg in [
        ("static sync", 4, PipeConfig(phases=[Phase(0, quiet)], flush=True, **sync)),
        ("hetpilot sync (re-plan)", 4, PipeConfig(
            phases=[Phase(0, quiet), Phase(replan_at, hit_cuts)], flush=True, **sync)),
        (f"hetpilot async ({S_async} stages)", S_async, PipeConfig(
            phases=[Phase(0, async_cuts)], flush=False, **common)),
        (f"hetpilot async ({S_async} stages), re-cut", S_async, PipeConfig(
            phases=[Phase(0, async_cuts), Phase(replan_at, async_hit_cuts)], flush=False, **common)),
    ]:
        res = run_local(world, cfg, timeout_s=600)
        curve = _curve(res, xt, yt)
        tta = next((t for t, acc in curve if acc >= a.target), None)
        runs[name] = {"world": world, "elapsed_s": round(max(r["elapsed_s"] for r in res), 2),
                      "recut_s": round(max(r["recut_s"] for r in res), 3),
                      "final_acc": round(curve[-1][1], 4), "tta_s": None if tta is None else round(tta, 2),
                      "curve": [(round(t, 3), round(acc, 4)) for t, acc in curve]}
    base_tta = runs["static sync"]["tta_s"]
    summary = {"EMULATED": "device speeds and the injected interference are emulated (sleep)",
               "target_acc": a.target, "speeds": base, "hit": {"rank": 1, "factor": a.factor, "at_microbatch": a.at},
               "cuts": {"quiet": quiet, "after_replan": hit_cuts, "replan_at_microbatch": replan_at},
               "staleness": {"measured_microbatches_to_target": measured, "I0": round(model.I0, 1),
                             "alpha": round(model.alpha, 3), "fit_s": round(fit_s, 1),
                             "chosen_stages": S_async, "chosen_cut": async_cuts,
                             "recut_after_interference": async_hit_cuts,
                             "estimated_tta_s": {f"{c.stages} stages": round(c.tta_s, 3)
                                                 for c in sorted(choices, key=lambda c: c.stages)}},
               "runs": {k: {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in runs.items()},
               "speedup_vs_static": {k: (None if v["tta_s"] is None or base_tta is None
                                         else round(base_tta / v["tta_s"], 2))
                                     for k, v in runs.items()}}
    print(json.dumps(summary, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, v in runs.items():
        ts, accs = zip(*v["curve"], strict=True)
        ax.plot(ts, accs, label=f"{name} (TTA {v['tta_s']} s)")
    ax.axhline(a.target, color="grey", ls=":", lw=1)
    ax.set_xlabel("wall-clock s (EMULATED speeds and interference)")
    ax.set_ylabel("test accuracy (digits)")
    ax.set_ylim(0.5, 1.0)
    ax.set_title(f"time to {a.target:.0%}: rank 1 slowed x{a.factor} at microbatch {a.at}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
