"""The daemon's planning processes: every job's controller lives and steps here,
out of the daemon's event loop, in one of a few lanes by how long its solves take.

One process per lane, one call at a time, in order (FIFO: with more jobs than a
lane keeps up with, each loop still gets its turn); the planner's memo tables
serve every job of the lane. A process runs under a memory limit
(``RLIMIT_AS``): a job that asks for more fails its own slot with an error; the
process is started again and every controller rebuilt from the state the store
holds. A stop does not wait for a solve under way: the process is killed.
See [Note: why a process] and [Note: lanes].

[Note: why a process]
A solve is Python, numpy and solver code that holds the GIL for long stretches
(a compiled LP solve never lets go of it): in a thread of the daemon it stalled
the event loop for up to 0.65 s and health checks timed out. In its own process a
solve costs the event loop nothing, uses the second core, cannot corrupt the
daemon's memory, and runs under a memory limit.

[Note: lanes]
A job whose solves take long (a model of a thousand layers on tens of devices:
35 s a step on a 2-core VM) would hold up every other job's loop behind it, so
jobs plan in lanes by the time their solves take: under ``LIMITS[0]`` (2 s), under
``LIMITS[1]`` (20 s), and longer. A job starts in the lane its size says (layers x
devices, ``SIZES``), moves up after a solve past its lane's limit and down after
one under a quarter of the lower lane's. Only solves of a controller already built
count: the first after a (re)build also fills the planner's memo tables and
compiles its LP, several times a warm step. A job changing lanes is rebuilt there
from its stored state, as after a restart. A lane's process starts when a job
first needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing
import os
import resource
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

from hetpilot.planner.controller import Controller
from hetpilot.planner.serde import plan_to_dict
from hetpilot.planner.types import Cluster

from .job_model import make_controller, parse_model
from .records import JobRecord

__all__ = ["PlannerCrashed", "PlannerProcess", "StepResult"]

T = TypeVar("T")
log = logging.getLogger("hetpilot.daemon")


class PlannerCrashed(RuntimeError):
    """The planning process died (killed, or out of its memory limit) during a step."""


@dataclass(frozen=True)
class StepResult:
    """What one controller step decided, in plain values (it crosses processes)."""

    slot: int
    version: int
    plan: dict[str, Any]
    """Spec v1 section 4 JSON of the plan."""
    devices: tuple[str, ...]
    iteration_s: float
    costs: dict[str, float]
    queues: dict[str, float]
    switch_cost_s: float
    warnings: tuple[str, ...]
    state: dict[str, Any]
    """The controller's to_state() after the step."""
    solve_s: float = 0.0
    """Seconds the step took in the planning process (not counting its wait there)."""


# -- in the planning process ------------------------------------------------------

_CONTROLLERS: dict[str, Controller] = {}
_MODEL_JSON: dict[str, str] = {}
"""The model JSON each kept controller plans with: a job's model changes when its
trainer's measured layer times do (:mod:`hetpilot.daemon.measured_fit`)."""


def _orphan_watch(parent: int) -> None:
    """End this process when the daemon is gone (kill -9 leaves no stop to kill us)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _start(memory_mb: int, parent: int) -> None:
    # the daemon's pid as it gave it, not getppid() here: a daemon that ended while this
    # process was still starting has left it with init as its parent, which it would
    # then watch for ever
    threading.Thread(target=_orphan_watch, args=(parent,), name="orphan-watch",
                     daemon=True).start()
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    from hetpilot.planner.assign import warm_up

    with contextlib.suppress(Exception):  # the first real solve reports what is wrong
        warm_up()  # import cvxpy and compile a small LP before the first real slot


def _step(job_id: str, rec: JobRecord, state: Mapping[str, Any] | None, reset: bool,
          budgets: tuple[dict[str, float], float] | None, cluster: Cluster) -> StepResult:
    started = time.perf_counter()
    ctrl = None if reset else _CONTROLLERS.get(job_id)
    if ctrl is not None and ctrl.job.tensor_parallel != rec.tensor_parallel:
        # the job's trainer changed whether it runs TP stages: rebuilt from its own state
        state, ctrl = ctrl.to_state(), None
    if ctrl is None:
        _CONTROLLERS.pop(job_id, None)
        ctrl = make_controller(rec, state)  # the record's budgets are the newest
    else:
        if budgets is not None:
            ctrl.set_budgets(*budgets)
        if _MODEL_JSON.get(job_id) != rec.model_json:  # new measurements: plan with them
            ctrl.model = parse_model(rec.model_json)
    _MODEL_JSON[job_id] = rec.model_json
    try:
        decision = ctrl.step(cluster)
    except BaseException:
        _CONTROLLERS.pop(job_id, None)  # rebuilt from the stored state next time
        _MODEL_JSON.pop(job_id, None)
        raise
    _CONTROLLERS[job_id] = ctrl
    return StepResult(
        slot=decision.slot, version=decision.version, plan=plan_to_dict(decision.plan),
        devices=tuple(decision.plan.devices), iteration_s=float(decision.iteration_s),
        costs={k: float(v) for k, v in decision.costs.items()},
        queues={k: float(v) for k, v in decision.queues.items()},
        switch_cost_s=float(decision.switch_cost_s), warnings=tuple(decision.warnings),
        state=ctrl.to_state(), solve_s=time.perf_counter() - started)


def _forget(job_id: str) -> None:
    _CONTROLLERS.pop(job_id, None)
    _MODEL_JSON.pop(job_id, None)


# -- in the daemon ------------------------------------------------------------------

async def _await(future: Future[T]) -> T:
    """Await a concurrent future without tying its fate to the awaiting task: when the
    task is cancelled (a job ends, the daemon stops) the call is simply abandoned.
    (``run_in_executor`` cancels the call too, and Python 3.11's process pool then
    fails in its own thread when the process is killed with that call queued.)"""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(f: Future[T]) -> None:
        if done.done():
            return
        if f.cancelled():
            done.cancel()
        elif (exc := f.exception()) is not None:
            done.set_exception(exc)
        else:
            done.set_result(f.result())

    def relay(f: Future[T]) -> None:  # on the pool's thread
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            loop.call_soon_threadsafe(settle, f)

    future.add_done_callback(relay)
    return await done


LIMITS = (2.0, 20.0, float("inf"))
"""The longest solve (seconds) each lane is for."""
SIZES = (4096, 16384)
"""Layers x devices from which a job starts in the second and third lane (its solve time
is not known yet): 1024 layers on 32 devices took 35 s a step, 256 on 32 about 3 s, 64 on
32 about 2 s cold, on a 2-core VM."""
LANES = ("light", "heavy", "heaviest")


def _size(rec: JobRecord, cluster: Cluster) -> int:
    """Layers x devices: what a solve's time grows with."""
    try:
        layers = len(json.loads(rec.model_json).get("layers", ())) if rec.model_json else 0
    except (ValueError, AttributeError):
        layers = 0
    return layers * len(cluster.devices)


def _lane_for(solve_s: float, index: int) -> int:
    """The lane after a warm solve of ``solve_s`` in lane ``index``: up to the first whose
    limit it is within once past its own; down to that lane only under a quarter of its
    limit (a solve near a limit does not make the job flap between two lanes)."""
    fits = next(i for i, limit in enumerate(LIMITS) if solve_s <= limit)
    if fits > index or (fits < index and solve_s < LIMITS[fits] / 4):
        return fits
    return index


class _Lane:
    """One planning process (started on first use) and the generation of its controllers."""

    def __init__(self, name: str, memory_mb: int, generations: itertools.count[int]) -> None:
        self.name, self.memory_mb, self._generations = name, memory_mb, generations
        self.generation = -1
        """The running process's generation (unique over lanes and restarts)."""
        self.pool: ProcessPoolExecutor | None = None

    def executor(self) -> ProcessPoolExecutor:
        if self.pool is None:
            # spawn, not fork: the daemon has grpc and sqlite threads a fork would copy
            self.pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start, initargs=(self.memory_mb, os.getpid()))
            self.generation = next(self._generations)
        return self.pool

    def crashed(self, pool: ProcessPoolExecutor) -> None:
        if self.pool is pool:
            self.pool = None
            pool.shutdown(wait=False, cancel_futures=True)

    def forget(self, job_id: str) -> None:
        if self.pool is not None:
            with contextlib.suppress(BrokenProcessPool, RuntimeError):  # nothing kept then
                self.pool.submit(_forget, job_id)

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is None:
            return
        for proc in list(getattr(pool, "_processes", {}).values()):  # no public accessor
            if proc.is_alive():
                proc.kill()
        pool.shutdown(wait=False)  # its calls then fail with BrokenProcessPool


class PlannerProcess:
    """The planning processes (one per lane, module docstring) seen from the daemon's
    event loop; each started on first use."""

    def __init__(self, memory_mb: int = 0) -> None:
        self.memory_mb = memory_mb
        generations = itertools.count(1)
        self._lanes = {name: _Lane(name, memory_mb, generations) for name in LANES}
        self._next: dict[str, int] = {}
        """The lane (index into LANES) each job's next step goes to; absent before its
        first."""
        self._lane_of: dict[str, str] = {}
        """The lane holding each job's controller."""

    @property
    def generation(self) -> int:
        """The light lane's process generation (bumped each time one starts)."""
        return self._lanes["light"].generation

    def lane(self, job_id: str) -> str | None:
        """The lane (one of LANES) that stepped the job last (None: not yet)."""
        return self._lane_of.get(job_id)

    async def step(self, job_id: str, rec: JobRecord, state: Mapping[str, Any] | None,
                   generation: int, budgets: tuple[dict[str, float], float] | None,
                   cluster: Cluster) -> tuple[StepResult, int]:
        """One controller step of the job, and the process generation that now holds its
        controller. The controller is rebuilt from ``state`` unless ``generation`` (what
        the last step returned; -1 to force it) is the running process's of its lane.

        Raises what the step raised (PlanningError, ValidationError, MemoryError, ...)
        or PlannerCrashed when the process died; the next call starts a new one."""
        index = self._next.get(job_id)
        if index is None:
            size = _size(rec, cluster)
            index = sum(size >= bound for bound in SIZES)
        lane = self._lanes[LANES[index]]
        previous = self._lane_of.get(job_id)
        if previous is not None and previous != lane.name:
            self._lanes[previous].forget(job_id)  # rebuilt from the stored state there
        self._lane_of[job_id] = lane.name
        pool = lane.executor()
        current = lane.generation
        cold = generation != current
        try:
            result = await _await(pool.submit(_step, job_id, rec, state, cold, budgets,
                                              cluster))
        except BrokenProcessPool:
            lane.crashed(pool)
            raise PlannerCrashed(
                "the planning process died during this step (over its memory limit, "
                f"{self.memory_mb} MB, or killed); it is being restarted") from None
        self._next[job_id] = index if cold else _lane_for(result.solve_s, index)
        if self._next[job_id] != index:
            log.info("job %s: a solve took %.2f s; it plans in the %s lane from its next "
                     "slot", job_id, result.solve_s, LANES[self._next[job_id]])
        return result, current

    def forget(self, job_id: str) -> None:
        """Drop the job's controller (the job ended); nothing to do when none runs."""
        self._next.pop(job_id, None)
        lane = self._lane_of.pop(job_id, None)
        if lane is not None:
            self._lanes[lane].forget(job_id)

    def close(self) -> None:
        """Stop at once: a solve under way is abandoned and its process killed."""
        for lane in self._lanes.values():
            lane.close()
