"""One control loop per job: each slot, observe the cluster, step the
controller, persist the slot (status, controller state, new plan version) in
one transaction, and wake the plan watchers.

The controller (``hetpilot.planner.controller.Controller``) lives in the
planning process (:mod:`hetpilot.daemon.planner_process`), persisted with its
``to_state()``; the store's reads and transaction run in a worker thread; the
event loop only reads the live cluster tables and awaits. The loop reaches the
control plane only through :class:`LoopOwner`.

A loop never dies of an error: a slot that fails (a solver error, the store
full, a bug) is logged, shown in the job's warnings, and retried with
exponential back-off from the controller state last stored.
See [Note: slots in iterations].

[Note: slots in iterations]
Slots come every ``slot_s`` seconds, or, for a job with ``slot_iterations = N``,
each time the trainer's reported iteration (``StageTimingsReport.iteration``,
the highest any rank reported) has advanced by N since the last slot: a slot is
then an amount of training, not of wall-clock time, however fast the plan runs.
While no report comes for ``slot_s`` (no trainer yet, or it stopped) such a job
falls back to time, so it still gets its first plan and re-plans when devices
come and go. A reported iteration below the one the last slot saw (the trainer
restarted from scratch) starts the count again from it. A failing slot retries
on its back-off, not on iterations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from hetpilot.planner.errors import PlanningError
from hetpilot.planner.types import Cluster

from .config import DaemonConfig
from .errors import StorageError
from .metrics import Metrics
from .planner_process import PlannerProcess
from .records import DrainRecord, JobRecord, JobStatus, PlanRecord
from .store import Store

__all__ = ["MAX_BACKOFF_S", "JobLoop", "LoopOwner", "accrue", "backoff_s"]

log = logging.getLogger("hetpilot.daemon.control")


class LoopOwner(Protocol):
    """What a job loop needs of the control plane that runs it."""

    @property
    def planner(self) -> PlannerProcess: ...
    @property
    def config(self) -> DaemonConfig: ...
    @property
    def store(self) -> Store: ...
    @property
    def metrics(self) -> Metrics: ...

    async def planning_inputs(self, rec: JobRecord) -> tuple[Cluster, JobRecord]:
        """The cluster and job record one slot plans with."""
    def drained(self) -> Mapping[str, DrainRecord]: ...
    def loop_done(self, job_id: str, loop: JobLoop) -> None: ...
    def loop_failed(self, job_id: str, message: str | None) -> None: ...
    def set_queues(self, job_id: str, queues: Mapping[str, float]) -> None: ...
    def notify(self, job_id: str) -> None:
        """A new plan version is stored: wake its watchers."""

MAX_BACKOFF_S = 300.0
"""A failing loop retries at most this far apart (or one slot, if longer)."""


def backoff_s(failures: int, slot_s: float) -> float:
    """Delay before retry number ``failures`` (1, 2, ...): min(slot, 1 s), doubling."""
    first = min(slot_s, 1.0)
    return min(first * 2.0 ** min(failures - 1, 30), max(slot_s, MAX_BACKOFF_S))


def accrue(status: JobStatus, rec: JobRecord, now_ms: int) -> dict[str, float]:
    """``status.spent`` plus the cost rates of ``status`` (the plan that ran since that
    slot) over the wall time since the later of that slot and the job's first Attach:
    nothing runs, so nothing is spent, before a trainer attaches."""
    spent = dict(status.spent)
    if rec.started_ms:
        hours = max(0, now_ms - max(status.updated_ms, rec.started_ms)) / 3.6e6
        for kind, rate in status.costs.items():
            spent[kind] = spent.get(kind, 0.0) + rate * hours
    return spent


class JobLoop:
    """The control loop of one job (module docstring), a task on the event loop."""

    def __init__(self, plane: LoopOwner, job_id: str) -> None:
        self.plane = plane
        self.job_id = job_id
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._generation = -1
        """The planning process generation holding this job's controller (-1: none)."""
        self._budgets: tuple[dict[str, float], float] | None = None
        self.failures = 0
        """Consecutive failed slots; 0 while the loop is healthy."""
        self._slot_iterations = 0
        """The job's slot_iterations as the last slot read it (0: slots by time)."""
        self._reported = -1
        """The highest iteration the trainer reported (-1: none since the loop started)."""
        self._slot_iteration = -1
        """``_reported`` when the last slot ran."""
        self._reported_at = 0.0
        self._forced = False
        self.no_devices = False
        """The last slot found no device to plan on: the plane wakes the loop when an
        agent comes up (or a host is resumed) instead of leaving it a slot without a plan."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"job-{self.job_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def wake(self) -> None:
        """Run a slot now (the job's model arrived)."""
        self._forced = True
        self._wake.set()

    def note_iteration(self, iteration: int) -> None:
        """The trainer reported ``iteration``: with slots in iterations, a slot is due
        once it is ``slot_iterations`` past the last slot's."""
        self._reported_at = time.monotonic()
        if iteration < self._slot_iteration:  # the trainer started over: count from here
            self._slot_iteration = self._reported = iteration
        else:
            self._reported = max(self._reported, iteration)
        if self._slot_iterations and self._iterations_due():
            self._wake.set()

    def _iterations_due(self) -> bool:
        return self._reported - max(self._slot_iteration, 0) >= self._slot_iterations

    def set_budgets(self, budgets: Mapping[str, float], V: float) -> None:
        """Sent with the next step to the controller in the planning process."""
        self._budgets = (dict(budgets), V)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        self._wake.clear()

    async def _until_due(self, slot_s: float) -> None:
        """Slots in iterations: wait until the trainer has reported ``slot_iterations``
        more iterations, or ``slot_s`` has passed since the later of the last slot and
        the last report, or :meth:`wake`."""
        started = time.monotonic()
        while not (self._forced or self._iterations_due()):
            left = max(started, self._reported_at) + slot_s - time.monotonic()
            if left <= 0:
                return
            await self._sleep(left)

    async def _run(self) -> None:
        try:
            while (delay := await self._iteration()) is not None:
                if self._slot_iterations and not self.failures:
                    await self._until_due(delay)
                else:
                    await self._sleep(delay)
                self._forced = False
        finally:
            self.plane.planner.forget(self.job_id)
            self.plane.loop_done(self.job_id, self)

    async def _iteration(self) -> float | None:
        """One slot; the delay before the next, or None when the job has ended."""
        slot_s = self.plane.config.slot_s
        try:
            rec = self.plane.store.get_job(self.job_id)
            if rec is None or rec.ended:
                return None
            slot_s = rec.slot_s
            self._slot_iterations = rec.slot_iterations
            if rec.model_json:  # else: waiting for the trainer's profile
                self._slot_iteration = self._reported
                await self._slot(rec)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            self._generation = -1  # rebuilt from the last stored state on the retry
            delay = backoff_s(self.failures, slot_s)
            message = (f"control loop failed ({self.failures}x in a row): "
                       f"{type(exc).__name__}: {exc}; retrying in {delay:.3g} s")
            if self.failures == 1 and not isinstance(exc, StorageError):
                log.exception("job %s: %s", self.job_id, message)
            else:  # the traceback was logged on the first failure; a storage fault is
                # logged by the store and health (NOT_SERVING), not once more per job
                log.warning("job %s: %s", self.job_id, message)
            self.plane.loop_failed(self.job_id, message[:500])
            return delay
        if self.failures:
            log.info("job %s: control loop recovered after %d failed slots",
                     self.job_id, self.failures)
            self.failures = 0
            self.plane.loop_failed(self.job_id, None)
        return slot_s

    async def _slot(self, rec: JobRecord) -> None:
        plane = self.plane
        cluster, rec = await plane.planning_inputs(rec)
        status, state = await asyncio.to_thread(plane.store.job_status, self.job_id)
        self.no_devices = not cluster.devices
        if not cluster.devices:
            drained = sorted(plane.drained())
            await self._keep(rec, status, state, "no devices are up" + (
                f" (drained: {', '.join(drained[:8])}{' ...' if len(drained) > 8 else ''})"
                if drained else ""))
            return
        budgets, self._budgets = self._budgets, None
        t0 = time.perf_counter()
        try:
            out, self._generation = await plane.planner.step(
                self.job_id, rec, state, self._generation, budgets, cluster)
        except PlanningError as exc:
            await self._keep(rec, status, state, f"no plan: {exc}")
            return
        finally:
            plane.metrics.solve_s.observe(time.perf_counter() - t0)
        sums = dict(status.cost_sums)
        for k, v in out.costs.items():
            sums[k] = sums.get(k, 0.0) + v
        new_plan = None
        if out.version > status.plan_version:
            new_plan = PlanRecord(
                job_id=self.job_id, version=out.version, slot=out.slot, plan=out.plan,
                iteration_s=out.iteration_s, costs=out.costs, queues=out.queues,
                switch_cost_s=out.switch_cost_s, warnings=out.warnings,
                created_ms=int(time.time() * 1000))
        now_ms = int(time.time() * 1000)
        new_status = JobStatus(
            slot=out.slot + 1, plan_version=max(out.version, status.plan_version),
            iteration_s=out.iteration_s, costs=out.costs, cost_sums=sums,
            queues=out.queues, devices=out.devices, warnings=out.warnings,
            spent=accrue(status, rec, now_ms), updated_ms=now_ms)
        # a failure here (the store) is _iteration's: it rebuilds the controller, which
        # has stepped, from the state last stored
        await asyncio.to_thread(plane.store.record_slot, self.job_id, status=new_status,
                                controller_state=out.state, plan=new_plan)
        plane.set_queues(self.job_id, out.queues)
        if new_plan is not None:
            plane.metrics.plan_versions.inc()
            plane.notify(self.job_id)
            log.info("job %s: plan v%d (slot %d): predicted iteration %.4g s on %d device(s)"
                     ", %s", self.job_id, new_plan.version, new_plan.slot, new_plan.iteration_s,
                     len(out.devices), ", ".join(f"{k} {v:.4g}" for k, v in
                                                 sorted(out.costs.items())) or "no costs")

    async def _keep(self, rec: JobRecord, status: JobStatus, state: dict[str, Any] | None,
                    warning: str) -> None:
        """Record a slot that decided nothing: the same status, with ``warning`` (the
        trainer keeps running its last plan, so its cost keeps counting)."""
        now_ms = int(time.time() * 1000)
        await asyncio.to_thread(self.plane.store.record_slot, self.job_id,
                                status=replace(status, warnings=(warning,),
                                               spent=accrue(status, rec, now_ms),
                                               updated_ms=now_ms),
                                controller_state=state or {})
