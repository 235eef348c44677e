"""Device speeds and layer work fitted to layer times measured on the job itself.

Why: the agents' matmul probe measures one square matmul in one dtype; a real
layer runs at a fraction of that, a fraction that depends on the layer, the
dtype and the microbatch size (an H100 probed at 511-637 TFLOP/s ran a GPT-2
block at 40 TFLOP/s in float32 and 225 in bfloat16). Planning on probe speeds
then mispredicts times 10x and gets the *relative* speeds of unequal devices
wrong. The trainer measures each layer's forward and backward on each device
(:mod:`hetpilot.trainer.speeds`); this module turns those times into the two
numbers the planning contract has (spec v1 section 5.1:
``F = m * fwd_gflop / (1000 * tflops)``): one effective ``tflops`` per device
and effective ``fwd_gflop`` / ``bwd_gflop`` per layer.

The fit is rank 1 in log space: ``log t_dl = log m_d + log w_l - log s_d - log 1000``
for the forward and the backward of every layer ``l`` (each with its own
``w_l``) and one speed ``s_d`` per device, least squares over the entries that
were measured (alternating exact updates, which converge to the least-squares
solution on any connected set of entries). Speeds and work are only defined up
to one common factor per connected set of (device, layer) entries; it is fixed
so that the effective forward GFLOP of the set's layers add up to their
profiled forward GFLOP, so the effective model stays in the profile's units
and a cluster mixing measured and probed devices stays comparable. Layers no
device measured keep their profiled GFLOP. Times at or below :data:`MIN_TIME_S`
(a layer with no backward, a reshape: the timer's resolution) are floored to
it and left out of the speed fit, which they would only bias; a layer time
measured only at the floor gets the most work that takes at most the floor
time on every device that measured it. Times measured at a
microbatch ``m_d`` enter divided by ``m_d``: op times are taken linear in the
microbatch size, as in section 5.1.

Pure numpy: the daemon imports it; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .types import Model

__all__ = ["MIN_TIME_S", "DeviceTimes", "SpeedFit", "effective_model", "fit_speeds"]

MIN_TIME_S = 1e-6
"""Times at or below this (a microsecond: timer resolution) are floored to it and say
nothing about a device's speed."""
_ITERATIONS = 500
_TOLERANCE = 1e-12


@dataclass(frozen=True)
class DeviceTimes:
    """One device's measurement: ``layers[l] = (fwd_s, bwd_s)`` of a microbatch of
    ``microbatch`` samples (layers left out were not measured)."""

    microbatch: int
    layers: Mapping[int, tuple[float, float]]


@dataclass(frozen=True)
class SpeedFit:
    tflops: dict[str, float]
    """Effective TFLOP/s of each device that measured at least one layer."""
    fwd_gflop: tuple[float, ...]
    bwd_gflop: tuple[float, ...]
    """Effective per-sample GFLOP of each layer (profiled where no device measured)."""
    rms_log_error: float = 0.0
    """Root mean square of log(predicted / measured) over the entries fitted (those
    above the floor): 0 for rank-1 data, 0.1 for about 10% scatter."""
    measured_layers: frozenset[int] = field(default_factory=frozenset)

    def predict(self, device: str, layer: int, microbatch: int) -> tuple[float, float]:
        """(fwd_s, bwd_s) of ``layer`` on ``device`` for a microbatch (section 5.1)."""
        s = 1000.0 * self.tflops[device]
        return (microbatch * self.fwd_gflop[layer] / s, microbatch * self.bwd_gflop[layer] / s)


def fit_speeds(measured: Mapping[str, DeviceTimes], fwd_gflop: Sequence[float],
               bwd_gflop: Sequence[float]) -> SpeedFit:
    """Effective device speeds and layer GFLOP reproducing ``measured`` (see the module
    docstring). ``fwd_gflop`` / ``bwd_gflop``: the profiled per-sample GFLOP of every
    layer. Raises ValueError on a bad microbatch or layer index."""
    n_layers = len(fwd_gflop)
    if len(bwd_gflop) != n_layers:
        raise ValueError("fwd_gflop and bwd_gflop differ in length")
    devices = [d for d, t in measured.items() if t.layers]
    rows, cols, vals = [], [], []  # device index, column (2l fwd, 2l+1 bwd), log(t / m)
    for i, dev in enumerate(devices):
        times = measured[dev]
        if times.microbatch < 1:
            raise ValueError(f"{dev}: microbatch must be >= 1, got {times.microbatch}")
        for layer, (fwd, bwd) in times.layers.items():
            if not 0 <= layer < n_layers:
                raise ValueError(f"{dev}: layer {layer} outside the model's {n_layers} layers")
            for k, t in ((0, fwd), (1, bwd)):
                rows.append(i)
                cols.append(2 * layer + k)
                vals.append(np.log(max(float(t), MIN_TIME_S) / times.microbatch))
    r, c, y = np.asarray(rows, int), np.asarray(cols, int), np.asarray(vals, float)
    # entries at the floor say nothing about speed (timer resolution): left out of the fit
    micro = np.asarray([measured[d].microbatch for d in devices], float)
    floor = y <= np.log(MIN_TIME_S / micro[r]) + 1e-12 if len(y) else np.zeros(0, bool)
    fr, fc, fy = r[~floor], c[~floor], y[~floor]
    work = np.zeros(2 * n_layers)  # log w of each column (in the fit's own gauge)
    speed = np.zeros(len(devices))  # log (1000 s_d)
    if len(fy):
        _solve(fr, fc, fy, work, speed)
    has_speed = np.bincount(fr, minlength=len(devices)) > 0
    comps = _components(fr, fc, len(devices))
    comp_of = {i: k for k, (devs, _) in enumerate(comps) for i in devs}
    extra: dict[int, list[int]] = {}  # component -> its columns measured only at the floor
    fitted_cols = set(fc.tolist())
    for col in sorted(set(c.tolist()) - fitted_cols):
        # at most the floor time on every device that measured it (with a speed)
        options = [(y[e] + speed[r[e]], r[e]) for e in np.flatnonzero(c == col)
                   if has_speed[r[e]]]
        if options:
            work[col], dev = min(options)
            extra.setdefault(comp_of[int(dev)], []).append(col)
    profiled = np.empty(2 * n_layers)
    profiled[0::2], profiled[1::2] = fwd_gflop, bwd_gflop
    eff = profiled.copy()
    tflops: dict[str, float] = {}
    for k, (dev_ix, col_ix) in enumerate(comps):
        col_ix = np.asarray(sorted([*col_ix.tolist(), *extra.get(k, [])]), int)
        # gauge: the set's effective forward GFLOP add up to its profiled forward GFLOP
        # (forward and backward together when its forwards are all 0; else as fitted)
        fwd_cols = col_ix[col_ix % 2 == 0]
        target = profiled[fwd_cols].sum()
        cols_used = fwd_cols if target > 0 else col_ix
        target = target if target > 0 else profiled[col_ix].sum()
        fitted = np.exp(work[cols_used]).sum()
        shift = np.log(target / fitted) if target > 0 and fitted > 0 else 0.0
        eff[col_ix] = np.exp(work[col_ix] + shift)
        for i in dev_ix:
            if has_speed[i]:  # else it measured nothing above the floor
                tflops[devices[i]] = float(np.exp(speed[i] + shift) / 1000.0)
    rms = float(np.sqrt(np.mean((work[fc] - speed[fr] - fy) ** 2))) if len(fy) else 0.0
    used = has_speed[r]
    return SpeedFit(tflops=tflops, fwd_gflop=tuple(float(x) for x in eff[0::2]),
                    bwd_gflop=tuple(float(x) for x in eff[1::2]), rms_log_error=rms,
                    measured_layers=frozenset(int(x) // 2 for x in np.unique(c[used])))


def _solve(r: np.ndarray, c: np.ndarray, y: np.ndarray, work: np.ndarray,
           speed: np.ndarray) -> None:
    """Least squares of ``y = work[c] - speed[r]`` by alternating exact minimisation
    (each half-step is the closed-form optimum given the other half), in place."""
    n_cols, n_dev = len(work), len(speed)
    col_n = np.bincount(c, minlength=n_cols).astype(float)
    dev_n = np.bincount(r, minlength=n_dev).astype(float)
    has_col, has_dev = col_n > 0, dev_n > 0
    for _ in range(_ITERATIONS):
        work_new = np.zeros(n_cols)
        work_new[has_col] = (np.bincount(c, y + speed[r], n_cols)[has_col] / col_n[has_col])
        speed_new = np.zeros(n_dev)
        speed_new[has_dev] = np.bincount(r, work_new[c] - y, n_dev)[has_dev] / dev_n[has_dev]
        change = max(np.max(np.abs(work_new - work), initial=0.0),
                     np.max(np.abs(speed_new - speed), initial=0.0))
        work[:], speed[:] = work_new, speed_new
        if change < _TOLERANCE:
            break


def _components(r: np.ndarray, c: np.ndarray,
                n_dev: int) -> list[tuple[list[int], np.ndarray]]:
    """Connected sets of the bipartite graph devices -- measured columns: (device
    indices, column indices) of each. Each has its own undetermined common factor."""
    parent = list(range(n_dev))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_dev: dict[int, int] = {}
    for i, col in zip(r.tolist(), c.tolist(), strict=True):
        j = first_dev.setdefault(col, i)
        a, b = find(i), find(j)
        if a != b:
            parent[a] = b
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for i in range(n_dev):
        groups.setdefault(find(i), ([], []))[0].append(i)
    for col, i in first_dev.items():
        groups[find(i)][1].append(col)
    return [(devs, np.asarray(sorted(cols), int)) for devs, cols in groups.values()]


def effective_model(model: Model, fit: SpeedFit) -> Model:
    """``model`` with each layer's GFLOP replaced by the fit's (names, bytes kept)."""
    if len(fit.fwd_gflop) != model.num_layers:
        raise ValueError(f"the fit has {len(fit.fwd_gflop)} layers, the model "
                         f"{model.num_layers}")
    layers = tuple(replace(layer, fwd_gflop=f, bwd_gflop=b) for layer, f, b
                   in zip(model.layers, fit.fwd_gflop, fit.bwd_gflop, strict=True))
    return replace(model, layers=layers)
