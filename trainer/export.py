"""``hetpilot export``: a checkpoint back as the user's model.

``--out MODEL.pt`` writes one ``state_dict``. When the job gave ``"model"``
the checkpoint recorded each tensor's names in it (:mod:`hetpilot.trainer.modelnames`),
and the keys are those names (a tied tensor under each name the model's own
``state_dict`` has), so ``model.load_state_dict(torch.load(...))`` takes it;
otherwise the keys are ``"{layer}.{name}"`` of ``nn.Sequential(*layers)``.

``--hf DIR`` (a Hugging Face model: the checkpoint recorded its class and
config) writes ``config.json`` and ``model.safetensors`` with transformers'
own ``save_pretrained``, after loading the weights strictly into a model built
from that config: ``from_pretrained(DIR)`` loads it.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

from .checkpoint import export_state_dict, read_meta, resolve

__all__ = ["hf_model", "main", "named_state_dict"]

_READ_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, EOFError,
                pickle.UnpicklingError)


def _model_record(directory: str | Path) -> dict[str, Any] | None:
    where = resolve(directory)
    if where is None:
        return None
    record: dict[str, Any] | None = read_meta(where).get("model")
    return record


def named_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's own names where it recorded them (module
    docstring), else under ``"{layer}.{name}"``. Raises ValueError naming what is wrong."""
    state = export_state_dict(directory)
    record = _model_record(directory)
    if record is None or "names" not in record:
        return state
    out: dict[str, torch.Tensor] = {}
    for layer, names in enumerate(record["names"]):
        for key, model_names in names.items():
            value = state.get(f"{layer}.{key}")
            if value is None:
                raise ValueError(f"the checkpoint has no {key!r} of layer {layer}, which its "
                                 f"names record lists (as {model_names[0]!r})")
            for name in model_names:
                out[name] = value
    return out


def hf_model(directory: str | Path) -> Any:
    """The Hugging Face model the checkpoint holds: built from the recorded class and
    config, its weights loaded strictly. Raises ValueError when the checkpoint recorded
    no Hugging Face model."""
    from .hf import model_from_record

    record = _model_record(directory)
    if record is None or "hf" not in record:
        raise ValueError("the checkpoint records no Hugging Face model (train a job from "
                         "hetpilot.trainer.hf.job, or one giving a transformers model as "
                         "'model')")
    state = named_state_dict(directory)
    model = model_from_record(record["hf"])
    first = next(iter(state.values()), None)
    if first is not None and first.is_floating_point():
        model.to(first.dtype)  # trained under --dtype float64: exported so
    model.load_state_dict(state, strict=True)
    return model


def _fail(message: str) -> int:
    print(f"hetpilot: error: {message}", file=sys.stderr)
    return 2


def main(checkpoint: str, out: str | None, hf_dir: str | None) -> int:
    """The command: exit 0, or 2 with one line naming the flag."""
    if (out is None) == (hf_dir is None):
        return _fail("give one of --out and --hf")
    if hf_dir is not None:
        try:
            model = hf_model(checkpoint)
        except _READ_ERRORS as exc:
            return _fail(f"CKPT: {exc}")
        try:
            model.save_pretrained(hf_dir)
        except (OSError, RuntimeError) as exc:
            return _fail(f"--hf: {exc}")
        print(f"hetpilot: exported {type(model).__name__} to {hf_dir} (from_pretrained loads "
              "it)", file=sys.stderr)
        return 0
    assert out is not None
    try:
        state = named_state_dict(checkpoint)
    except _READ_ERRORS as exc:
        return _fail(f"CKPT: {exc}")
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("wb") as fh:
            torch.save(state, fh)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        return _fail(f"--out: {exc}")
    print(f"hetpilot: exported {len(state)} tensors to {out}", file=sys.stderr)
    return 0
