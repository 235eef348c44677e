"""The job function a user points hetpilot at (``--model`` / ``--job MODULE:FN``).

It returns a dict: ``layers`` (modules or zero-argument factories; each layer
is called with the previous layer's output, any pytree), ``loss`` (mean over a
microbatch, ``loss(output, target)``), ``optimizer`` (a factory over a
parameter list), ``dataset`` (map-style, item ``(input, target)``),
``global_batch``; optionally ``sample`` (one microbatch of inputs, for
profiling), ``eval_dataset`` and ``metric`` (evaluation at each epoch's end),
``microbatch_size`` (train-check's choice). Every rank calls it, so it must
build the same model and data on every rank (seed it).

This module imports no torch: the CLI loads jobs with it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from hetpilot.planner.errors import ValidationError

__all__ = ["TRAIN_KEYS", "load_job"]

TRAIN_KEYS = ("layers", "loss", "optimizer", "dataset", "global_batch")


def load_job(target: str, field: str, required: Sequence[str] = TRAIN_KEYS) -> dict[str, Any]:
    """Call ``MODULE:FN`` (importable from the working directory too, as with ``python -m``);
    raise :class:`ValidationError` naming ``field`` when it cannot be loaded or lacks a key."""
    module_name, _, fn_name = target.partition(":")
    if not module_name or not fn_name:
        raise ValidationError(field, f"must be MODULE:FN, got {target!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValidationError(field, f"cannot load {target!r}: {exc}") from exc
    spec = fn()
    if not isinstance(spec, dict):
        raise ValidationError(field, f"{target}() must return a dict, got {type(spec).__name__}")
    missing = [k for k in required if k not in spec]
    if missing:
        raise ValidationError(field, f"{target}() returned no {', '.join(map(repr, missing))}")
    return spec
