"""``report.md`` and its PNG plots (matplotlib, Agg) from a demo run."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import scenario
from .run import EpochRow, PhaseResult, RunResult

__all__ = ["headline", "summary", "write_report"]


def _cum(rows: list[EpochRow]) -> list[float]:
    out, t = [], 0.0
    for r in rows:
        t += r.epoch_s
        out.append(t)
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _avg_cost(rows: list[EpochRow]) -> float:
    total = sum(r.epoch_s for r in rows)
    return sum(r.cost_per_hour * r.epoch_s for r in rows) / total if total else 0.0


def summary(result: RunResult) -> dict[str, Any]:
    """The headline numbers: iteration time, time to the final accuracy, plans, cost."""
    s, h = result.static.rows, result.hetpilot.rows
    finals = [rows[-1].accuracy for rows in (s, h) if rows and rows[-1].accuracy is not None]
    target = min(finals) if len(finals) == 2 else None

    def time_to(rows: list[EpochRow]) -> float | None:
        if target is None:
            return None
        for r, t in zip(rows, _cum(rows), strict=True):
            if r.accuracy is not None and r.accuracy >= target:
                return t
        return None

    events = [ev.epoch for ev in scenario.events(result.epochs)]
    bounds = [0, *events, result.epochs]
    segments = []
    for (a, b), label in zip(itertools.pairwise(bounds),
                             ("nominal", "hostA:0 slowed 8x", "+ links to hostC throttled"),
                             strict=True):
        segments.append({
            "label": label, "epochs": (a, b),
            "static_ms": 1000 * _mean([r.iteration_s for r in s if a <= r.epoch < b]),
            "hetpilot_ms": 1000 * _mean([r.iteration_s for r in h if a <= r.epoch < b])})
    versions = [r.plan_version for r in h]
    return {
        "static_ms": 1000 * _mean([r.iteration_s for r in s]),
        "hetpilot_ms": 1000 * _mean([r.iteration_s for r in h]),
        "static_train_s": sum(r.epoch_s for r in s),
        "hetpilot_train_s": sum(r.epoch_s for r in h),
        "target_accuracy": target,
        "static_tta_s": time_to(s), "hetpilot_tta_s": time_to(h),
        "segments": segments,
        "first_version": versions[0] if versions else 0,
        "last_version": max(versions) if versions else 0,
        "daemon_versions": int(result.job.get("plan_version", 0)),
        "static_cost": _avg_cost(s), "hetpilot_cost": _avg_cost(h),
        "budget": scenario.BUDGET["price_per_hour"],
        "events": [e + 1 for e in events],
        "hetpilot_versions": versions,
    }


def headline(sm: dict[str, Any]) -> str:
    speed = sm["static_ms"] / sm["hetpilot_ms"] if sm["hetpilot_ms"] else float("nan")
    lines = [f"hetpilot vs static even data parallelism (EMULATED devices and events, "
             f"same run): mean iteration {sm['hetpilot_ms']:.0f} ms vs {sm['static_ms']:.0f} ms "
             f"({speed:.2f}x faster)"]
    if sm["target_accuracy"] is not None and sm["hetpilot_tta_s"] and sm["static_tta_s"]:
        lines.append(
            f"time to the final accuracy ({sm['target_accuracy']:.1%} held-out): "
            f"{sm['hetpilot_tta_s']:.1f} s vs {sm['static_tta_s']:.1f} s of training "
            f"({sm['static_tta_s'] / sm['hetpilot_tta_s']:.2f}x sooner)")
    lines.append(f"plan versions {sm['first_version']} -> {sm['last_version']} as the "
                 f"slowdown (epoch {sm['events'][0]}) and the throttle (epoch "
                 f"{sm['events'][1]}) landed; average cost ${sm['hetpilot_cost']:.2f}/h "
                 f"(static ${sm['static_cost']:.2f}/h), budget ${sm['budget']:g}/h")
    return "\n".join(lines)


def _plots(out: Path, result: RunResult) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, h = result.static.rows, result.hetpilot.rows
    events = scenario.events(result.epochs)
    names = []

    def mark(ax: Any) -> None:
        for ev in events:
            ax.axvline(ev.epoch + 0.5, color="grey", ls="--", lw=1)
        ax.text(0.01, 0.98, "EMULATED", transform=ax.transAxes, va="top", fontsize=8,
                color="grey")

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot([r.epoch + 1 for r in s], [1000 * r.iteration_s for r in s], "o-",
            label="static even DP")
    ax.plot([r.epoch + 1 for r in h], [1000 * r.iteration_s for r in h], "s-", label="hetpilot")
    mark(ax)
    ax.set(xlabel="epoch (dashed: slowdown, throttle)", ylabel="mean iteration (ms)",
           title="Iteration time per epoch")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "iteration_time.png", dpi=110)
    names.append("iteration_time.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.6))
    devices = [d for d, _ in scenario.DEVICES]
    bottom = [0.0] * len(h)
    for d in devices:
        vals = [float(r.samples.get(d, 0)) for r in h]
        ax.bar([r.epoch + 1 for r in h], vals, bottom=bottom, label=d)
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    for r in h:
        ax.text(r.epoch + 1, 1, f"v{r.plan_version}", ha="center", va="bottom", fontsize=8,
                color="white")
    mark(ax)
    ax.set(xlabel="epoch", ylabel="samples per iteration",
           title="hetpilot's plans: samples per device (static: 16 each)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out / "plans.png", dpi=110)
    names.append("plans.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for rows, label, style in ((s, "static even DP", "o-"), (h, "hetpilot", "s-")):
        pts = [(t, r.accuracy) for r, t in zip(rows, _cum(rows), strict=True)
               if r.accuracy is not None]
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style, label=label)
    ax.set(xlabel="training time (s)", ylabel="held-out accuracy (%)",
           title="Accuracy over time (digits, MLP)")
    ax.text(0.01, 0.02, "EMULATED devices", transform=ax.transAxes, fontsize=8, color="grey")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    names.append("accuracy.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    budget = scenario.BUDGET["price_per_hour"]
    for rows, label, style in ((s, "static even DP", "o-"), (h, "hetpilot", "s-")):
        avg, cost_t, t = [], 0.0, 0.0
        for r in rows:
            cost_t += r.cost_per_hour * r.epoch_s
            t += r.epoch_s
            avg.append(cost_t / t if t else 0.0)
        ax.plot([r.epoch + 1 for r in rows], [r.cost_per_hour for r in rows], style,
                label=f"{label}: rate")
        ax.plot([r.epoch + 1 for r in rows], avg, ":", label=f"{label}: running average")
    ax.axhline(budget, color="red", lw=1, label=f"budget ${budget:g}/h")
    mark(ax)
    ax.set(xlabel="epoch", ylabel="$ per hour", title="Cost against budget")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "cost.png", dpi=110)
    names.append("cost.png")
    plt.close(fig)
    return names


def _describe(plan: dict[str, Any]) -> str:
    parts = []
    for g in plan["groups"]:
        stages = " -> ".join(f"{st['device']}[{st['layers'][0]},{st['layers'][1]})"
                             for st in g["stages"])
        parts.append(f"{g['samples']}: {stages}")
    return f"{plan['schedule']}, " + "; ".join(parts)


def _rows_table(phase: PhaseResult) -> list[str]:
    out = ["| epoch | plan | iteration (ms) | epoch (s) | accuracy | $/h | devices (samples) |",
           "|---|---|---|---|---|---|---|"]
    for r in phase.rows:
        acc = "-" if r.accuracy is None else f"{r.accuracy:.1%}"
        plan = "even" if phase.name == "static" else f"v{r.plan_version}"
        devs = ", ".join(f"{d} ({r.samples.get(d, '-')})" for d in r.devices)
        out.append(f"| {r.epoch + 1} | {plan} | {1000 * r.iteration_s:.0f} | {r.epoch_s:.2f} "
                   f"| {acc} | {r.cost_per_hour:g} | {devs} |")
    return out


def write_report(out: Path, result: RunResult) -> str:
    """Write report.md and the PNGs; return the headline."""
    pngs = _plots(out, result)
    sm = summary(result)
    head = headline(sm)
    lines = [
        "# hetpilot demo report",
        "",
        "**Everything here ran on one machine without a GPU. Every device speed, link, "
        "price and event is EMULATED** (`hetpilot agent --emulate`, "
        "`--emulate-file`; `hetpilot train --emulate-file`, target-time emulation).",
        "",
        "## Headline",
        "",
        *[f"- {x}" for x in head.splitlines()],
        "",
        "| segment | epochs | static even DP (ms/iteration) | hetpilot (ms/iteration) | speed-up |",
        "|---|---|---|---|---|",
    ]
    for seg in sm["segments"]:
        a, b = seg["epochs"]
        ratio = seg["static_ms"] / seg["hetpilot_ms"] if seg["hetpilot_ms"] else float("nan")
        lines.append(f"| {seg['label']} | {a + 1}-{b} | {seg['static_ms']:.0f} | "
                     f"{seg['hetpilot_ms']:.0f} | {ratio:.2f}x |")
    lines += [
        "",
        f"Training time (sum of epochs): static {sm['static_train_s']:.1f} s, hetpilot "
        f"{sm['hetpilot_train_s']:.1f} s. Wall time of each phase, start-up included: static "
        f"{result.static.wall_s:.1f} s, hetpilot {result.hetpilot.wall_s:.1f} s; whole demo "
        f"{result.total_s:.1f} s.",
        "",
        "## What ran",
        "",
        "- `hetpilot daemon` on 127.0.0.1 (OS-picked port, tokens), three `hetpilot agent`s "
        "declaring EMULATED devices: " + ", ".join(
            f"{d} {h.tflops:g} TFLOP/s ${h.price_per_hour:g}/h" for d, h in scenario.DEVICES)
        + f"; EMULATED links {scenario.LINK_GBPS:g} Gbit/s between hosts.",
        "- a 4-rank `hetpilot train` job (gloo, real torch.distributed ranks, one thread "
        "each) training a 3-layer MLP (`nn.Sequential`) on scikit-learn's digits "
        "(1437 training, 360 held-out images), batch 64, microbatch 4, Adam; accuracy is "
        "the held-out split scored from the checkpoint written after each epoch.",
        "- EMULATED events, at the same epochs in both phases: " + "; ".join(
            f"epoch {ev.epoch + 1}: {ev.text}" for ev in scenario.events(result.epochs))
        + ". Agents report the new speed and link rates (the daemon sees them within a "
        "report, 0.25 s); trainer ranks sleep to the same speed and stretch each gradient "
        "all-reduce to spec v1 section 5.3's time over the same links. Pipeline activation "
        "transfers are not slowed (they run over loopback).",
        "",
        "**How the comparison is made.** One run, two phases one after the other on the same "
        "EMULATED cluster, seeds, data order and epoch count: first the *static* plan (even "
        "data parallelism from a plan file, 16 samples per device, never changed), then "
        "*hetpilot* (the daemon's plans, switched live before the next iteration once the "
        "daemon publishes them). Each event is "
        "written to the emulation file when rank 0 reports the epoch before it, in both "
        "phases. The trainer's update equals full-batch training whatever the plan, so "
        "accuracy per epoch is the same in both phases up to float rounding; what differs "
        "is the time each epoch takes. Iteration time is the slowest working rank's mean "
        "over the epoch; training time excludes process start-up, plan switches and "
        "checkpoints (wall times above include them).",
        "",
        "**Reaction.** Seconds from each event to the trainer's first plan switch after it "
        "(the daemon's slot is 0.5 s; agents report every 0.25 s): " + (", ".join(
            f"epoch {ev + 1}: " + (f"{r:.2f} s" if r is not None else "no switch")
            for (ev, _), r in zip(result.hetpilot.events, result.hetpilot.reactions_s(),
                                  strict=True)) or "no events") + ".",
        "",
        "## Plots",
        "",
        *[f"![{p}]({p})" for p in pngs],
        "",
        f"## Plan versions (daemon, job {result.job.get('job_id', '?')})",
        "",
        "| version | slot | predicted iteration (ms) | $/h | plan: samples: stages |",
        "|---|---|---|---|---|",
    ]
    for pv in result.plans:
        lines.append(f"| {pv['version']} | {pv['slot']} | {1000 * pv['iteration_s']:.0f} | "
                     f"{pv['costs'].get('price_per_hour', 0):g} | {_describe(pv['plan'])} |")
    def fmt(d: dict[str, Any]) -> str:
        return ", ".join(f"{k} {float(v):.2f}" for k, v in sorted(d.items())) or "-"

    lines += [
        "",
        f"Daemon at the end: plan version {sm['daemon_versions']}, slot "
        f"{result.job.get('slot', '?')}; average cost over its slots: "
        f"{fmt(result.job.get('average_costs', {}))}; budgets: "
        f"{fmt(result.job.get('budgets', {}))}; queues: {fmt(result.job.get('queues', {}))}.",
        "",
        "## Epochs: static even DP",
        "",
        *_rows_table(result.static),
        "",
        "## Epochs: hetpilot",
        "",
        *_rows_table(result.hetpilot),
        "",
        "Logs of every process, the daemon's SQLite state and the ranks' per-epoch "
        "records are in `run/`.",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    (out / "headline.txt").write_text(head + "\n")
    (out / "summary.json").write_text(json.dumps({
        **sm, "emulated": True, "total_s": result.total_s, "job": result.job,
        "plans": result.plans,
        "static": [asdict(r) for r in result.static.rows],
        "hetpilot": [asdict(r) for r in result.hetpilot.rows]}, indent=1, default=str))
    return head
