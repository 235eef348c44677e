"""Spec 5.6's ``tp_efficiency`` of a job's split layers, measured on this rank's device.

A layer split t ways runs, on each device of the stage, one rank's slice of it (each
column-parallel submodule with 1/t of its outputs, each row-parallel one with 1/t of its
inputs); spec 5.6 charges that ``1 / (t * efficiency)`` of the whole layer's work, plus
the all-reduces it counts apart. So the efficiency is the whole layer's forward and
backward time over t times the slice's, timed here on the same microbatch in one process
(no collective: the all-reduces are not in it), at most 1 (spec 2). Small slices keep
less of a device busy: that is what it measures. Layers of one class (same parameter and
input shapes) are timed once. Rank 0's profile carries the median over the ranks.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from .profile import LayerSpec, _instantiate, _layer_input
from .speeds import CPU_REPEATS, CUDA_REPEATS, _class_key, _resized, _time_layer
from .tensorparallel import _local_copy, matched, shared_parameters, split_problem

__all__ = ["measure_tp_efficiency", "merged_efficiency", "with_tp_efficiency"]

Efficiency = dict[int, dict[int, float]]
"""``{layer index: {degree: efficiency}}``."""


def measure_tp_efficiency(layers: Sequence[LayerSpec], sample: Any, microbatch: int,
                          tp_plan: Mapping[str, str], degrees: Sequence[int], *,
                          device: torch.device | str, autocast_dtype: torch.dtype | None = None,
                          repeats: int | None = None) -> Efficiency:
    """Each layer ``tp_plan`` splits, at each of ``degrees`` it can run split at: the
    whole layer's (forward + backward) seconds on ``device`` over ``degree`` times one
    rank's slice's, capped at 1."""
    dev = torch.device(device)
    reps = repeats if repeats is not None else CUDA_REPEATS if dev.type == "cuda" else CPU_REPEATS
    built = _instantiate(layers)
    shared = shared_parameters(built)
    x: Any = _resized(sample, microbatch, dev)
    done: dict[Hashable, dict[int, float]] = {}
    out: Efficiency = {}
    for i, layer in enumerate(built):
        layer = layer.to(dev)
        inp = _layer_input(x, first=i == 0)
        styles = matched(layer, tp_plan, keep_whole=shared)

        def timed(module: Any, inp: Any = inp, i: int = i) -> tuple[float, Any]:
            (f, b), y = _time_layer(module, inp, first=i == 0, device=dev,
                                    autocast_dtype=autocast_dtype, repeats=reps, warmup=1)
            return f + b, y

        if styles:
            key = _class_key(layer, inp)
            if key not in done:
                whole, _ = timed(layer)
                done[key] = {}
                for t in degrees:
                    if split_problem(layer, inp, styles, t) is None:
                        part, _ = timed(_local_copy(layer, styles, t))
                        if whole > 0 and part > 0:
                            done[key][t] = min(1.0, whole / (t * part))
            if done[key]:
                out[i] = dict(done[key])
        with torch.no_grad():
            x = _layer_input(layer(inp), first=False)
    return out


def merged_efficiency(per_rank: Sequence[Efficiency | None]) -> Efficiency:
    """The median over the ranks that measured, per layer and degree."""
    values: dict[tuple[int, int], list[float]] = {}
    for eff in per_rank:
        for layer, by_degree in (eff or {}).items():
            for t, e in by_degree.items():
                values.setdefault((int(layer), int(t)), []).append(float(e))
    out: Efficiency = {}
    for (layer, t), es in sorted(values.items()):
        out.setdefault(layer, {})[t] = statistics.median(es)
    return out


def with_tp_efficiency(profile: dict[str, Any], eff: Efficiency) -> dict[str, Any]:
    """``profile`` (spec 2) with each measured layer's ``tp_efficiency`` (degrees as
    strings, as the spec writes them); layers not measured keep theirs."""
    layers = [dict(la) for la in profile["layers"]]
    for i, by_degree in eff.items():
        if by_degree and layers[i].get("tp_comm_mb") is not None:
            layers[i]["tp_efficiency"] = {str(t): e for t, e in sorted(by_degree.items())}
    return {**profile, "layers": layers}
