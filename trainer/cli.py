"""``hetpilot train-check``, ``hetpilot profile`` and ``hetpilot train``.

Exit codes: 0 ok; 1 a check failed or a run-time error; 2 bad input (one
line on stderr naming the field, before any rank computes).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from hetpilot.planner.errors import ValidationError

__all__ = ["add_arguments", "run"]


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "train-check":
        parser.add_argument("--ranks", type=int, default=2, metavar="N")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--tolerance", type=float, default=1e-9)
        parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                            help="give up (exit 1) after this many seconds")
        return
    parser.add_argument("--model", required=True, metavar="MODULE:FN",
                        help="function returning the job spec dict (see hetpilot.trainer.examples)")
    if name == "profile":
        parser.add_argument("--name", default=None)
        parser.add_argument("--out", metavar="M.json", help="write here instead of stdout")
        return
    parser.add_argument("--plan", required=True, metavar="P.json",
                        help="plan file; rewrite it with a higher \"version\" to switch live")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--device-id", default=None,
                        help="this rank's device id (default $HETPILOT_DEVICE_ID or host:local_rank)")
    parser.add_argument("--checkpoint", metavar="DIR", help="save here after every epoch")
    parser.add_argument("--resume", action="store_true", help="resume from --checkpoint if present")
    parser.add_argument("--report", metavar="FILE.jsonl", help="append per-epoch measurements")
    parser.add_argument("--emulate-slowdown", type=float, default=1.0, metavar="F",
                        help="EMULATION: make this rank F times slower (sleeps); off by default")


def _fail(message: str, code: int = 2) -> int:
    print(f"hetpilot: error: {message}", file=sys.stderr)
    return code


def _load_spec(target: str) -> dict[str, Any]:
    module_name, _, fn_name = target.partition(":")
    if not fn_name:
        raise ValidationError("--model", f"must be MODULE:FN, got {target!r}")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValidationError("--model", f"cannot load {target!r}: {exc}") from exc
    spec: dict[str, Any] = fn()
    return spec


def run(args: argparse.Namespace) -> int:
    if args.command == "train-check":
        if args.ranks < 2:
            return _fail(f"--ranks: must be >= 2, got {args.ranks}")
        from .check import main

        return main(args.ranks, args.seed, args.tolerance, args.timeout)
    try:
        spec = _load_spec(args.model)
    except ValidationError as exc:
        return _fail(str(exc))
    if args.command == "profile":
        from .profile import profile_model

        model = profile_model(spec["layers"], spec["sample"],
                              name=args.name or args.model.rpartition(":")[2])
        text = json.dumps(model, indent=1)
        if args.out:
            Path(args.out).write_text(text + "\n")
        else:
            print(text)
        return 0
    return _train(args, spec)


def _train(args: argparse.Namespace, spec: dict[str, Any]) -> int:
    import socket

    import torch
    import torch.distributed as dist

    from .plans import FilePlanSource, check_plan
    from .runtime import JsonlReporter, Trainer

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device_id = args.device_id or os.environ.get("HETPILOT_DEVICE_ID") \
        or f"{socket.gethostname()}:{local}"
    source = FilePlanSource(args.plan)
    if rank == 0:
        # refuse a wrong plan before any rank computes: the device check runs in Trainer
        try:
            first = source.poll(0)
            assert first is not None
            check_plan(first.plan, [s.device for g in first.plan.groups for s in g.stages],
                       len(spec["layers"]), spec["global_batch"])
        except ValidationError as exc:
            return _fail(str(exc))
    cuda = torch.cuda.is_available()  # NCCL path: untested here (no GPU where this was built)
    if cuda:
        torch.cuda.set_device(local)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}",
                                rank=0, world_size=1)
    if args.emulate_slowdown != 1.0:
        print(f"rank {rank}: EMULATED heterogeneity: {args.emulate_slowdown:g}x slower (sleeps)",
              file=sys.stderr)
    try:
        trainer = Trainer(
            spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
            global_batch=spec["global_batch"], device_id=device_id, plan_source=source,
            device=torch.device("cuda", local) if cuda else "cpu",
            slowdown=args.emulate_slowdown,
            reporter=JsonlReporter(args.report) if args.report else None,
        )
        if args.resume and args.checkpoint and (Path(args.checkpoint) / "meta.json").exists():
            trainer.load_checkpoint(args.checkpoint)
        while trainer.epoch < args.epochs:
            if trainer.iteration == 0 or trainer.plan is None:
                trainer.poll_plan()
            record = trainer.train_epoch()
            if rank == 0:
                print(json.dumps(record))
            if args.checkpoint:
                trainer.save_checkpoint(args.checkpoint)
    except ValidationError as exc:
        return _fail(str(exc))
    finally:
        dist.destroy_process_group()
    del world
    return 0


def _port() -> int:
    from .launch import free_port

    return free_port()
