"""A job's cluster and model as its trainer measured them: the fit of the layer
times ranks send on Attach, and the cluster and model a slot plans with from it.

Why: the agents' matmul probe is 10x off a real layer's speed, and by a factor
that differs between devices, dtypes and microbatch sizes; the trainer's own
layer times (:mod:`hetpilot.trainer.speeds`) are not. The daemon keeps the latest
measurement per (job, device) (:mod:`hetpilot.daemon.trainers`) and, before each
of the job's slots, fits them (:func:`hetpilot.planner.measured.fit_speeds`): one
effective TFLOP/s per device and effective GFLOP per layer, in the profile's
units. See [Note: measured speeds], [Note: measured links], [Note: which
measurements count].

[Note: measured speeds]
The job is planned on the **model** with the fitted GFLOP (layers no device
measured keep the profile's), and, for a device that measured, on
``tflops = r_d * now_d`` with ``r_d = s_d / ref_d``: ``s_d`` its fitted speed,
``ref_d`` the speed the daemon planned it with when the measurement came and
``now_d`` the speed it would plan it with now (the agent's probe, the slowdown
estimator, an emulation file). Right after the measurement this is ``s_d``
exactly; when the device later slows down, its measured speed slows down by the
same factor, without a new measurement. A device that did not measure gets its
probe speed times the median ``r_d`` of the devices that did, so a cluster mixing
measured and probed devices stays comparable (a probe 10x optimistic on one
device is taken to be about as optimistic on the others). A measured device whose
``ref_d`` was unknown (its agent had not registered yet) plans with ``s_d`` as it is.

[Note: measured links]
A rank may also send what the job's own process group measured between its
device and other ranks' devices (:mod:`hetpilot.trainer.linkprobe`: the one-way
time of an activation-sized message while the ranks compute, and the bandwidth of
the pair's all-reduce). Each measured pair whose two devices are in the cluster
becomes a ``device_links`` entry (spec section 1: it overrides the host-level
figures for that pair only): ``gbps = measured * now / ref`` and
``latency = measured + (now - ref)`` (at least 0), with ``ref`` the pair's figures
in the daemon's cluster when the measurement came and ``now`` today's, so a link
the agents see slow down later slows down for the job too. A pair measured from
both ends takes the newer measurement.

[Note: which measurements count]
Only measurements in the dtype of the newest one are used (a trainer that
switched to bfloat16 supersedes its float32 times); times measured at a
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
from hetpilot.planner.types import Cluster, Link, Model

from .records import LinkTime, MeasurementRecord

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
    links: tuple[tuple[str, LinkTime], ...] = ()
    """``(measuring device, link)`` of every measured pair, newest measurement last."""

    def apply(self, cluster: Cluster) -> Cluster:
        """``cluster`` with each device's TFLOP/s replaced and the measured links added
        ([Note: measured speeds], [Note: measured links])."""
        return self._apply_links(self._apply_speeds(cluster))

    def _apply_links(self, cluster: Cluster) -> Cluster:
        if not self.links:
            return cluster
        view = replace(cluster)  # lookups fill caches (mapping proxies) that do not pickle
        ids = view.by_id
        entries: dict[tuple[str, str], Link] = {}
        for device, lt in self.links:
            if device not in ids or lt.peer not in ids:
                continue
            now_gbps, now_lat = view.link(device, lt.peer)
            gbps = lt.gbps * now_gbps / lt.ref_gbps if lt.ref_gbps > 0 else lt.gbps
            lat = max(0.0, lt.latency_s + (now_lat - lt.ref_latency_s if lt.ref_gbps > 0
                                           else 0.0))
            entries[(min(device, lt.peer), max(device, lt.peer))] = Link(
                a=device, b=lt.peer, gbps=gbps, latency_us=lat * 1e6)
        if not entries:
            return cluster
        network = replace(cluster.network, device_links=(
            *cluster.network.device_links, *entries.values()))
        return replace(cluster, network=network)

    def _apply_speeds(self, cluster: Cluster) -> Cluster:
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
    links = tuple((r.device_id, lt) for r in sorted(records, key=lambda r: r.unix_ms)
                  for lt in r.links)
    return Measured(fit=fit, model=eff, model_json=json.dumps(model_to_dict(eff)),
                    ratios=ratios, dtype=dtype, links=links)
