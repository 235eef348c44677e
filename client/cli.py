"""Job-owner commands: ``hetpilot submit|jobs|job|watch|budget|cancel|logs``.

The daemon address comes from ``--daemon`` or $HETPILOT_ADDRESS, the owner's
token from ``--token-file`` or $HETPILOT_TOKEN. Every call has a deadline
(``--timeout``); idempotent calls are retried on UNAVAILABLE by the channel's
service config, and ``watch`` resumes from the last version it printed.

``job``, ``jobs`` and ``watch`` show the training progress the trainer last
reported: the loss and the step it belongs to, and the held-out metric for
jobs with an evaluation hook. A diverged run shows "nan" (JSON: the string
"NaN", as proto3 JSON writes non-finite doubles).

A job file with an ``[entry]`` table (:mod:`hetpilot.entry`) has the agents
start its ranks under torchrun; ``job`` then shows each host's part of the
launch, and ``logs JOB [--rank R] [--follow]`` prints the ranks' output as the
agents shipped it to the daemon (``--follow``: until the job has ended and all
of it has arrived; through a daemon restart, resuming after the last line it
printed, for up to ``--reconnect-for`` seconds of the daemon being away).

A job ends SUCCEEDED or FAILED (the trainer says so, or a launched job's ranks
all exit 0 / die beyond the restart budget; ``job`` shows the reason) or
CANCELLED (a launched job's ranks are then stopped); ``jobs`` shows each job's
state, start and end time, plan version, iteration time and what it has cost
so far, fitted to the terminal's width (:mod:`hetpilot.client.tables`).

Exit codes: 0 ok; 1 other failure; 2 bad input (a bad job file or argument,
or INVALID_ARGUMENT / RESOURCE_EXHAUSTED from the daemon); 3 no such job
(NOT_FOUND: also another owner's job); 4 not authenticated; 5 daemon
unreachable or too slow (UNAVAILABLE, DEADLINE_EXCEEDED); 6 the job's state
forbids it (FAILED_PRECONDITION, e.g. a cancelled job's budget).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import job_from_dict
from hetpilot.v1 import common_pb2, job_pb2, job_pb2_grpc

from hetpilot.channel import TOKEN_ENV, Endpoint, metadata, open_sync, read_token_file
from hetpilot.entry import Entry
from hetpilot.exitcodes import EXIT
from hetpilot.flags import integer, seconds
from hetpilot.tomlconfig import ConfigError, check_types

from .tables import Column, print_table, safe, terminal_width, text

__all__ = ["add_arguments", "call", "common_arguments", "job_request_from_toml", "run"]

_STATE = {job_pb2.JOB_STATE_PENDING: "pending", job_pb2.JOB_STATE_RUNNING: "running",
          job_pb2.JOB_STATE_CANCELLED: "cancelled", job_pb2.JOB_STATE_SUCCEEDED: "succeeded",
          job_pb2.JOB_STATE_FAILED: "failed", job_pb2.JOB_STATE_UNSPECIFIED: "?"}
_JOB_TYPES: dict[str, Any] = {
    "name": str, "model": str, "profile_on_attach": bool, "global_batch": int,
    "microbatch_size": int, "schedule": str | list[str], "budgets": dict[str, float],
    "V": float, "slot_s": float, "slot_iterations": int, "allowed_hosts": list[str]}
"""Each key of a job file and its TOML type, checked before any value is used
(``allowed_hosts = "gpu01"`` is not the hosts g, p, u, 0, 1, nor "no" true);
``[entry]`` is :class:`Entry`'s to check."""
_JOB_KEYS = {*_JOB_TYPES, "entry"}
_LAUNCH_STATE = {job_pb2.HOST_LAUNCH_STATE_ORDERED: "ordered",
                 job_pb2.HOST_LAUNCH_STATE_RUNNING: "running",
                 job_pb2.HOST_LAUNCH_STATE_EXITED: "exited",
                 job_pb2.HOST_LAUNCH_STATE_UNSPECIFIED: "?"}


class InputError(ValueError):
    """Bad job file or argument (exit 2)."""


def common_arguments(parser: argparse.ArgumentParser, token_help: str = "your bearer token"
                     ) -> None:
    """The flags of every command that calls the daemon."""
    parser.add_argument("--daemon", metavar="HOST:PORT", help="default: $HETPILOT_ADDRESS")
    parser.add_argument("--token-file", help=f"file with {token_help} (default: ${TOKEN_ENV})")
    parser.add_argument("--ca-file", default="", help="PEM CA of the daemon (turns TLS on)")
    parser.add_argument("--cert-file", default="", help="client certificate (mutual TLS)")
    parser.add_argument("--key-file", default="")
    parser.add_argument("--timeout", type=seconds(), default=10.0,
                        help="deadline per call, seconds (finite, > 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    common_arguments(parser)
    if name == "submit":
        parser.add_argument("job_file", metavar="job.toml")
    elif name == "jobs":
        parser.add_argument("--all", action="store_true", help="include cancelled jobs")
    elif name == "job":
        parser.add_argument("job_id")
        parser.add_argument("--trainer-token", action="store_true",
                            help="print only the job's trainer token (for hetpilot train "
                                 "--token-file: TrainerService calls of this job only)")
    elif name == "cancel":
        parser.add_argument("job_id")
    elif name == "watch":
        parser.add_argument("job_id")
        parser.add_argument("--after", type=integer(), default=0, metavar="VERSION",
                            help="start after this plan version")
        parser.add_argument("--count", type=integer(), default=0,
                            help="exit after this many versions (0: until the job ends)")
        parser.add_argument("--interval", type=seconds(), default=2.0, metavar="SECONDS",
                            help="how often to fetch the job's training progress (loss)")
    elif name == "logs":
        parser.add_argument("job_id")
        parser.add_argument("--rank", type=integer(0, 2**32 - 1), default=None, metavar="R",
                            help="only global rank R's lines (else every host's whole output)")
        parser.add_argument("--follow", "-f", action="store_true",
                            help="keep printing new output until the job has ended")
        parser.add_argument("--reconnect-for", type=seconds(zero=True), default=60.0, metavar="SECONDS",
                            help="--follow: how long to keep reconnecting to a daemon that "
                                 "went away (restarts), resuming after the last line printed; "
                                 "then give up with exit 5 (default 60)")
    elif name == "budget":
        parser.add_argument("job_id")
        parser.add_argument("settings", nargs="+", metavar="KIND=VALUE",
                            help="price_per_hour=20, power_watts=900, V=5 (V=auto: the learned default)")


def _utf8(path: Path) -> str:
    """The file's text; InputError naming it when it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def job_request_from_toml(path: str | Path) -> job_pb2.SubmitJobRequest:
    path = Path(path)
    try:
        data = tomllib.loads(_utf8(path))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"{path}: {exc}") from None
    unknown = set(data) - _JOB_KEYS
    if unknown:
        raise InputError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    try:
        check_types(_JOB_TYPES, data, str(path))
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    model_json = ""
    if "model" in data:
        model_path = (path.parent / data["model"]).resolve()
        try:
            model_json = _utf8(model_path)
        except OSError as exc:
            raise InputError(f"{path}: model: cannot read {model_path}: {exc.strerror}") from None
        except InputError as exc:
            raise InputError(f"{path}: model: {exc}") from None
    elif not data.get("profile_on_attach", False):
        raise InputError(f"{path}: set model = \"model.json\" or profile_on_attach = true")
    try:  # the planner's own checks and field-named messages (spec v1 section 3)
        job_from_dict({k: data[k] for k in ("global_batch", "microbatch_size", "schedule",
                                            "budgets", "V") if k in data}, str(path))
        for key in ("slot_s",):
            if key in data and (isinstance(data[key], bool)
                                or not isinstance(data[key], (int, float)) or data[key] < 0):
                raise InputError(f"{path}.{key}: must be a number >= 0, got {data[key]!r}")
        value = data.get("slot_iterations", 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
            raise InputError(f"{path}.slot_iterations: must be an integer in [0, 2^32) "
                             f"(0: slots of slot_s seconds), got {value!r}")
        entry = Entry.from_dict(data["entry"], f"{path}.entry") if "entry" in data else None
    except ValidationError as exc:
        raise InputError(str(exc)) from None
    try:
        sched = data.get("schedule", [])
        return job_pb2.SubmitJobRequest(
            name=data.get("name", path.stem), model_json=model_json,
            profile_on_attach=data.get("profile_on_attach", False),
            global_batch=int(data["global_batch"]), microbatch_size=int(data["microbatch_size"]),
            schedules=[sched] if isinstance(sched, str) and sched != "any"
            else [] if sched == "any" else list(sched),
            budgets={str(k): float(v) for k, v in data.get("budgets", {}).items()},
            v=float(data.get("V", 0.0)), slot_s=float(data.get("slot_s", 0.0)),
            slot_iterations=int(data.get("slot_iterations", 0)),
            allowed_hosts=data.get("allowed_hosts", []),
            request_id=uuid.uuid4().hex,
            entry=None if entry is None else job_pb2.JobEntry(
                module=entry.module, command=list(entry.command), args=list(entry.args),
                ranks_per_host=entry.ranks_per_host, hosts=entry.hosts,
                restart_budget=entry.restart_budget, env=dict(entry.env),
                workdir=entry.workdir))
    except KeyError as exc:
        raise InputError(f"{path}: {exc.args[0]} is required") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"{path}: {exc}") from None


def _settings(items: list[str]) -> tuple[dict[str, float], float | None]:
    budgets: dict[str, float] = {}
    v = None
    for item in items:
        key, sep, raw = item.partition("=")
        if key == "V" and raw == "auto":  # back to the learned default (sent as 0)
            v = 0.0
            continue
        try:
            value = float(raw)
        except ValueError:
            raise InputError(f"{item!r}: want KIND=NUMBER") from None
        if not sep:
            raise InputError(f"{item!r}: want KIND=NUMBER")
        if key == "V":
            v = value
        else:
            budgets[key] = value
    return budgets, v


def _job_dict(info: job_pb2.JobInfo) -> dict[str, Any]:
    out = MessageToDict(info, preserving_proto_field_name=True,
                        always_print_fields_with_no_presence=True)
    out["state"] = _STATE.get(info.state, str(info.state))
    for part, h in zip(out.get("launch", []), info.launch, strict=True):
        part["state"] = _LAUNCH_STATE.get(h.state, str(h.state))
    return _ints(out)


def _ints(out: dict[str, Any]) -> dict[str, Any]:
    """MessageToDict writes 64-bit integers as strings (proto3 JSON); scripts want numbers."""
    for key in ("slot", "plan_version", "version", "created_unix_ms", "loss_step", "eval_step",
                "loss_unix_ms", "started_unix_ms", "ended_unix_ms", "state_since_unix_ms",
                "registered_unix_ms", "measured_unix_ms", "unix_ms"):
        if key in out:
            out[key] = int(out[key])
    return out


def _plan_dict(pv: common_pb2.PlanVersion) -> dict[str, Any]:
    out = MessageToDict(pv, preserving_proto_field_name=True,
                        always_print_fields_with_no_presence=True)
    out["plan"] = json.loads(out.pop("plan_json") or "null")
    return _ints(out)


def _fmt_value(value: float) -> str:
    """4 significant digits; "nan" / "inf" for a diverged run."""
    return f"{value:.4g}"


def _fmt_loss(j: job_pb2.JobInfo) -> str:
    return f"{_fmt_value(j.loss)} (step {j.loss_step})" if j.HasField("loss") else "-"


def _fmt_eval(j: job_pb2.JobInfo) -> str:
    return f"{_fmt_value(j.eval_metric)} (step {j.eval_step})" if j.HasField("eval_metric") else "-"


def _progress_line(j: job_pb2.JobInfo) -> str:
    if not j.HasField("loss") and not j.HasField("eval_metric"):
        return "loss: none reported yet"
    parts = []
    if j.HasField("loss"):
        parts.append(f"loss {_fmt_value(j.loss)} at step {j.loss_step}")
    if j.HasField("eval_metric"):
        parts.append(f"eval metric {_fmt_value(j.eval_metric)} at step {j.eval_step}")
    return ", ".join(parts)


_PROGRESS_KEYS = ("loss", "loss_step", "loss_unix_ms", "eval_metric", "eval_step")


def _progress_dict(j: job_pb2.JobInfo) -> dict[str, Any]:
    """The training-progress keys of ``job --json`` (loss and eval_metric only when set)."""
    out = _job_dict(j)
    return {k: out[k] for k in _PROGRESS_KEYS if k in out}


def _fmt_costs(costs: Any, budgets: Any) -> str:
    parts = []
    for k in sorted(set(costs) | set(budgets)):
        short = {"price_per_hour": "$/h", "power_watts": "W"}.get(k, k)
        text = f"{costs.get(k, 0.0):.2f}"
        if k in budgets:
            text += f"/{budgets[k]:.2f}"
        parts.append(f"{short} {text}")
    return ", ".join(parts)


def _fmt_spent(spent: Any) -> str:
    """What a job has cost so far: dollars, kWh."""
    parts = []
    for k in sorted(spent, key=lambda k: (k != "price_per_hour", k)):
        v = spent[k]
        if k == "price_per_hour":
            parts.append(f"${v:.2f}")
        elif k == "power_watts":
            parts.append(f"{v / 1000:.3g} kWh" if v >= 1000 else f"{v:.3g} Wh")
        else:
            parts.append(f"{k} {v:.3g}")
    return ", ".join(parts) or "-"


def _when(unix_ms: int) -> str:
    """Local time, to the minute; "-" for none."""
    return time.strftime("%m-%d %H:%M", time.localtime(unix_ms / 1000)) if unix_ms else "-"


#: The columns of ``hetpilot jobs``, most important kept longest (tables.fit).
_JOB_COLUMNS = (
    Column("id", 100), Column("name", 70, shrink=True), Column("state", 95),
    Column("started", 45), Column("ended", 40), Column("plan v", 80, justify="right"),
    Column("iter s", 75, justify="right"), Column("cost so far", 60),
    Column("loss", 55, justify="right"), Column("avg cost / budget", 30),
    Column("devices", 35), Column("batch", 25), Column("model", 20, shrink=True),
)


def _state(j: job_pb2.JobInfo) -> str:
    """The job's state; for an ended job whose ranks have not all exited, which hosts it
    waits for ("cancelling: waiting for host b": a host that is down gets the stop
    order when its agent comes back)."""
    state = _STATE.get(j.state, "?")
    left = [h.host for h in j.launch if h.state != job_pb2.HOST_LAUNCH_STATE_EXITED]
    if not left or j.state in (job_pb2.JOB_STATE_PENDING, job_pb2.JOB_STATE_RUNNING):
        return state
    what = {job_pb2.JOB_STATE_CANCELLED: "cancelling",
            job_pb2.JOB_STATE_FAILED: "failed, stopping"}.get(j.state, f"{state}, finishing")
    return f"{what}: waiting for host {', '.join(left)}"


def _print_jobs(jobs: list[job_pb2.JobInfo], width: int | None = None) -> None:
    rows = []
    for j in jobs:
        devices = str(len(j.devices))
        if j.emulated_devices:
            devices += f" ({len(j.emulated_devices)} emulated)"
        rows.append((j.job_id, j.name, _state(j), _when(j.started_unix_ms),
                     _when(j.ended_unix_ms), str(j.plan_version),
                     f"{j.iteration_s:.3f}" if j.plan_version else "-",
                     _fmt_spent(j.cost_so_far),
                     _fmt_value(j.loss) if j.HasField("loss") else "-",
                     _fmt_costs(j.average_costs, j.budgets) or "-", devices,
                     f"{j.global_batch}/{j.microbatch_size}", j.model_name or "-"))
    if not rows:
        print("no jobs (cancelled ones: --all)")
        return
    print_table("hetpilot jobs", _JOB_COLUMNS, rows, width)


def _print_job(j: job_pb2.JobInfo) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=text(f"job {j.job_id}"), show_header=False)
    emu = set(j.emulated_devices)
    rows = [("name", j.name), ("owner", j.owner), ("state", _STATE.get(j.state, "?")),
            *([("reason", j.reason)] if j.reason else []),
            ("submitted / started / ended", f"{_when(j.created_unix_ms)} / "
             f"{_when(j.started_unix_ms)} / {_when(j.ended_unix_ms)}"),
            ("model", j.model_name or ("(profile on attach)" if j.profile_on_attach else "-")),
            ("batch / microbatch", f"{j.global_batch} / {j.microbatch_size}"),
            ("V", f"{j.v:g}" if j.v else "learned (default; docs/controller.md)"),
            ("slot", f"{j.slot} x {j.slot_iterations} iterations (or {j.slot_s:g} s without "
                     "reports)" if j.slot_iterations else f"{j.slot} x {j.slot_s:g} s"),
            ("plan version", str(j.plan_version)),
            ("iteration", f"{j.iteration_s:.4f} s"),
            ("loss", _fmt_loss(j)),
            *([("eval metric", _fmt_eval(j))] if j.HasField("eval_metric") else []),
            ("cost now / budget", _fmt_costs(j.costs, j.budgets)),
            ("average cost / budget", _fmt_costs(j.average_costs, j.budgets)),
            ("cost so far", _fmt_spent(j.cost_so_far)),
            ("queues", ", ".join(f"{k} {v:.2f}" for k, v in sorted(j.queues.items())) or "-"),
            ("devices", ", ".join(d + (" (emulated)" if d in emu else "") for d in j.devices)
             or "-"),
            ("allowed hosts", ", ".join(j.allowed_hosts) or "all"),
            *_launch_rows(j),
            ("warnings", "; ".join(j.warnings) or "-")]
    for k, v in rows:
        table.add_row(k, text(v))
    Console(width=terminal_width()).print(table)


def _launch_rows(j: job_pb2.JobInfo) -> list[tuple[str, str]]:
    """The entry point and each host's part of the launch (jobs with an entry point)."""
    if not j.HasField("entry"):
        return []
    e = j.entry
    what = " ".join([f"python -m {e.module}" if e.module else " ".join(e.command), *e.args])
    rows = [("entry", f"{what} (ranks per host: {e.ranks_per_host or 'one per device'}, "
                      f"restart budget {e.restart_budget})")]
    if not j.launch:
        return [*rows, ("launch", "not yet (see warnings)" if j.state in (
            job_pb2.JOB_STATE_PENDING, job_pb2.JOB_STATE_RUNNING) else "never")]
    rows.append(("launch", f"{j.launch_id}, rendezvous {j.rdzv_endpoint}"))
    for h in j.launch:
        state = _LAUNCH_STATE.get(h.state, "?")
        if h.state == job_pb2.HOST_LAUNCH_STATE_EXITED:
            state += f" {h.exit_code}" + (" (stopped)" if h.stopped else "")
        detail = f"{state}, pid {h.pid}" if h.pid else state
        if h.reason:
            detail += f": {h.reason.splitlines()[-1][:120]}"
        rows.append((f"  {h.host}", f"{', '.join(h.devices)}: {detail}"))
    return rows


def _fail(message: str, code: int) -> int:
    print(f"hetpilot: error: {safe(message)}", file=sys.stderr)
    return code


Md = tuple[tuple[str, str], ...]


def call(args: argparse.Namespace, command: Callable[[grpc.Channel, Md], int]) -> int:
    """Open a channel as the common flags say, run ``command`` on it, and map what goes
    wrong to an exit code with one line on stderr."""
    token = ""
    try:
        ep = Endpoint.from_env(args.daemon, read_token_file(args.token_file)
                               if args.token_file else None, ca_file=args.ca_file,
                               cert_file=args.cert_file, key_file=args.key_file)
        token = ep.token
        with open_sync(ep) as channel:
            return command(channel, metadata(ep.token))
    except (InputError, ValueError, OSError) as exc:
        return _fail(str(exc), 2)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        message = f"{code.name}: {exc.details()}"  # type: ignore[attr-defined]
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            given = "" if token else "; none was given"
            message += f" (the token comes from --token-file FILE, else ${TOKEN_ENV}{given})"
        return _fail(message, EXIT.get(code, 1))


def run(args: argparse.Namespace) -> int:
    return call(args, lambda channel, md: _COMMANDS[args.command](
        job_pb2_grpc.JobServiceStub(channel), md, args))


def _submit(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    info = stub.SubmitJob(job_request_from_toml(args.job_file), metadata=md, timeout=args.timeout)
    print(json.dumps(_job_dict(info)) if args.json else info.job_id)
    if not args.json:  # e.g. allowed_hosts naming a host no agent registered as
        for warning in info.warnings:
            print(f"hetpilot: warning: {safe(warning)}", file=sys.stderr)
    return 0


def _jobs(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    jobs: list[job_pb2.JobInfo] = []
    token = ""
    while True:  # the daemon answers as many as fit in one message, then a page token
        resp = stub.ListJobs(job_pb2.ListJobsRequest(include_cancelled=args.all,
                                                     page_token=token),
                             metadata=md, timeout=args.timeout)
        jobs += resp.jobs
        token = resp.next_page_token
        if not token:
            break
    if args.json:
        print(json.dumps([_job_dict(j) for j in jobs]))
    else:
        _print_jobs(jobs)
    return 0


def _job(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    info = stub.GetJob(job_pb2.GetJobRequest(job_id=args.job_id), metadata=md,
                       timeout=args.timeout)
    if args.trainer_token:
        print(info.trainer_token)
    else:
        print(json.dumps(_job_dict(info))) if args.json else _print_job(info)
    return 0


def _cancel(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    info = stub.CancelJob(job_pb2.CancelJobRequest(job_id=args.job_id), metadata=md,
                          timeout=args.timeout)
    print(json.dumps(_job_dict(info)) if args.json else safe(f"{info.job_id} cancelled"))
    return 0


def _budget(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    budgets, v = _settings(args.settings)
    req = job_pb2.UpdateBudgetsRequest(job_id=args.job_id, budgets=budgets)
    if v is not None:
        req.v = v
    info = stub.UpdateBudgets(req, metadata=md, timeout=args.timeout)
    if args.json:
        print(json.dumps(_job_dict(info)))
    else:
        print(safe(f"{info.job_id}: budgets {dict(info.budgets)}, "
                   f"V {f'{info.v:g}' if info.v else 'learned'}"))
    return 0


def _progress_key(j: job_pb2.JobInfo) -> tuple[Any, ...]:
    """What tells one progress from the next (repr: NaN equals NaN here)."""
    return (repr(j.loss) if j.HasField("loss") else None, j.loss_step, j.loss_unix_ms,
            repr(j.eval_metric) if j.HasField("eval_metric") else None, j.eval_step)


class _PlanStream:
    """Follows WatchPlans in a thread, resuming after the last version on UNAVAILABLE or
    DEADLINE_EXCEEDED (up to 10 failures in a row), so that the caller can fetch the
    job's progress between plan versions. Puts ("plan", pv), ("end", None) when the
    job ends, or ("error", exc) on ``events``."""

    def __init__(self, stub: job_pb2_grpc.JobServiceStub, md: Md, job_id: str,
                 after: int) -> None:
        self.stub, self.md, self.job_id, self.last = stub, md, job_id, after
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="hetpilot-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    self._call = self.stub.WatchPlans(
                        job_pb2.WatchPlansRequest(job_id=self.job_id, after_version=self.last),
                        metadata=self.md)
                    for pv in self._call:
                        failures = 0
                        self.last = pv.version
                        self.events.put(("plan", pv))
                    self.events.put(("end", None))  # the job ended
                    return
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        return
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE,  # type: ignore[attr-defined]
                                          grpc.StatusCode.DEADLINE_EXCEEDED) or failures >= 10:
                        raise
                    failures += 1
                    self._stop.wait(min(0.2 * 2 ** failures, 5.0))
        except BaseException as exc:  # handed to the main thread, which raises it
            self.events.put(("error", exc))

    def stop(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=2)


def _watch(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    """Plan versions as they come, and the job's training progress (fetched with GetJob
    every ``--interval`` seconds) when it changes. Reconnects (resuming after the last
    version) while the daemon is away, for up to 10 failures in a row.

    ``--json`` prints one line per plan version (it has "version") and, whenever the
    progress changes, a line ``{"job_id": ..., "progress": {"loss": ..., "loss_step": ...,
    "loss_unix_ms": ..., "eval_metric": ..., "eval_step": ...}}`` (no "version")."""
    seen = 0
    info = stub.GetJob(job_pb2.GetJobRequest(job_id=args.job_id), metadata=md,
                       timeout=args.timeout)
    shown: tuple[Any, ...] | None = None
    live = None
    table_rows: list[tuple[str, ...]] = []
    # piped or redirected: plain lines as they come (a live table would print only at exit)
    plain = not args.json and not sys.stdout.isatty()
    if not args.json and not plain:
        from rich.live import Live

        live = Live(auto_refresh=False)
        live.start()

    def render() -> None:
        from rich.table import Table

        assert live is not None
        table = Table(title=text(f"job {args.job_id}: plan versions"),
                      caption=text(_progress_line(info)), caption_justify="left")
        for col in ("version", "slot", "iter s", "cost / budget", "devices", "groups"):
            table.add_column(col)
        for row in table_rows[-20:]:
            table.add_row(*map(text, row))
        live.update(table, refresh=True)

    def show_progress(new: job_pb2.JobInfo) -> None:
        nonlocal info, shown
        info = new
        key = _progress_key(new)
        if key == shown:
            return
        shown = key
        if plain:
            print(_progress_line(new), flush=True)
        elif not args.json:
            render()
        elif new.HasField("loss") or new.HasField("eval_metric"):
            print(json.dumps({"job_id": new.job_id, "progress": _progress_dict(new)}),
                  flush=True)

    def show_plan(pv: common_pb2.PlanVersion) -> None:
        if args.json:
            print(json.dumps(_plan_dict(pv)), flush=True)
            return
        plan = json.loads(pv.plan_json)
        row = (str(pv.version), str(pv.slot), f"{pv.iteration_s:.4f}",
               _fmt_costs(pv.costs, info.budgets),
               str(sum(len(g["stages"]) for g in plan["groups"])), str(len(plan["groups"])))
        if plain:
            print(safe(f"plan v{row[0]}  slot {row[1]}  iteration {row[2]} s  cost {row[3]}  "
                       f"devices {row[4]}  groups {row[5]}"), flush=True)
            return
        table_rows.append(row)
        render()

    def poll() -> None:
        # A short deadline: the display must not wait on an absent daemon. Failures are
        # skipped: the plan stream reconnects, or reports what is wrong for good.
        with contextlib.suppress(grpc.RpcError):
            show_progress(stub.GetJob(job_pb2.GetJobRequest(job_id=args.job_id), metadata=md,
                                      timeout=min(args.timeout, max(1.0, args.interval))))

    stream = _PlanStream(stub, md, args.job_id, args.after)
    try:
        show_progress(info)
        stream.start()
        next_poll = time.monotonic() + args.interval
        while True:
            try:
                kind, item = stream.events.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                poll()
                next_poll = time.monotonic() + args.interval
                continue
            if kind == "plan":
                show_plan(item)
                seen += 1
                if args.count and seen >= args.count:
                    return 0
            elif kind == "end":
                poll()  # the last loss of a job that ended
                return 0
            else:
                raise item
    finally:
        stream.stop()
        if live is not None:
            live.stop()
            if not live.console.is_terminal:  # Live ends its last frame only on a terminal
                live.console.line()


_RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
"""How a stream ends when the daemon stops, restarts or goes away (a dead connection
shows within the channel's keepalive)."""


def _logs(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    """A launched job's output (StreamLogs): each host's lines as they were shipped, a
    host's lines whole. ``--json``: one line per message, ``{"host": ..., "text": ...}``.
    No deadline: the kept output may be large, and ``--follow`` lasts as long as the job.
    Without ``--follow`` an unreachable daemon fails at once (UNAVAILABLE, exit 5). With
    it, a daemon that goes away (a restart) is reconnected to with backoff (0.2 s
    doubling to 2 s), resuming each host after the last line printed (each message's
    ``end_offset``, sent back in ``resume_from``), so no line is printed twice or
    missed; after ``--reconnect-for`` seconds without reaching it: exit 5."""
    printed: dict[str, int] = {}
    """host -> offset in its output after the last line printed."""
    out = sys.stdout
    away_since: float | None = None
    backoff = 0.2
    while True:
        req = job_pb2.StreamLogsRequest(job_id=args.job_id, follow=args.follow,
                                        resume_from=printed)
        if args.rank is not None:
            req.rank = args.rank
        stream = stub.StreamLogs(req, metadata=md)
        try:
            if args.follow:
                stream.initial_metadata()  # the daemon took the call: it is back
                if away_since is not None and stream.is_active():  # type: ignore[attr-defined]
                    print("hetpilot logs: reconnected, resuming", file=sys.stderr, flush=True)
                    away_since, backoff = None, 0.2
            for chunk in stream:
                text = chunk.data.decode("utf-8", "replace")
                if args.json:
                    out.write(json.dumps({"host": chunk.host, "text": text}) + "\n")
                else:
                    out.write(text)
                out.flush()
                if chunk.end_offset:
                    printed[chunk.host] = chunk.end_offset
            return 0
        except KeyboardInterrupt:
            stream.cancel()
            return 130
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if not args.follow or code not in _RESUMABLE:
                raise
            now = time.monotonic()
            if away_since is None:
                away_since = now
                print(f"hetpilot logs: lost the daemon ({code.name}: "
                      f"{exc.details()}); reconnecting for up to "  # type: ignore[attr-defined]
                      f"{args.reconnect_for:g} s", file=sys.stderr, flush=True)
            if now - away_since >= args.reconnect_for:
                print(f"hetpilot logs: gave up: the daemon has been unreachable for "
                      f"{now - away_since:.0f} s ({code.name}); run the command again to go "
                      "on (it prints the kept output from the start)", file=sys.stderr,
                      flush=True)
                return EXIT[grpc.StatusCode.UNAVAILABLE]
            try:
                time.sleep(min(backoff, max(0.0, away_since + args.reconnect_for - now)))
            except KeyboardInterrupt:
                return 130
            backoff = min(backoff * 2, 2.0)


_COMMANDS: dict[str, Callable[[job_pb2_grpc.JobServiceStub, Md, argparse.Namespace], int]] = {
    "submit": _submit, "jobs": _jobs, "job": _job, "watch": _watch, "budget": _budget,
    "cancel": _cancel, "logs": _logs,
}
