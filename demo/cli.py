"""``hetpilot demo [--epochs N] [--quick] [--out DIR] [--no-live]``.

Runs the whole control plane on this machine (no GPU, no network: loopback,
OS-picked ports) with EMULATED devices and events, shows a live view, and
writes ``DIR/report.md`` with PNG plots. Every process it starts is stopped
when it ends, fails, or is interrupted (Ctrl-C, SIGTERM).

Exit codes: 0 ok, 1 the demo failed (the log of the failing process is
printed), 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per phase (default 12; 6 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a shorter run (tests, slow machines)")
    parser.add_argument("--out", default="hetpilot-demo", metavar="DIR",
                        help="where report.md, the plots and run/ (logs, state) go")
    parser.add_argument("--no-live", action="store_true",
                        help="plain progress lines instead of the live view")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="give up on a phase after this many seconds (default 240; 100 quick)")


def _table(demo: Any) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from . import scenario

    table = Table(title="hetpilot demo (every device, link and event is EMULATED)",
                  expand=False)
    devices = [d for d, _ in scenario.DEVICES]
    for col in ("phase", "epoch", "plan", "iteration", "accuracy", "$/h (budget)",
                "samples " + "/".join(d.replace("host", "") for d in devices)):
        table.add_column(col, no_wrap=True)
    budget = scenario.BUDGET["price_per_hour"]
    for phase in demo.phases:
        if not phase.rows:
            table.add_row(phase.name, "starting", "", "", "", "", "")
            continue
        r = phase.rows[-1]
        acc = next((x.accuracy for x in reversed(phase.rows) if x.accuracy is not None), None)
        plan = "even" if phase.name == "static" else f"v{r.plan_version}"
        table.add_row(phase.name, f"{r.epoch + 1}/{demo.epochs}", plan,
                      f"{r.iteration_s * 1000:.0f} ms", "-" if acc is None else f"{acc:.1%}",
                      f"{r.cost_per_hour:g} ({budget:g})",
                      "/".join(str(r.samples.get(d, 0)) for d in devices))
    lines = Text("\n".join(demo.log[-6:]))
    return Group(table, lines)


def run(args: argparse.Namespace) -> int:
    epochs = args.epochs if args.epochs is not None else (6 if args.quick else 12)
    if epochs < 3:
        print("hetpilot demo: error: --epochs: must be >= 3 (events land at 1/3 and 2/3)",
              file=sys.stderr)
        return 2
    timeout = args.timeout if args.timeout is not None else (100.0 if args.quick else 240.0)
    out = Path(args.out)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    from rich.console import Console
    from rich.live import Live

    from .report import write_report
    from .run import DemoError, run_demo

    console = Console()
    live_mode = console.is_terminal and not args.no_live
    printed: dict[str, int] = {"log": 0}

    def plain(demo: Any) -> None:
        for line in demo.log[printed["log"]:]:
            print(line, flush=True)
        printed["log"] = len(demo.log)
        for phase in demo.phases:
            key = f"rows-{phase.name}"
            for r in phase.rows[printed.get(key, 0):]:
                if r.accuracy is None:
                    break  # print once its accuracy is known
                plan = "even" if phase.name == "static" else f"v{r.plan_version}"
                print(f"[{phase.name}] epoch {r.epoch + 1}/{demo.epochs} plan {plan} "
                      f"iteration {r.iteration_s * 1000:.0f} ms accuracy {r.accuracy:.1%} "
                      f"cost ${r.cost_per_hour:g}/h devices {','.join(r.devices)}", flush=True)
                printed[key] = printed.get(key, 0) + 1

    try:
        if live_mode:
            with Live(console=console, auto_refresh=False, transient=False) as live:
                def update(demo: Any) -> None:
                    live.update(_table(demo), refresh=True)

                result = run_demo(out, epochs, update, timeout)
        else:
            print("hetpilot demo: every device, link and event below is EMULATED", flush=True)
            result = run_demo(out, epochs, plain, timeout)
    except DemoError as exc:
        print(f"hetpilot demo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hetpilot demo: interrupted; every process it started was stopped",
              file=sys.stderr)
        return 130
    headline = write_report(out, result)
    print()
    print(headline)
    print(f"\nwrote {out / 'report.md'} and its plots (accuracy.png, cost.png, iteration_time.png, plans.png); "
          f"logs and state in {out / 'run'}")
    return 0
