"""A job as the planner sees it: its model parsed from JSON, its batch checked, its
record turned into a :class:`~hetpilot.planner.types.Job`, and its controller built.

The daemon checks a submitted job with these, and the planning process
(:mod:`hetpilot.daemon.planner_process`) builds each job's controller with them;
both import this module, neither the other. No protobuf, no store here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hetpilot.planner.controller import Controller, ControllerConfig
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import job_from_dict, model_from_dict
from hetpilot.planner.types import Job, Model

from .records import JobRecord

__all__ = ["MAX_LAYERS", "MAX_MICROBATCHES", "MIN_SLOT_S", "check_batch", "make_controller",
           "parse_model", "to_job"]

MIN_SLOT_S = 0.05
"""Shortest controller slot a job may ask for (a shorter one only burns the planner)."""
MAX_LAYERS = 1024
"""Layers of a job's model: planning costs O(L^2) memory and time per device kind
(a 1024-layer model takes about 25 s and 600 MB on its first slot); group finer
operators into layers beyond that."""
MAX_MICROBATCHES = 16384
"""Microbatches per iteration (global_batch / microbatch_size): the reference model
simulates each one on each stage."""


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def parse_model(text: str, path: str = "model_json") -> Model:
    """A spec v1 model from JSON, refusing by field what the planner cannot hold."""
    try:
        data = json.loads(text, parse_constant=_reject_constant)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # lone surrogates ("\ud800")
    except RecursionError:
        raise ValidationError(path, "is nested too deeply") from None
    except UnicodeEncodeError:
        raise ValidationError(path, "holds a lone UTF-16 surrogate escape, not valid "
                                    "Unicode") from None
    except ValueError as exc:
        raise ValidationError(path, f"is not valid JSON: {exc}") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if isinstance(layers, list) and len(layers) > MAX_LAYERS:
        raise ValidationError(f"{path}.layers", f"at most {MAX_LAYERS} layers, got {len(layers)} "
                              "(group finer operators into layers)")
    return model_from_dict(data, path)


def check_batch(global_batch: int, microbatch_size: int) -> None:
    microbatches = -(-global_batch // microbatch_size)
    if microbatches > MAX_MICROBATCHES:
        raise ValidationError("global_batch", f"asks for {microbatches} microbatches per "
                              f"iteration (global_batch / microbatch_size); at most "
                              f"{MAX_MICROBATCHES}: raise microbatch_size")


def to_job(rec: JobRecord) -> Job:
    """The planner's job of ``rec``: planned with tensor-parallel stages (spec 5.6) only when
    its trainer said on Attach that it runs them (``rec.tensor_parallel``); a job whose
    trainer did not is never pushed a plan with ``devices`` stages."""
    return job_from_dict({"global_batch": rec.global_batch,
                          "microbatch_size": rec.microbatch_size,
                          "schedule": list(rec.schedules) or "any",
                          "budgets": dict(rec.budgets),
                          "tensor_parallel": rec.tensor_parallel,
                          **({"V": rec.V} if rec.V else {})})  # 0: no V given, the default


def _holds_tp_plan(state: Mapping[str, Any]) -> bool:
    """Whether a stored controller state's plan has a stage of several devices (a
    state written by a build whose trainer ran them)."""
    raw = state.get("plan")
    groups = raw.get("groups") if isinstance(raw, Mapping) else None
    for group in groups if isinstance(groups, list) else ():
        stages = group.get("stages") if isinstance(group, Mapping) else None
        for stage in stages if isinstance(stages, list) else ():
            if isinstance(stage, Mapping) and "devices" in stage:
                return True
    return False


def make_controller(rec: JobRecord, state: Mapping[str, Any] | None) -> Controller:
    """The job's controller, restored from ``state`` (its to_state()) when given.

    The record's budgets and V win over the state's: an UpdateBudgets that
    landed after the last slot was recorded is not lost by a restart."""
    model, job = parse_model(rec.model_json), to_job(rec)
    config = ControllerConfig(slot_s=rec.slot_s)
    if state and not job.tensor_parallel and _holds_tp_plan(state):
        state = {**state, "plan": None}  # the next slot plans without TP stages
    if state:
        ctrl = Controller.from_state(model, job, state, config)
    else:
        ctrl = Controller(model, job, config)
    ctrl.set_budgets(dict(rec.budgets), rec.V)
    return ctrl
