"""One control loop per job: each slot, observe the cluster, step the
controller, persist the slot (status, controller state, new plan version) in
one transaction, and wake the plan watchers.

The controller is ``hetpilot.planner.controller.Controller``, persisted with
its ``to_state()`` and restored with ``from_state()``. The step runs in a
worker thread so a slow solve never stalls the RPCs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hetpilot.planner.controller import Controller, ControllerConfig
from hetpilot.planner.errors import PlanningError
from hetpilot.planner.serde import plan_to_dict

from .records import JOB_CANCELLED, JobRecord, JobStatus, PlanRecord

if TYPE_CHECKING:
    from .core import ControlPlane

__all__ = ["JobLoop", "make_controller"]

log = logging.getLogger("hetpilot.daemon.control")


def make_controller(rec: JobRecord, state: Mapping[str, Any] | None) -> Controller:
    """The job's controller, restored from ``state`` (its to_state()) when given.

    The record's budgets and V win over the state's: an UpdateBudgets that
    landed after the last slot was recorded is not lost by a restart."""
    from .core import parse_model, to_job

    model, job = parse_model(rec.model_json), to_job(rec)
    config = ControllerConfig(slot_s=rec.slot_s)
    if state:
        ctrl = Controller.from_state(model, job, state, config)
    else:
        ctrl = Controller(model, job, config)
    ctrl.set_budgets(dict(rec.budgets), rec.V)
    return ctrl


class JobLoop:
    def __init__(self, plane: ControlPlane, job_id: str) -> None:
        self.plane = plane
        self.job_id = job_id
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._ctrl: Controller | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"job-{self.job_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def wake(self) -> None:
        self._wake.set()

    def set_budgets(self, budgets: Mapping[str, float], V: float) -> None:
        if self._ctrl is not None:
            self._ctrl.set_budgets(dict(budgets), V)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        self._wake.clear()

    async def _run(self) -> None:
        try:
            while True:
                rec = self.plane.store.get_job(self.job_id)
                if rec is None or rec.state == JOB_CANCELLED:
                    return
                if not rec.model_json:  # waiting for the trainer's profile
                    await self._sleep(rec.slot_s)
                    continue
                await self._slot(rec)
                await self._sleep(rec.slot_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("job %s: control loop failed", self.job_id)
        finally:
            self.plane.loop_done(self.job_id)

    async def _slot(self, rec: JobRecord) -> None:
        store, metrics = self.plane.store, self.plane.metrics
        status, state = store.job_status(self.job_id)
        if self._ctrl is None:
            self._ctrl = make_controller(rec, state)
        cluster = self.plane.observed_cluster(rec.allowed_hosts)
        if not cluster.devices:
            store.record_slot(self.job_id, status=JobStatus(
                slot=status.slot, plan_version=status.plan_version,
                iteration_s=status.iteration_s, costs=status.costs,
                cost_sums=status.cost_sums, queues=status.queues, devices=status.devices,
                warnings=("no devices are up",)), controller_state=state or {})
            return
        t0 = time.perf_counter()
        try:
            decision = await asyncio.to_thread(self._ctrl.step, cluster)
        except PlanningError as exc:
            store.record_slot(self.job_id, status=JobStatus(
                slot=status.slot, plan_version=status.plan_version,
                iteration_s=status.iteration_s, costs=status.costs,
                cost_sums=status.cost_sums, queues=status.queues, devices=status.devices,
                warnings=(f"no plan: {exc}",)), controller_state=state or {})
            return
        finally:
            metrics.solve_s.observe(time.perf_counter() - t0)
        costs = {k: float(v) for k, v in decision.costs.items()}
        queues = {k: float(v) for k, v in decision.queues.items()}
        sums = dict(status.cost_sums)
        for k, v in costs.items():
            sums[k] = sums.get(k, 0.0) + v
        new_plan = None
        if decision.version > status.plan_version:
            new_plan = PlanRecord(
                job_id=self.job_id, version=decision.version, slot=decision.slot,
                plan=plan_to_dict(decision.plan), iteration_s=float(decision.iteration_s),
                costs=costs, queues=queues, switch_cost_s=float(decision.switch_cost_s),
                warnings=tuple(decision.warnings), created_ms=int(time.time() * 1000))
        new_status = JobStatus(
            slot=decision.slot + 1, plan_version=max(decision.version, status.plan_version),
            iteration_s=float(decision.iteration_s), costs=costs, cost_sums=sums,
            queues=queues, devices=tuple(decision.plan.devices),
            warnings=tuple(decision.warnings))
        store.record_slot(self.job_id, status=new_status,
                          controller_state=self._ctrl.to_state(),
                          plan=new_plan)
        for kind, q in queues.items():
            metrics.queue.labels(job=self.job_id, kind=kind).set(q)
        if new_plan is not None:
            metrics.plan_versions.inc()
            self.plane.notify(self.job_id)
