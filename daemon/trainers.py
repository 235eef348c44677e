"""What the daemon keeps of a job's trainers: the device each attached rank runs on,
the layer times ranks measured and their fit (:mod:`hetpilot.daemon.measured_fit`),
and the slowdown samples their stage timings give the estimator
(:mod:`hetpilot.adapt.online`). The job side of Attach and of a stage-timing
report (states, loops) is the control plane's; this class never touches them.
Runs on the event loop thread; fits run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import replace

from hetpilot.adapt.online import Adapter
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import plan_from_dict
from hetpilot.planner.types import Model, Plan

from .cluster_view import device_speed, link_refs, observed_cluster
from .config import DaemonConfig
from .job_model import MAX_LAYERS, parse_model
from .measured_fit import Measured, fit_job
from .membership import Membership
from .records import JobRecord, MeasurementRecord, TimingsRecord
from .store import Store

__all__ = ["PLANS_KEPT", "Trainers"]

log = logging.getLogger("hetpilot.daemon")

PLANS_KEPT = 4
"""Parsed plan versions kept per job for stage-timing reports (ranks report the
version they ran, a few behind the newest while a switch goes round)."""


class Trainers:
    """Attached ranks, measurements and fits, and the estimator's stage-timing feed."""

    def __init__(self, store: Store, config: DaemonConfig, members: Membership,
                 adapter: Adapter) -> None:
        self.store, self.config, self.members, self.adapter = store, config, members, adapter
        self._models: dict[str, Model] = {}
        # layer times measured by the trainers, by job and device (loaded lazily), a
        # counter bumped by each new one, and each job's last fit with its key
        self._measurements: dict[str, dict[str, MeasurementRecord]] = {}
        self._measure_epoch: dict[str, int] = {}
        self._fits: dict[str, tuple[tuple[int, int], Measured | None]] = {}
        self._plans: dict[str, dict[int, Plan]] = {}
        """Each job's plans by version, parsed once from the store (:data:`PLANS_KEPT`)."""
        self.attached: dict[tuple[str, int], str] = {}
        """(job, rank) -> the device it said it runs on."""

    def forget(self, job_id: str) -> None:
        """Drop what is cached of the job (its loop ended; the store keeps the rest)."""
        for cache in (self._measurements, self._measure_epoch, self._fits, self._models,
                      self._plans):
            cache.pop(job_id, None)

    # -- attach -----------------------------------------------------------------

    def model(self, rec: JobRecord) -> Model:
        """The job's profiled model, parsed once."""
        model = self._models.get(rec.job_id)
        if model is None:
            model = self._models[rec.job_id] = parse_model(rec.model_json)
        return model

    def set_model(self, job_id: str, model: Model) -> None:
        """The job's model arrived with an Attach (profile_on_attach)."""
        self._models[job_id] = model

    @staticmethod
    def check_measurement(measured: MeasurementRecord, model: Model | None) -> None:
        """Refuse, by field, layer times of layers the model does not have (without a
        model yet: beyond :data:`MAX_LAYERS`; the fit ignores those beyond it later)."""
        limit = model.num_layers if model is not None else MAX_LAYERS
        what = "the model's layers" if model is not None else None
        for i, t in enumerate(measured.layers):
            if t.layer >= limit:
                raise ValidationError(f"layer_times[{i}].layer",
                                      f"must be < {limit}" + (f" ({what})" if what else "")
                                      + f", got {t.layer}")

    def add_measurement(self, job_id: str, device_id: str,
                        measured: MeasurementRecord) -> None:
        """Keep a rank's measurement with the speeds it is relative to (the device's and,
        for its links, each pair's in the observed cluster now)."""
        before = self._job_measurements(job_id).get(device_id)  # loaded before the new one
        if measured.links:
            cluster = observed_cluster(self.members, self.adapter, self.config)
            links = link_refs(cluster, device_id, measured.links)
        else:  # none sent: keep
            links = before.links if before is not None else ()
        measured = replace(measured, links=links,
                           ref_tflops=device_speed(self.members, self.adapter, device_id))
        self.store.put_measurement(measured)
        self._measurements[job_id][device_id] = measured
        self._measure_epoch[job_id] = self._measure_epoch.get(job_id, 0) + 1

    def _job_measurements(self, job_id: str) -> dict[str, MeasurementRecord]:
        """The job's measurements by device, read from the store on first use."""
        found = self._measurements.get(job_id)
        if found is None:
            found = self._measurements[job_id] = {
                m.device_id: m for m in self.store.measurements(job_id)}
        return found

    # -- fits -------------------------------------------------------------------

    async def fit(self, rec: JobRecord) -> Measured | None:
        """The fit of the job's measurements, redone in a worker thread only when a
        measurement or the model changed since the last."""
        if not rec.model_json:
            return None
        records = self._measurements.get(rec.job_id)
        if records is None:
            loaded = await asyncio.to_thread(self.store.measurements, rec.job_id)
            records = self._measurements.setdefault(rec.job_id,
                                                    {m.device_id: m for m in loaded})
        if not records:
            return None
        key = (self._measure_epoch.get(rec.job_id, 0), len(rec.model_json))
        cached = self._fits.get(rec.job_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        model = self.model(rec)
        result = await asyncio.to_thread(fit_job, model, list(records.values()))
        self._fits[rec.job_id] = (key, result)
        if result is not None:
            log.info("job %s: planning with speeds measured on %d device(s) (%s, fit "
                     "error %.1f%%): %s", rec.job_id, len(result.fit.tflops), result.dtype,
                     100 * result.fit.rms_log_error,
                     ", ".join(f"{d} {t:.3g} TF" for d, t in sorted(result.fit.tflops.items())))
        return result

    def fits(self, jobs: Collection[str]) -> dict[str, Measured]:
        """The measured-speed fit each of ``jobs`` planned its last slot with."""
        return {job_id: fit for job_id, (_, fit) in self._fits.items()
                if fit is not None and job_id in jobs}

    # -- stage timings ------------------------------------------------------------

    def plan(self, job_id: str, version: int) -> Plan | None:
        """Version ``version`` of the job's plan, read and parsed on its first use."""
        plans = self._plans.setdefault(job_id, {})
        plan = plans.get(version)
        if plan is None:
            found = [p for p in self.store.plans(job_id, max(0, version - 1))
                     if p.version == version]
            if not found:
                return None
            plan = plans[version] = plan_from_dict(found[0].plan)
            for old in sorted(plans)[:-PLANS_KEPT]:
                del plans[old]
        return plan

    def learn(self, rec: JobRecord, timings: TimingsRecord) -> None:
        """Stage timings -> slowdown samples for the estimator. See [Note: fitted work]."""
        # [Note: fitted work]
        # With measured layer times the stage's work is the fitted GFLOP, not the
        # profile's: the estimator's calibration (the quietest ratio of measured to
        # predicted time on a device) then holds across stages, so a re-cut does not
        # look like a slowdown, and its predicted slowdown scales the measured speed
        # (measured_fit) instead of fighting it.
        if not rec.model_json:
            return
        fitted = self._fits.get(rec.job_id)
        model = fitted[1].model if fitted is not None and fitted[1] is not None \
            else self.model(rec)
        plan = self.plan(rec.job_id, timings.plan_version)
        if plan is None:
            return
        where = {s.device: (g, s) for g in plan.groups for s in g.stages}
        for st in timings.stages:
            host, _, index = st.device_id.rpartition(":")
            agent, report = self.members.agent(host), self.members.latest_report(host)
            if agent is None or report is None or st.device_id not in where:
                continue
            info = next((d for d in agent.devices if d.index == index), None)
            dev = next((d for d in report.devices if d.index == index), None)
            if info is None or dev is None or info.emulated:
                continue
            group, stage = where[st.device_id]
            a, b = stage.layers
            self.adapter.learn(st.device_id, self.adapter.interference(host, dev, info.tflops),
                               model.layers[a:b], plan.microbatch_size, group.samples,
                               st.fwd_s + st.bwd_s, info.tflops)
