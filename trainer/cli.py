"""``hetpilot train-check``, ``hetpilot profile``, ``hetpilot train`` and ``hetpilot export``.

Exit codes: 0 ok; 1 a check failed or a run-time error; 2 bad input (one
line on stderr naming the field, before any rank computes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from hetpilot.agents.cpustat import meminfo_gb
from hetpilot.planner.errors import ValidationError

from hetpilot.flags import integer, number, seconds

__all__ = ["add_arguments", "run"]

DTYPES = ("float32", "float64", "bfloat16", "float16")


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "export":
        parser.add_argument("checkpoint", metavar="CKPT",
                            help="a `hetpilot train --checkpoint` directory (its latest commit)")
        into = parser.add_mutually_exclusive_group(required=True)
        into.add_argument("--out", metavar="MODEL.pt",
                          help="write one state_dict here: the model's own names where the "
                               "job gave 'model', else those of nn.Sequential(*layers)")
        into.add_argument("--hf", metavar="DIR",
                          help="write a Hugging Face model directory (config.json, "
                               "model.safetensors) that from_pretrained loads")
        return
    if name == "train-check":
        parser.add_argument("--job", default=None, metavar="MODULE:FN",
                            help="your job function (as for `hetpilot train --model`); default: "
                                 "a small tanh MLP")
        parser.add_argument("--iterations", type=integer(1), default=2, metavar="K",
                            help="iterations per random plan")
        parser.add_argument("--ranks", type=integer(2), default=2, metavar="N")
        parser.add_argument("--seed", type=integer(), default=0)
        parser.add_argument("--tolerance", type=number(-1e9), default=None,
                            help="largest difference allowed: absolute, default 1e-9 "
                                 "(float64, beyond each tensor's rounding-noise floor: "
                                 "docs/trainer.md); under --dtype bfloat16/float16 the relative "
                                 "difference from plain float32 (default 0.1 / 0.05; the "
                                 "check against the same precision in one process keeps 0.5); "
                                 "a negative one fails every comparison (to see what the "
                                 "report names)")
        parser.add_argument("--dtype", choices=("float64", "bfloat16", "float16"),
                            default="float64",
                            help="float64: exact check; bfloat16/float16: the ranks run mixed "
                                 "precision, compared with plain float32 in one process")
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                            help="cuda: every rank computes on GPU 0, the ranks talking over "
                                 "gloo (NCCL refuses two ranks on one GPU; activations and "
                                 "gradients are staged through host memory), unless --backend "
                                 "nccl; the one-process references compute on GPU 0; "
                                 "default cpu")
        parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                            help="the ranks' process group; nccl (with --device cuda, at least "
                                 "--ranks GPUs): rank r on GPU r, as `hetpilot train` runs on a "
                                 "multi-GPU host; default gloo")
        parser.add_argument("--timeout", type=seconds(), default=300.0, metavar="S",
                            help="give up (exit 1) after this many seconds")
        return
    parser.add_argument("--model", required=True, metavar="MODULE:FN",
                        help="function returning the job spec dict (see hetpilot.trainer.examples)")
    if name == "profile":
        parser.add_argument("--name", default=None)
        parser.add_argument("--out", metavar="M.json", help="write here instead of stdout")
        parser.add_argument("--dtype", choices=DTYPES, default=None,
                            help="profile as `hetpilot train --dtype` runs: memory follows it")
        return
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--plan", metavar="P.json",
                        help="plan file; rewrite it with a higher \"version\" to switch live")
    source.add_argument("--daemon", metavar="HOST:PORT",
                        help="take plans from the daemon (TrainerService) and report to it; "
                             "default when started by an agent ($HETPILOT_JOB_ID set): "
                             "$HETPILOT_ADDRESS")
    parser.add_argument("--job", default="", metavar="ID",
                        help="the daemon's job id (--daemon); default $HETPILOT_JOB_ID")
    parser.add_argument("--token-file", help="file with the job's trainer token (`hetpilot "
                        "job JOB --trainer-token`); default $HETPILOT_TOKEN_FILE, else "
                        "$HETPILOT_CLUSTER_TOKEN, else $HETPILOT_TOKEN")
    parser.add_argument("--ca-file", default="",
                        help="PEM CA of the daemon (turns TLS on); default $HETPILOT_CA_FILE")
    parser.add_argument("--cert-file", default="", help="client certificate (mutual TLS); "
                        "default $HETPILOT_CERT_FILE")
    parser.add_argument("--key-file", default="", help="default $HETPILOT_KEY_FILE")
    parser.add_argument("--timeout", type=seconds(), default=5.0, metavar="S",
                        help="deadline per daemon call")
    parser.add_argument("--plan-wait", type=seconds(), default=300.0, metavar="S",
                        help="how long to wait for the daemon's first plan")
    parser.add_argument("--no-profile", action="store_true",
                        help="do not send the model profile on Attach (--daemon)")
    parser.add_argument("--no-measure", action="store_true",
                        help="do not time the layers on each rank's device, nor the links "
                             "between the ranks, for the daemon, nor correct the times from "
                             "the stage timings (--daemon; it then plans with the agents' "
                             "matmul and link probes)")
    parser.add_argument("--epochs", type=integer(1), default=1,
                        help="epochs to train (default 1: a pre-training run has one)")
    parser.add_argument("--steps", type=integer(1), default=None, metavar="N",
                        help="stop after N optimizer steps in all (counted across resumes)")
    parser.add_argument("--slot-iterations", type=integer(0, 2**32 - 1), default=None, metavar="N",
                        help="report (and close a measurement slot) every N iterations; "
                             "0: no slots by iteration count (every epoch, or --slot-seconds); "
                             "default: the daemon job's slot, else every epoch. New plans are "
                             "taken before any iteration, whatever the slot")
    parser.add_argument("--slot-seconds", type=seconds(zero=True), default=None, metavar="T",
                        help="report every T seconds (rank 0's clock); default: the daemon "
                             "job's slot_s when it counts no iterations")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="float32/float64: cast floating parameters, buffers, inputs and "
                             "targets; bfloat16/float16: mixed precision (autocast, float32 "
                             "master weights and optimizer state, float16 with loss scaling); "
                             "default: keep the job's own dtypes")
    parser.add_argument("--device-id", default=None,
                        help="this rank's device id (default $HETPILOT_DEVICE_ID, else "
                             "item LOCAL_RANK of $HETPILOT_DEVICE_IDS, else host:local_rank); "
                             "{rank} and {local_rank} are replaced")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="save here at the end of every epoch (and see --checkpoint-every)")
    parser.add_argument("--checkpoint-every", type=integer(), default=0, metavar="N",
                        help="also save every N steps, at the end of the slot reaching them "
                             "(default 0: at the end of each epoch only)")
    parser.add_argument("--resume", action="store_true", help="resume from --checkpoint if present")
    parser.add_argument("--report", metavar="FILE.jsonl",
                        help="append every rank's per-slot records (JSON lines)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="rank 0's line per slot on stdout: text (step, loss, samples/s, "
                             "tokens/s, s/it, plan, devices; default) or the JSON record")
    parser.add_argument("--tensorboard", metavar="DIR", default=None,
                        help="also write the log's figures as TensorBoard scalars here "
                             "(needs the tensorboard package)")
    parser.add_argument("--emulate-slowdown", type=number(above=True, what="factor"), default=1.0, metavar="F",
                        help="EMULATION: make this rank F times slower (sleeps); off by default")
    parser.add_argument("--emulate-tflops", default=None, metavar="T[,T...]",
                        help="EMULATION (target-time): each op lasts its FLOPs at T TFLOP/s, "
                             "one value for all ranks or one per rank; off by default")
    parser.add_argument("--emulate-file", default=None, metavar="FILE",
                        help="EMULATION (target-time): JSON re-read every iteration; this "
                             "rank's device speed and the host links there (gradient sync) "
                             "follow it; see hetpilot.emulation; off by default")
    parser.add_argument("--emulate-model", default=None, metavar="M.json",
                        help="layer FLOPs for --emulate-tflops (default: profile job()['sample'])")


def _unwritable(args: argparse.Namespace) -> str | None:
    """Why ``--report`` or ``--checkpoint`` cannot be written, found before training (an
    unwritable path had failed the run at its first report or checkpoint, with a
    traceback); None when both can."""
    import tempfile

    if args.report:
        try:
            with Path(args.report).open("a"):
                pass
        except OSError as exc:
            return f"--report: cannot write {args.report}: {exc.strerror or exc}"
    if args.checkpoint:
        try:
            Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.checkpoint):
                pass
        except OSError as exc:
            return f"--checkpoint: cannot write into {args.checkpoint}: {exc.strerror or exc}"
    return None


def _fail(message: str, code: int = 2) -> int:
    print(f"hetpilot: error: {message}", file=sys.stderr)
    return code


def _load_spec(target: str, command: str) -> dict[str, Any]:
    from .jobspec import TRAIN_KEYS, load_job

    if command != "profile":
        return load_job(target, "--model", TRAIN_KEYS)
    spec = _with_sample(load_job(target, "--model", ("layers",)))
    if "sample" not in spec:
        raise ValidationError("--model", f"{target}() returned no 'sample' and no 'dataset' whose "
                                         "first items could be one")
    return spec


RANK_BYTES = 300 * 2**20
"""What one train-check rank holds at least: a Python process with torch and gloo (230-310
MiB measured for the shipped GPT example's ranks)."""


def run(args: argparse.Namespace) -> int:
    if args.command == "export":
        from .export import main as export

        return export(args.checkpoint, args.out, args.hf)
    if args.command == "train-check":
        if args.ranks < 2:
            return _fail(f"--ranks: must be >= 2, got {args.ranks}")
        if args.iterations < 1:
            return _fail(f"--iterations: must be >= 1, got {args.iterations}")
        if args.tolerance is not None and not math.isfinite(args.tolerance):
            return _fail(f"--tolerance: must be a finite number, got {args.tolerance}")
        available = meminfo_gb()[1] * 1e9  # 0 where there is no /proc/meminfo: no check
        if available and args.ranks * RANK_BYTES > available:
            return _fail(f"--ranks: {args.ranks} local ranks need about "
                         f"{args.ranks * RANK_BYTES / 2**30:.1f} GiB (at least "
                         f"{RANK_BYTES // 2**20} MiB each); {available / 2**30:.1f} GiB is "
                         "available here")
        from .forkserver import start_early

        start_early()  # its torch import overlaps this process's own (check imports torch)
        from .traincheck import BUILTIN_JOB, main

        return main(args.ranks, args.seed, args.tolerance, args.timeout,
                    job=args.job or BUILTIN_JOB, iterations=args.iterations, dtype=args.dtype,
                    device=args.device, backend=args.backend)
    if args.command == "train" and (problem := launched_defaults(args)) is not None:
        return _fail(problem)
    try:
        spec = _load_spec(args.model, args.command)
    except ValidationError as exc:
        return _fail(str(exc))
    if args.command == "profile":
        import torch

        from .profile import profile_model

        try:
            model = profile_model(spec["layers"], spec["sample"],
                                  name=args.name or args.model.rpartition(":")[2],
                                  dtype=getattr(torch, args.dtype) if args.dtype else None,
                                  tp_plan=spec.get("tp_plan"))
        except (TypeError, ValueError, RuntimeError) as exc:  # the job's layers, as built
            return _fail(f"--model: cannot profile {args.model}: {exc}")
        text = json.dumps(model, indent=1)
        if args.out:
            try:
                Path(args.out).write_text(text + "\n")
            except OSError as exc:
                return _fail(f"--out: cannot write {args.out}: {exc.strerror or exc}")
        else:
            print(text)
        return 0
    rc = _train(args, spec)
    # Training is over, its output written and the process group destroyed: skip
    # the interpreter's teardown. A rank that exits normally can still abort there
    # (SIGABRT, "terminate called without an active exception": gloo's C++ threads
    # release tensors while Python is being finalised; seen in CI on a one-rank
    # `hetpilot train --checkpoint`), and under torchrun or an agent's launch that
    # turns a finished job into a failed rank. trainer/launch.py does the same.
    # Exceptions from _train still propagate and exit the usual way.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _emulated_tflops(text: str | None, rank: int, world: int) -> float | None:
    """This rank's EMULATED speed from ``--emulate-tflops`` (one value, or one per rank)."""
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValidationError("--emulate-tflops", f"must be numbers, got {text!r}") from None
    if len(values) not in (1, world):
        raise ValidationError("--emulate-tflops",
                              f"give 1 value or one per rank ({world}), got {len(values)}")
    if not all(v > 0 for v in values):
        raise ValidationError("--emulate-tflops", f"must be > 0, got {text!r}")
    return values[0] if len(values) == 1 else values[rank]


def _device_id(args: argparse.Namespace, rank: int, local: int) -> str:
    import socket

    listed = [d for d in os.environ.get("HETPILOT_DEVICE_IDS", "").split(",") if d]
    template = args.device_id or os.environ.get("HETPILOT_DEVICE_ID") \
        or (listed[local] if local < len(listed) else "") \
        or f"{socket.gethostname()}:{{local_rank}}"
    return template.replace("{local_rank}", str(local)).replace("{rank}", str(rank))


def launched_defaults(args: argparse.Namespace) -> str | None:
    """Fill what an agent's launch gives in the environment (hetpilot.agents.launcher):
    ``--daemon`` from $HETPILOT_ADDRESS and ``--job`` from $HETPILOT_JOB_ID when neither
    ``--plan`` nor ``--daemon`` is given, the token from $HETPILOT_TOKEN_FILE, TLS files
    from $HETPILOT_CA_FILE / CERT_FILE / KEY_FILE. An error message when there is still no
    plan source. So a job's entry point may be ``hetpilot train --model pkg.mod:job ...``
    with nothing about the daemon on its command line."""
    env = os.environ
    if args.plan is None and args.daemon is None:
        if not env.get("HETPILOT_JOB_ID"):
            return ("one of --plan and --daemon is required (or run under an agent's launch, "
                    "which sets $HETPILOT_JOB_ID and $HETPILOT_ADDRESS)")
        args.daemon = env.get("HETPILOT_ADDRESS", "")
        if not args.daemon:
            return "$HETPILOT_JOB_ID is set but $HETPILOT_ADDRESS is not: pass --daemon"
    if args.daemon is not None:
        args.job = args.job or env.get("HETPILOT_JOB_ID", "")
        args.token_file = args.token_file or env.get("HETPILOT_TOKEN_FILE") or None
        for flag in ("ca_file", "cert_file", "key_file"):
            if not getattr(args, flag):
                setattr(args, flag, env.get(f"HETPILOT_{flag.upper()}", ""))
    return None


def _endpoint(args: argparse.Namespace) -> Any:
    from hetpilot.channel import Endpoint, check_token, read_token_file

    if args.token_file:
        token = read_token_file(args.token_file)
    else:
        name = "HETPILOT_CLUSTER_TOKEN" if "HETPILOT_CLUSTER_TOKEN" in os.environ \
            else "HETPILOT_TOKEN"
        token = os.environ.get(name, "").strip()
        check_token(token, f"${name}")
    return Endpoint.from_env(args.daemon, token, ca_file=args.ca_file,
                             cert_file=args.cert_file, key_file=args.key_file)


def _connect(args: argparse.Namespace, device_ids: list[str], model_json: str,
             measurements: list[Any], tensor_parallel: bool) -> tuple[Any, Any]:
    """Rank 0: attach every rank (with its measured layer times; saying whether the job
    runs tensor-parallel stages) and wait for the daemon's first plan."""
    from .daemon_link import DaemonLink, GrpcPlanSource

    link = DaemonLink(_endpoint(args), args.job, timeout_s=args.timeout)
    source = GrpcPlanSource(link, device_ids, model_json=model_json,
                            measurements=measurements, tensor_parallel=tensor_parallel)
    try:
        source.start(args.plan_wait)
        first = source.wait_first(args.plan_wait)
    except BaseException:
        source.close()
        link.close()
        raise
    print(f"hetpilot: job {args.job}: plan version {first.version} from {args.daemon}",
          file=sys.stderr)
    return link, source


def _train(args: argparse.Namespace, spec: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    from .checkpoint import has_checkpoint
    from .plans import FilePlanSource, check_plan
    from .rankmeasure import calibration, measure, measure_links, measure_tp, sample_size
    from .records import JsonlReporter
    from .runtime import NoPlanError, Trainer, TrainerConfig
    from .trainlog import tensorboard_problem

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device_id = _device_id(args, rank, local)
    daemon = args.daemon is not None
    if daemon and not args.job:
        return _fail("--job: a job id is needed with --daemon")
    for flag, value, least in (("--epochs", args.epochs, 1), ("--steps", args.steps, 1),
                               ("--slot-iterations", args.slot_iterations, 0),
                               ("--slot-seconds", args.slot_seconds, 0),
                               ("--checkpoint-every", args.checkpoint_every, 0)):
        if value is not None and not value >= least:
            return _fail(f"{flag}: must be >= {least}, got {value}")
    if (problem := _unwritable(args)) is not None:
        return _fail(problem)
    if args.tensorboard and (problem := tensorboard_problem()) is not None:
        return _fail(problem)
    from .modelnames import model_meta

    try:  # the names checkpoints record: refused now, not at the first save
        extra = model_meta(spec, f"--model: {args.model}()['model']")
        tflops = _emulated_tflops(args.emulate_tflops, rank, world)
    except ValidationError as exc:
        return _fail(str(exc))
    if args.emulate_file and tflops is None:
        from hetpilot.emulation import EmulationFile

        tflops = EmulationFile(args.emulate_file).state().devices.get(device_id)
        if tflops is None:
            return _fail(f"--emulate-file: {args.emulate_file} names no speed for device "
                         f"{device_id!r} (give --emulate-tflops too)")
    if tflops is not None and args.emulate_slowdown != 1.0:
        return _fail("--emulate-tflops: choose one of --emulate-tflops and --emulate-slowdown")
    source: Any = None
    if not daemon:
        source = FilePlanSource(args.plan)
        if rank == 0:
            # refuse a wrong plan before any rank computes: the device check runs in Trainer
            try:
                first = source.poll(0)
                assert first is not None
                check_plan(first.plan, list(first.plan.devices), len(spec["layers"]),
                           spec["global_batch"], tensor_parallel=spec.get("tp_plan") is not None)
            except ValidationError as exc:
                return _fail(str(exc))
    spec = _with_sample(spec)
    profile: dict[str, Any] | None = None
    if tflops is not None and args.emulate_model:
        try:
            profile = json.loads(Path(args.emulate_model).read_text())
        except (OSError, ValueError) as exc:
            return _fail(f"--emulate-model: {exc}")
    elif (tflops is not None or (daemon and rank == 0 and not args.no_profile)) \
            and "sample" in spec:
        from .profile import profile_model

        try:
            profile = profile_model(spec["layers"], spec["sample"],
                                    name=args.model.rpartition(":")[2],
                                    dtype=getattr(torch, args.dtype) if args.dtype else None,
                                    tp_plan=spec.get("tp_plan"))
        except Exception as exc:  # a user's layer failing on the sample: say so, go on
            if tflops is not None:
                return _fail(f"--emulate-tflops: profiling the job's layers failed: "
                             f"{type(exc).__name__}: {exc}")
            print(f"hetpilot: profiling the job's layers failed ({type(exc).__name__}: {exc}); "
                  "no profile is sent, so a job submitted with profile_on_attach gets no "
                  "model from this trainer (give it one: hetpilot profile, then submit)",
                  file=sys.stderr)
    layer_gflop = split_model = None
    if tflops is not None:
        if profile is None:
            return _fail("--emulate-tflops: needs --emulate-model or a 'sample' in the job spec")
        layer_gflop = [(float(la["fwd_gflop"]), float(la.get("bwd_gflop", 2 * la["fwd_gflop"])))
                       for la in profile["layers"]]
        if spec.get("tp_plan") is not None:  # a split stage's ops last as spec 5.6 reads them
            from hetpilot.planner.serde import model_from_dict

            try:
                split_model = model_from_dict(profile)
            except ValidationError as exc:
                return _fail(f"--emulate-model: {exc}")
    # The emulations stretch ops by the host's clock, which a CUDA op does not follow (its
    # time is the device's): an emulated run stays on the CPU, on a GPU host too.
    emulated = (args.emulate_slowdown != 1.0 or tflops is not None or bool(args.emulate_file))
    cuda = torch.cuda.is_available() and not emulated
    if cuda and local >= torch.cuda.device_count():
        return _fail(f"LOCAL_RANK {local}: this host has {torch.cuda.device_count()} CUDA "
                     "device(s) and NCCL takes one rank per device: start at most that many "
                     "ranks here, or CUDA_VISIBLE_DEVICES= to train on the CPU")
    if cuda:
        torch.cuda.set_device(local)
    if "MASTER_ADDR" in os.environ:
        # Not plain env://: under torchrun (torch >= 2.5) the agent keeps one store for
        # the whole job, and a restarted round would read the dead round's gloo/NCCL
        # addresses from it ("connectFullMesh failed ... Connection refused", then a hang).
        # The ranks agree on a fresh key prefix per round: see hetpilot.trainer.rendezvous.
        from .rendezvous import init_process_group

        init_process_group("nccl" if cuda else "gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}",
                                rank=0, world_size=1)
    if args.emulate_slowdown != 1.0:
        print(f"rank {rank}: EMULATED heterogeneity: {args.emulate_slowdown:g}x slower (sleeps)",
              file=sys.stderr)
    if tflops is not None:
        print(f"rank {rank}: EMULATED device speed: {tflops:g} TFLOP/s (ops sleep until "
              "their FLOPs at that speed have elapsed)", file=sys.stderr)
    if args.emulate_file:
        print(f"rank {rank}: EMULATED conditions from {args.emulate_file} (device speed and "
              "gradient-sync links follow the file)", file=sys.stderr)
    link = grpc_reporter = None
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    try:
        reporters: list[Any] = [JsonlReporter(args.report)] if args.report else []
        if daemon:
            from .daemon_link import DaemonError, GrpcReporter

            ids: list[Any] = [None] * world
            dist.all_gather_object(ids, device_id)
            sample_m = sample_size(spec)
            measured: list[Any] = [None] * world
            dist.all_gather_object(measured, measure(args, spec, sample_m, tflops, profile,
                                                      device))
            measure_links(args, spec, profile, measured, tflops, [str(i) for i in ids], device)
            profile = measure_tp(args, spec, profile, sample_m, tflops, [str(i) for i in ids],
                                 device)
            failure: list[Any] = [None]
            if rank == 0:
                try:
                    link, source = _connect(args, [str(i) for i in ids],
                                            json.dumps(profile) if profile else "", measured,
                                            spec.get("tp_plan") is not None)
                except DaemonError as exc:
                    from hetpilot.exitcodes import EXIT

                    failure = [(EXIT.get(exc.code, 5) if exc.code else 5, str(exc))]
                except (OSError, ValueError) as exc:
                    failure = [(2, str(exc))]
            dist.broadcast_object_list(failure, src=0)
            if failure[0] is not None:
                return _fail(failure[0][1], failure[0][0])
            if link is not None:
                grpc_reporter = GrpcReporter(link)
                reporters.append(grpc_reporter)
            # timed at the sample's size; again at the plan's microbatch size when it differs
            planned: list[Any] = [source.wait_first(0).plan.microbatch_size
                                  if source is not None else None]
            dist.broadcast_object_list(planned, src=0)
            if measured[rank] is not None and planned[0] not in (None, sample_m):
                again: list[Any] = [None] * world
                dist.all_gather_object(again, measure(args, spec, planned[0], tflops,
                                                       profile, device))
                if source is not None:
                    source.update_measurements(again)
                measured = [a if a is not None else m for a, m in zip(again, measured, strict=True)]

        def report(record: dict[str, Any]) -> None:
            for r in reporters:
                r(record)

        try:
            config = TrainerConfig(
                global_batch=spec["global_batch"], device_id=device_id, device=device,
                slowdown=args.emulate_slowdown, emulate_tflops=tflops,
                layer_gflop=layer_gflop, split_model=split_model,
                report_from_rank0=daemon, keep_plan_on_refusal=daemon,
                emulate_file=args.emulate_file, tp_plan=spec.get("tp_plan"),
                dtype=getattr(torch, args.dtype) if args.dtype else None)
            trainer = Trainer(
                spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"], config,
                plan_source=source, reporter=report if reporters else None,
                eval_dataset=spec.get("eval_dataset"), metric=spec.get("metric"),
            )
        except ValidationError:
            raise
        except ValueError as exc:  # the job's layers as built ("item 1 ... not an nn.Module")
            return _fail(f"--model: {exc}")
        if args.resume and args.checkpoint and has_checkpoint(args.checkpoint):
            trainer.load_checkpoint(args.checkpoint)
        if daemon and rank == 0 and source is not None and not emulated \
                and any(m is not None for m in measured):
            reporters.append(calibration(trainer, measured, source))
        slot_iterations, slot_s = _slot(args, source)
        saved_at = [trainer.step]

        from .trainlog import TrainLog, tokens_per_sample

        log = TrainLog(tokens_per_sample(spec.get("sample")), lambda: _devices(trainer.plan),
                       args.tensorboard if rank == 0 else None, args.log_format == "json")

        def on_record(record: dict[str, Any]) -> None:
            if rank == 0:
                print(log(record), flush=True)
            every = args.checkpoint_every
            if args.checkpoint and (record["closed_by"] == "epoch"
                                    or (every and trainer.step - saved_at[0] >= every)):
                trainer.save_checkpoint(args.checkpoint, extra=extra)
                saved_at[0] = trainer.step

        try:
            trainer.fit(args.epochs, max_steps=args.steps, slot_iterations=slot_iterations,
                        slot_s=slot_s, on_record=on_record)
            if args.checkpoint and trainer.step > saved_at[0]:  # stopped by --steps
                trainer.save_checkpoint(args.checkpoint, extra=extra)  # between saves: --resume goes on here
        except Exception as exc:  # rank 0 with --daemon: the job FAILED (no restart left)
            if hasattr(source, "finish"):
                source.finish(exc, grpc_reporter)
            if isinstance(exc, NoPlanError):
                return _fail(f"the daemon's plan was refused: {exc}", 1)
            raise
        if hasattr(source, "finish"):  # rank 0 with --daemon: the job SUCCEEDED
            source.finish(None, grpc_reporter)
        log.close()
    except ValidationError as exc:
        return _fail(str(exc))
    finally:
        if grpc_reporter is not None:
            grpc_reporter.close()
        if source is not None and hasattr(source, "close"):
            source.close()
        if link is not None:
            link.close()
        dist.destroy_process_group()
    return 0


def _with_sample(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with a ``sample`` when the job gives none: the inputs of the dataset's first
    ``microbatch_size`` items (8 when the job gives no size; at most ``global_batch``), so
    that the daemon gets the job's profile and measured layer times without the user
    writing a sample. Most users' jobs have none: without this, ``hetpilot train --daemon``
    sent neither, and a job submitted with ``profile_on_attach`` never got a model. A
    dataset whose items cannot be batched leaves ``spec`` as it is (the trainer refuses it
    with its own message)."""
    if "sample" in spec or "dataset" not in spec:
        return spec
    from .batches import collate

    data = spec["dataset"]
    try:
        k = min(int(spec.get("microbatch_size") or 8), int(spec.get("global_batch") or 8),
                len(data))
        sample = collate(data, range(k), 0)
    except Exception:
        return spec
    return {**spec, "sample": sample}


def _devices(plan: Any) -> list[str]:
    """The devices the running plan uses, in its order."""
    if plan is None:
        return []
    return list(dict.fromkeys(plan.devices))


def _slot(args: argparse.Namespace, source: Any) -> tuple[int, float]:
    """The report cadence: the flags, else the daemon job's slot (every rank agrees: the
    flags are the same everywhere, and rank 0 broadcasts what its daemon source said)."""
    import torch.distributed as dist

    job: list[Any] = [(int(getattr(source, "slot_iterations", 0) or 0),
                       float(getattr(source, "slot_s", 0.0) or 0.0))]
    dist.broadcast_object_list(job, src=0)
    iterations = args.slot_iterations if args.slot_iterations is not None else job[0][0]
    seconds = args.slot_seconds if args.slot_seconds is not None else (
        0.0 if iterations else job[0][1])
    return iterations, seconds


def _port() -> int:
    from .launch import free_port

    return free_port()
