"""``hetpilot sim`` (docs/spec.md section 7): drive policies through a scenario.

Output on stdout is JSON lines (``--json`` names that default): one object
per slot and one summary object (``"summary": true``) per policy. ``--table``
prints a readable table instead. ``--sweep-V 0.1,1,10`` prints one line per
V (the trade-off: average iteration time against average cost and backlog).
``--plot out.png`` draws the chosen policies side by side; a path that cannot
be written is bad input, found before the run. A long run draws a progress bar
on stderr when that is a terminal (never with ``--json``; see
:mod:`hetpilot.sim.progress`).

Exit codes: 0 ok; 2 bad input (one line on stderr naming the field), also
with ``--strict`` when a budget is below the cheapest feasible plan at slot 0
(without it that is a warning on stderr and in the output, and the controller
does its best); 3 when no slot of the run could place a plan.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetpilot.planner.errors import ValidationError

from .engine import SlotRecord, simulate, summarize
from .policies import POLICY_NAMES, CachedSearch, parse_policies
from .progress import SlotProgress, progress_wanted, slot_steps
from .scenario import Scenario, Timeline, load_scenario

__all__ = ["add_arguments", "run"]


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", required=True, metavar="S.json",
                        help="cluster, model, job, slots and events (format: see docs/spec.md)")
    parser.add_argument("--policy", default="lyapunov", metavar="NAME[,NAME...]",
                        help=f"one or more of {', '.join(POLICY_NAMES)} (default lyapunov)")
    parser.add_argument("--emit-plans", action="store_true", help="add each slot's plan")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="JSON lines on stdout (the default)")
    out.add_argument("--table", action="store_true", help="a readable table instead of JSON lines")
    parser.add_argument("--seed", type=int, default=0, help="seed of the measurement noise")
    parser.add_argument("--noise", type=float, default=0.0, metavar="FRAC",
                        help="relative noise on what policies observe (default 0: exact, one slot late)")
    parser.add_argument("--slots", type=int, metavar="N", help="run only the first N slots")
    parser.add_argument("--V", type=float, dest="V", metavar="V", help="override the job's V")
    parser.add_argument("--hysteresis", type=float, metavar="FRAC",
                        help="controller hysteresis (default 0.02)")
    parser.add_argument("--plot", metavar="out.png",
                        help="plot iteration time, cost and backlog (png, pdf, svg, ...); "
                             "checked before the run")
    parser.add_argument("--sweep-V", dest="sweep_v", metavar="V1,V2,...",
                        help="run the first policy once per V and print the trade-off")
    parser.add_argument("--strict", action="store_true",
                        help="exit 2 when a budget is below the cheapest feasible plan at slot 0")


def _fail(message: str, code: int) -> int:
    print(f"hetpilot: error: {message}", file=sys.stderr)
    return code


def _check_args(args: argparse.Namespace) -> list[float]:
    if not (math.isfinite(args.noise) and args.noise >= 0):
        raise ValidationError("--noise", f"must be >= 0, got {args.noise}")
    if args.slots is not None and args.slots < 1:
        raise ValidationError("--slots", f"must be >= 1, got {args.slots}")
    if args.V is not None and not (math.isfinite(args.V) and args.V > 0):
        raise ValidationError("--V", f"must be > 0, got {args.V}")
    if args.hysteresis is not None and not (math.isfinite(args.hysteresis) and args.hysteresis >= 0):
        raise ValidationError("--hysteresis", f"must be >= 0, got {args.hysteresis}")
    sweep: list[float] = []
    if args.sweep_v:
        for part in args.sweep_v.split(","):
            try:
                v = float(part)
            except ValueError:
                raise ValidationError("--sweep-V", f"{part!r} is not a number") from None
            if not (math.isfinite(v) and v > 0):
                raise ValidationError("--sweep-V", f"values must be > 0, got {part}")
            sweep.append(v)
    if args.plot is not None:
        _check_plot(args.plot)
    return sweep


def _check_plot(path: str) -> None:
    """Fail before the run, not after minutes of it, if ``--plot`` cannot be written:
    a missing folder, a folder given as the file, no write permission, a read-only
    file system, or a format matplotlib does not write. Probes by opening the file
    for appending (which creates it if missing; a file created here is removed)."""
    target = Path(path)
    suffix = target.suffix.lower().lstrip(".")
    if suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            raise ValidationError("--plot", f"cannot write {path!r}: unknown image format "
                                            f"{target.suffix!r}; use one of {', '.join(sorted(formats))}")
    folder = target.parent
    if not folder.is_dir():
        why = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ValidationError("--plot", f"cannot write {path!r}: {str(folder)!r} {why}")
    if target.is_dir():
        raise ValidationError("--plot", f"cannot write {path!r}: it is a folder")
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise ValidationError("--plot", f"cannot write {path!r}: {exc.strerror or exc}") from None
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(target)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BrokenPipeError:  # `hetpilot sim ... | head`: stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(args: argparse.Namespace) -> int:
    try:
        sweep = _check_args(args)
        policies = parse_policies(args.policy)
        scenario = load_scenario(args.scenario)
    except ValidationError as exc:
        return _fail(str(exc), 2)
    from hetpilot.planner.controller import planner_search

    search = CachedSearch(planner_search)
    timeline = Timeline(scenario, args.slots)
    devices = len(scenario.cluster.devices)
    step = slot_steps(1, 1, devices)
    total = slot_steps(len(timeline), len(sweep) or len(policies), devices)
    bar = SlotProgress(total, progress_wanted(args, total, sys.stdout, sys.stderr))
    if sweep:
        with bar:
            trade_off = _sweep(scenario, timeline, policies[0], sweep, search, args, bar, step)
        if args.table:
            _print_table(trade_off)
        if args.plot:
            from .plot import plot_sweep

            try:
                plot_sweep(trade_off, args.plot, title=args.scenario)
            except OSError as exc:
                return _fail(f"--plot: cannot write {args.plot!r}: {exc.strerror or exc}", 2)
        return 0
    runs: dict[str, list[SlotRecord]] = {}
    rows: list[dict[str, Any]] = []
    with bar:
        for name in policies:
            bar.begin(name)
            records: list[SlotRecord] = []
            seen: set[str] = set()
            for rec in simulate(scenario, name, seed=args.seed, noise=args.noise, slots=args.slots,
                                V=args.V, hysteresis=args.hysteresis, timeline=timeline,
                                search=search):
                bar.advance(step)
                records.append(rec)
                for w in rec.warnings:
                    if w.startswith("job.budgets.") and w not in seen:
                        seen.add(w)
                        if args.strict and rec.slot == 0:
                            return _fail(w.split("; ")[0], 2)
                        print(f"hetpilot: warning: {name}: {w}", file=sys.stderr)
                row = rec.to_dict(args.emit_plans)
                if args.table:
                    rows.append(row)
                else:
                    print(json.dumps(row), flush=False)
            summary = summarize(records)
            runs[name] = records
            if args.table:
                rows.append(summary)
            else:
                print(json.dumps(summary), flush=True)
    if args.table:
        _print_table(rows)
    if args.plot:
        from .plot import plot_runs

        try:
            plot_runs(runs, args.plot, title=args.scenario)
        except OSError as exc:
            return _fail(f"--plot: cannot write {args.plot!r}: {exc.strerror or exc}", 2)
    if all(r.iteration_s is None for recs in runs.values() for r in recs):
        return _fail("no slot of the run could place a plan: nothing fits in memory", 3)
    return 0


def _sweep(scenario: Scenario, timeline: Timeline, policy: str, values: Sequence[float],
           search: CachedSearch, args: argparse.Namespace, bar: SlotProgress,
           step: int) -> list[dict[str, Any]]:
    """One row per V (printed at once as JSON lines unless ``--table``)."""
    rows = []
    for v in values:
        bar.begin(f"{policy} V={v:g}")
        records = []
        for rec in simulate(scenario, policy, seed=args.seed, noise=args.noise,
                            slots=args.slots, V=v, hysteresis=args.hysteresis,
                            timeline=timeline, search=search):
            bar.advance(step)
            records.append(rec)
        s = summarize(records)
        row = {
            "V": v,
            "policy": policy,
            "avg_iteration_s": s["avg_iteration_s"],
            "avg_effective_iteration_s": s["avg_effective_iteration_s"],
            "avg_price_per_hour": s["avg_price_per_hour"],
            "avg_power_watts": s["avg_power_watts"],
            "budgets": s["budgets"],
            "avg_queues": s["avg_queues"],
            "max_queues": s["max_queues"],
            "switches": s["switches"],
        }
        rows.append(row)
        if not args.table:
            print(json.dumps(row), flush=True)
    return rows


_SLOT_COLS = (("policy", "policy"), ("slot", "slot"), ("iteration_s", "T s"),
              ("price_per_hour", "$/h"), ("power_watts", "W"), ("queues", "Q"),
              ("switched", "switch"), ("switch_s", "switch s"), ("version", "v"))
_SUMMARY_COLS = (("policy", "policy"), ("slots", "slots"), ("avg_iteration_s", "avg T s"),
                 ("avg_effective_iteration_s", "avg T+switch s"), ("avg_price_per_hour", "avg $/h"),
                 ("avg_power_watts", "avg W"), ("budgets", "budget"), ("max_queues", "max Q"),
                 ("switches", "switches"), ("stalled_slots", "stalls"))
_SWEEP_COLS = (("V", "V"), ("avg_iteration_s", "avg T s"),
               ("avg_effective_iteration_s", "avg T+switch s"), ("avg_price_per_hour", "avg $/h"),
               ("avg_power_watts", "avg W"), ("budgets", "budget"), ("avg_queues", "avg Q"),
               ("max_queues", "max Q"), ("switches", "switches"))


def _print_table(rows: Sequence[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    groups = (
        ("slots", _SLOT_COLS, [r for r in rows if "slot" in r]),
        ("summary", _SUMMARY_COLS, [r for r in rows if r.get("summary")]),
        ("trade-off over V", _SWEEP_COLS, [r for r in rows if "V" in r]),
    )
    for title, cols, chosen in groups:
        if not chosen:
            continue
        table = Table(title=title)
        for _, header in cols:
            table.add_column(header, overflow="fold")
        for r in chosen:
            table.add_row(*[_cell(r.get(key)) for key, _ in cols])
        console.print(table)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        units = {"price_per_hour": "$/h", "power_watts": "W"}
        return " ".join(f"{_cell(v)} {units.get(k, k)}" for k, v in value.items())
    return str(value)
