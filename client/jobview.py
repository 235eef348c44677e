"""How the job commands show a job: proto messages as JSON dicts (64-bit integers as
numbers) and as rich tables, every string from the daemon escaped
(:func:`hetpilot.client.tables.text`)."""

from __future__ import annotations

import json
import time
from typing import Any

from google.protobuf.json_format import MessageToDict
from hetpilot.v1 import common_pb2, job_pb2

from .tables import Column, print_table, terminal_width, text

__all__ = ["fmt_costs", "job_dict", "plan_dict", "print_job", "print_jobs", "progress_dict",
           "progress_line"]

_STATE = {job_pb2.JOB_STATE_PENDING: "pending", job_pb2.JOB_STATE_RUNNING: "running",
          job_pb2.JOB_STATE_CANCELLED: "cancelled", job_pb2.JOB_STATE_SUCCEEDED: "succeeded",
          job_pb2.JOB_STATE_FAILED: "failed", job_pb2.JOB_STATE_UNSPECIFIED: "?"}
_LAUNCH_STATE = {job_pb2.HOST_LAUNCH_STATE_ORDERED: "ordered",
                 job_pb2.HOST_LAUNCH_STATE_RUNNING: "running",
                 job_pb2.HOST_LAUNCH_STATE_EXITED: "exited",
                 job_pb2.HOST_LAUNCH_STATE_UNSPECIFIED: "?"}


def job_dict(info: job_pb2.JobInfo) -> dict[str, Any]:
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


def plan_dict(pv: common_pb2.PlanVersion) -> dict[str, Any]:
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


def progress_line(j: job_pb2.JobInfo) -> str:
    if not j.HasField("loss") and not j.HasField("eval_metric"):
        return "loss: none reported yet"
    parts = []
    if j.HasField("loss"):
        parts.append(f"loss {_fmt_value(j.loss)} at step {j.loss_step}")
    if j.HasField("eval_metric"):
        parts.append(f"eval metric {_fmt_value(j.eval_metric)} at step {j.eval_step}")
    return ", ".join(parts)


_PROGRESS_KEYS = ("loss", "loss_step", "loss_unix_ms", "eval_metric", "eval_step")


def progress_dict(j: job_pb2.JobInfo) -> dict[str, Any]:
    """The training-progress keys of ``job --json`` (loss and eval_metric only when set)."""
    out = job_dict(j)
    return {k: out[k] for k in _PROGRESS_KEYS if k in out}


def fmt_costs(costs: Any, budgets: Any) -> str:
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


def print_jobs(jobs: list[job_pb2.JobInfo], width: int | None = None) -> None:
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
                     fmt_costs(j.average_costs, j.budgets) or "-", devices,
                     f"{j.global_batch}/{j.microbatch_size}", j.model_name or "-"))
    if not rows:
        print("no jobs (cancelled ones: --all)")
        return
    print_table("hetpilot jobs", _JOB_COLUMNS, rows, width)


def print_job(j: job_pb2.JobInfo) -> None:
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
            ("cost now / budget", fmt_costs(j.costs, j.budgets)),
            ("average cost / budget", fmt_costs(j.average_costs, j.budgets)),
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

