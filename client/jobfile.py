"""Job files and budget settings as the job commands read them: ``job.toml`` into a
``SubmitJobRequest`` (every key's TOML type checked first, then the planner's own
checks, so a bad file is an :class:`InputError` naming the field: exit 2), and
``hetpilot budget``'s ``KIND=VALUE`` arguments."""

from __future__ import annotations

import tomllib
import uuid
from pathlib import Path
from typing import Any

from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import job_from_dict
from hetpilot.v1 import job_pb2

from hetpilot.entry import Entry
from hetpilot.tomlconfig import ConfigError, check_types

__all__ = ["InputError", "budget_settings", "job_request_from_toml"]

_JOB_TYPES: dict[str, Any] = {
    "name": str, "model": str, "profile_on_attach": bool, "global_batch": int,
    "microbatch_size": int, "schedule": str | list[str], "budgets": dict[str, float],
    "V": float, "slot_s": float, "slot_iterations": int, "allowed_hosts": list[str]}
"""Each key of a job file and its TOML type, checked before any value is used
(``allowed_hosts = "gpu01"`` is not the hosts g, p, u, 0, 1, nor "no" true);
``[entry]`` is :class:`Entry`'s to check."""
_JOB_KEYS = {*_JOB_TYPES, "entry"}


class InputError(ValueError):
    """Bad job file or argument (exit 2)."""


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


def budget_settings(items: list[str]) -> tuple[dict[str, float], float | None]:
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
