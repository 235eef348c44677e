"""Each layer tensor's name in the user's model, by identity (a job's ``"model"``).

A job's layers hold the parameters and buffers of the model they were cut from;
checkpoints store them per layer (``layer00003.pt``: ``{"block.ln_1.weight": ...}``).
With ``"model"`` in the job, :func:`layer_names` finds, for each layer's
``state_dict`` key, the names the model's own ``state_dict`` has for the same tensor
(several for a tied one: GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``),
and :func:`model_meta` is what the checkpoint records, so that ``hetpilot export``
writes the model's names and ``--hf`` a directory ``from_pretrained`` loads.
"""

from __future__ import annotations

from typing import Any

from hetpilot.planner.errors import ValidationError
from torch import nn

__all__ = ["layer_names", "model_meta"]


def layer_names(model: nn.Module, layers: list[Any], where: str = "model") -> list[
        dict[str, list[str]]]:
    """Per layer, ``{its state_dict key: [the model's names for that tensor]}``. Refused
    (naming ``where``) when a layer is a factory, a layer tensor is not the model's, or a
    tensor of the model's ``state_dict`` is in no layer (an export would lack it)."""
    if not isinstance(model, nn.Module):
        raise ValidationError(where, f"must be the nn.Module the layers were cut from, got "
                                     f"{type(model).__name__}")
    by_id: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), []).append(name)
    out: list[dict[str, list[str]]] = []
    found: set[int] = set()
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ValidationError(where, f"layers item {i} is a factory: names can be recorded "
                                         "only for layers given as modules")
        names: dict[str, list[str]] = {}
        for key, tensor in layer.state_dict(keep_vars=True).items():
            if id(tensor) not in by_id:
                raise ValidationError(where, f"layers item {i} ({type(layer).__name__}) holds "
                                             f"{key!r}, which is not a tensor of the model's "
                                             "state_dict")
            names[key] = by_id[id(tensor)]
            found.add(id(tensor))
        out.append(names)
    missing = [names[0] for tid, names in by_id.items() if tid not in found]
    if missing:
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise ValidationError(where, f"{len(missing)} tensor(s) of the model are in no layer "
                                     f"({shown}): an export would lack them")
    return out


def model_meta(spec: dict[str, Any], where: str = "model") -> dict[str, Any]:
    """What a checkpoint records for a job with ``"model"`` (``{}`` without one): the names
    (:func:`layer_names`) and, for a Hugging Face model, its class and config."""
    model = spec.get("model")
    if model is None:
        return {}
    from .hf import config_record

    record: dict[str, Any] = {"names": layer_names(model, list(spec["layers"]), where)}
    hf = config_record(model)
    if hf is not None:
        record["hf"] = hf
    return {"model": record}
