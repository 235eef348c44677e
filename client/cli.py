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
from collections.abc import Callable
from typing import Any

import grpc
from hetpilot.v1 import common_pb2, job_pb2, job_pb2_grpc

from hetpilot.channel import TOKEN_ENV, Endpoint, metadata, open_sync, read_token_file
from hetpilot.exitcodes import EXIT
from hetpilot.flags import integer, seconds

from .jobfile import InputError, budget_settings, job_request_from_toml
from .jobview import (
    fmt_costs,
    job_dict,
    plan_dict,
    print_job,
    print_jobs,
    progress_dict,
    progress_line,
)
from .tables import safe, text

__all__ = ["InputError", "add_arguments", "call", "common_arguments", "job_request_from_toml",
           "run"]


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
    print(json.dumps(job_dict(info)) if args.json else info.job_id)
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
        print(json.dumps([job_dict(j) for j in jobs]))
    else:
        print_jobs(jobs)
    return 0


def _job(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    info = stub.GetJob(job_pb2.GetJobRequest(job_id=args.job_id), metadata=md,
                       timeout=args.timeout)
    if args.trainer_token:
        print(info.trainer_token)
    else:
        print(json.dumps(job_dict(info))) if args.json else print_job(info)
    return 0


def _cancel(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    info = stub.CancelJob(job_pb2.CancelJobRequest(job_id=args.job_id), metadata=md,
                          timeout=args.timeout)
    print(json.dumps(job_dict(info)) if args.json else safe(f"{info.job_id} cancelled"))
    return 0


def _budget(stub: job_pb2_grpc.JobServiceStub, md: Md, args: argparse.Namespace) -> int:
    budgets, v = budget_settings(args.settings)
    req = job_pb2.UpdateBudgetsRequest(job_id=args.job_id, budgets=budgets)
    if v is not None:
        req.v = v
    info = stub.UpdateBudgets(req, metadata=md, timeout=args.timeout)
    if args.json:
        print(json.dumps(job_dict(info)))
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
                      caption=text(progress_line(info)), caption_justify="left")
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
            print(progress_line(new), flush=True)
        elif not args.json:
            render()
        elif new.HasField("loss") or new.HasField("eval_metric"):
            print(json.dumps({"job_id": new.job_id, "progress": progress_dict(new)}),
                  flush=True)

    def show_plan(pv: common_pb2.PlanVersion) -> None:
        if args.json:
            print(json.dumps(plan_dict(pv)), flush=True)
            return
        plan = json.loads(pv.plan_json)
        row = (str(pv.version), str(pv.slot), f"{pv.iteration_s:.4f}",
               fmt_costs(pv.costs, info.budgets),
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
