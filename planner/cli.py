"""``hetpilot plan`` and ``hetpilot evaluate`` (spec v1 section 7).

Exit codes: 0 ok; 2 bad input (one line on stderr naming the field); 3 no
plan fits in memory (``plan``).

``evaluate`` reading: a plan file that is not a plan at all (not JSON, a
field of the wrong type, a bad op name) is bad input and exits 2; a
well-formed plan that breaks a validity rule of spec section 4 (overlapping
layers, memory, a deadlocking order, samples not summing to ``--batch``) is
a normal result, printed as ``{"valid": false, "error": "..."}`` with exit 0,
so that scripts read one JSON object either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import serde
from .errors import InfeasibleError, ValidationError
from .refmodel import evaluate
from .types import Job

POLICIES = ("hetpilot", "even-dp", "uniform-pp", "megatron", "balanced-homogeneous")


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, metavar="C.json")
    parser.add_argument("--model", required=True, metavar="M.json")
    if name == "plan":
        parser.add_argument("--batch", required=True, type=int, metavar="B")
        parser.add_argument("--microbatch", required=True, type=int, metavar="m")
        parser.add_argument("--schedule", default="any", choices=("any", "1f1b", "gpipe"))
        parser.add_argument("--policy", default="hetpilot", choices=POLICIES,
                            help="hetpilot (default) or a baseline users would otherwise pick")
        parser.add_argument("--out", metavar="plan.json", help="write here instead of stdout")
        parser.add_argument("--tensor-parallel", action="store_true",
                            help="allow tensor-parallel stages (spec 5.6; needs a model "
                                 "with tp_comm_mb; the trainer cannot run them yet); with "
                                 "--policy megatron, tensor parallelism inside hosts")
    else:
        parser.add_argument("--plan", required=True, metavar="P.json")
        parser.add_argument("--batch", type=int, metavar="B",
                            help="check that the groups' samples sum to B")


def _fail(message: str, code: int) -> int:
    print(f"hetpilot: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    try:
        cluster = serde.cluster_from_dict(serde.load_json(args.cluster, "--cluster"))
        model = serde.model_from_dict(serde.load_json(args.model, "--model"))
        if args.command == "plan":
            if args.batch < 1:
                raise ValidationError("--batch", f"must be >= 1, got {args.batch}")
            if args.microbatch < 1:
                raise ValidationError("--microbatch", f"must be >= 1, got {args.microbatch}")
            if args.batch % args.microbatch:
                raise ValidationError(
                    "--batch", f"must be a multiple of --microbatch {args.microbatch}, got {args.batch}"
                )
            job = serde.job_from_dict(
                {"global_batch": args.batch, "microbatch_size": args.microbatch,
                 "schedule": args.schedule, "tensor_parallel": args.tensor_parallel},
            )
            return _plan(cluster, model, job, args)
        plan = serde.plan_from_dict(serde.load_json(args.plan, "--plan"))
        if args.batch is not None and args.batch < 1:
            raise ValidationError("--batch", f"must be >= 1, got {args.batch}")
    except ValidationError as exc:
        return _fail(str(exc), 2)
    result = evaluate(cluster, model, plan, args.batch)
    print(json.dumps(result.to_dict(), indent=1))
    return 0


def _plan(cluster, model, job: Job, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    from .search import make_plan  # here: `evaluate` needs no search (start-up time)
    from .tpsearch import make_tp_plan, megatron_tp

    try:
        if args.policy == "hetpilot" and job.tensor_parallel:
            plan = make_tp_plan(cluster, model, job)
        elif args.policy == "megatron" and job.tensor_parallel:
            plan = megatron_tp(cluster, model, job)
        else:
            plan = make_plan(cluster, model, job, policy=args.policy)
    except InfeasibleError as exc:
        return _fail(str(exc), 3)
    text = json.dumps(serde.plan_to_dict(plan), indent=1)
    if args.out:
        try:
            Path(args.out).write_text(text + "\n")
        except OSError as exc:
            return _fail(f"--out: cannot write {args.out!r}: {exc.strerror or exc}", 2)
    else:
        print(text)
    return 0
