"""The one console command, ``hetpilot``, and its subcommands.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them together. Modules are imported
lazily, so ``hetpilot plan`` never imports torch or grpc.

Exit codes: 0 success, 1 failure at run time, 2 bad input (one line on stderr
naming the field), 3 no feasible plan; subcommands document their own extras.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("hetpilot.planner.cli", "plan a cluster, model and batch (formats: see docs/spec.md)"),
    "evaluate": ("hetpilot.planner.cli", "judge a plan with the reference model (see docs/spec.md)"),
    "train-check": ("hetpilot.trainer.cli",
                    "check the trainer against full-batch training on N local ranks (float64)"),
    "profile": ("hetpilot.trainer.cli", "measure a model's per-layer profile (format: see docs/spec.md)"),
    "train": ("hetpilot.trainer.cli", "run a training job on a plan file (under torchrun)"),
    "export": ("hetpilot.trainer.cli",
               "write a training checkpoint as one state_dict of nn.Sequential(*layers)"),
    "daemon": ("hetpilot.daemon.cli", "run the control-plane daemon (head node)"),
    "agent": ("hetpilot.agents.cli", "run the node agent (one per GPU host)"),
    "submit": ("hetpilot.client.cli", "submit a job file (job.toml); prints the job id"),
    "jobs": ("hetpilot.client.cli", "list your jobs"),
    "job": ("hetpilot.client.cli", "show one job"),
    "watch": ("hetpilot.client.cli", "follow a job's plan versions live"),
    "budget": ("hetpilot.client.cli", "change a job's budgets or V (price_per_hour=20 V=5)"),
    "cancel": ("hetpilot.client.cli", "cancel a job"),
    "logs": ("hetpilot.client.cli",
             "print a launched job's output (--rank R: one rank; --follow: until it ends)"),
    "nodes": ("hetpilot.client.nodes",
              "list agents and devices: state, speeds, memory, load, price (--links: links)"),
    "drain": ("hetpilot.client.nodes",
              "leave a host out of planning from each job's next slot (cluster token)"),
    "resume": ("hetpilot.client.nodes", "plan on a drained host again (cluster token)"),
    "sim": ("hetpilot.sim.cli", "drive policies through a scenario and score every slot (see docs/spec.md)"),
    "demo": ("hetpilot.demo.cli",
             "run daemon, agents and a 4-rank trainer on this machine (EMULATED devices); "
             "write a report"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetpilot",
        description="Control plane for distributed training on heterogeneous GPU clusters.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _version() -> str:
    from hetpilot import __version__

    return f"hetpilot {__version__}"


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line on stderr (the default prints usage too)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _build_parser()
        if not argv:
            parser.print_help()
            return 2
        parser.parse_args(argv)  # --help, --version, or an error for an unknown command
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = _Parser(prog=f"hetpilot {name}", description=COMMANDS[name][1])
    module.add_arguments(name, parser)
    args = parser.parse_args(argv[1:])
    args.command = name
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
