"""A job's cluster and model as its trainer measured them (issue 14).

Why: the agents' matmul probe is 10x off a real layer's speed, and by a factor
that differs between devices, dtypes and microbatch sizes; the trainer's own
layer times are not. Each rank may send, on Attach, the seconds its device took
for every layer's forward and backward (:mod:`hetpilot.trainer.speeds`); the
daemon keeps the latest per (job, device) and, before each of the job's
slots, fits them (:func:`hetpilot.planner.measured.fit_speeds`): one effective
TFLOP/s per device and effective GFLOP per layer, in the profile's units. The
job is then planned on

* the **model** with those GFLOP (layers no device measured keep the profile's);
* for a device that measured, ``tflops = r_d * now_d`` with ``r_d = s_d / ref_d``:
  ``s_d`` its fitted speed, ``ref_d`` the speed the daemon planned it with when
  the measurement came and ``now_d`` the speed it would plan it with now (the
  agent's probe, the slowdown estimator, an emulation file). Right after the
  measurement this is ``s_d`` exactly; when the device later slows down, its
  measured speed slows down by the same factor, without a new measurement;
* for a device that did not measure, its probe speed times the median ``r_d``
  of the devices that did, so a cluster mixing measured and probed devices stays
  comparable (a probe 10x optimistic on one device is taken to be about as
  optimistic on the others). A measured device whose ``ref_d`` was unknown (its
  agent had not registered yet) plans with ``s_d`` as it is.

Rules: only measurements in the dtype of the newest one are used (a trainer
that switched to bfloat16 supersedes its float32 times); times measured at a
microbatch size other than the job's are scaled linearly in the microbatch size
(section 5.1's op time is linear in it); layer indices beyond the model are
ignored (a measurement sent before the profile of a ``profile_on_attach`` job).
Emulated devices take the same path: a trainer under target-time emulation
measures its emulated times, ``m * gflop / (1000 T)``, and the fit gives back
``T`` and the profile's GFLOP.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hetpilot.planner.measured import DeviceTimes, SpeedFit, effective_model, fit_speeds
from hetpilot.planner.serde import model_to_dict
from hetpilot.planner.types import Cluster, Model

from .records import MeasurementRecord

__all__ = ["Measured", "fit_job"]


@dataclass(frozen=True)
class Measured:
    """The fit of one job's measurements and what the planner is given from it."""

    fit: SpeedFit
    model: Model
    """The job's model with the fitted per-layer GFLOP."""
    model_json: str
    ratios: dict[str, float]
    """``s_d / ref_d`` of each measured device whose reference speed was known."""
    dtype: str

    def apply(self, cluster: Cluster) -> Cluster:
        """``cluster`` with each device's TFLOP/s replaced as the module docstring says."""
        default = self._default_ratio(cluster)
        devices = []
        for d in cluster.devices:
            if d.id in self.ratios:
                tflops = self.ratios[d.id] * d.tflops
            elif d.id in self.fit.tflops:
                tflops = self.fit.tflops[d.id]
            else:
                tflops = default * d.tflops
            devices.append(replace(d, tflops=tflops))
        return replace(cluster, devices=tuple(devices))

    def _default_ratio(self, cluster: Cluster) -> float:
        """Median measured / probed speed of the measured devices (1 without any)."""
        if self.ratios:
            return float(statistics.median(self.ratios.values()))
        here = [self.fit.tflops[d.id] / d.tflops for d in cluster.devices
                if d.id in self.fit.tflops and d.tflops > 0]
        return float(statistics.median(here)) if here else 1.0


def fit_job(model: Model, records: Sequence[MeasurementRecord]) -> Measured | None:
    """The fit of a job's stored measurements on its profiled ``model``; None when no
    measurement names a layer of the model."""
    if not records:
        return None
    dtype = max(records, key=lambda r: r.unix_ms).dtype
    n = model.num_layers
    times = {r.device_id: DeviceTimes(r.microbatch, {t.layer: (t.fwd_s, t.bwd_s)
                                                     for t in r.layers if t.layer < n})
             for r in records if r.dtype == dtype}
    times = {d: t for d, t in times.items() if t.layers}
    if not times:
        return None
    fit = fit_speeds(times, [x.fwd_gflop for x in model.layers],
                     [x.bwd_gflop for x in model.layers])
    ratios = {r.device_id: fit.tflops[r.device_id] / r.ref_tflops for r in records
              if r.device_id in fit.tflops and r.ref_tflops > 0}
    eff = effective_model(model, fit)
    return Measured(fit=fit, model=eff, model_json=json.dumps(model_to_dict(eff)),
                    ratios=ratios, dtype=dtype)
