"""Staleness-aware planning: synchronous plans against asynchronous pipelines by time to accuracy.

An asynchronous pipeline (PipeDream 1F1B with weight stashing, no flush)
runs at the steady-state rate of its slowest stage, with no fill or drain
per iteration, but stage j of S computes with weights ``S - j - 1`` updates
old, and stale gradients need more steps to reach a target accuracy. The
objective both kinds of plan are compared on is the estimated time to
accuracy::

    TTA = steps(mean staleness) x time per step

with ``steps(s)`` from a model fitted to measured runs (anything with an
``iterations(staleness) -> float`` method, e.g.
:class:`hetpilot.adapt.staleness.StalenessModel`) and one step per
microbatch, as the asynchronous runtime steps (``trainer/async_pipeline.py``).
A synchronous plan has staleness 0 and takes ``iteration_s / M`` per
microbatch (the same samples per update, linear learning-rate scaling), so
fewer, larger stages win as soon as the staleness of a deep pipeline costs
more than its throughput saves.

Asynchronous candidates are one pipeline over the S fastest devices (fastest
first, ties by id), cut by the planner's communication-aware partition for
1f1b; their time per microbatch is the reference model's steady-state 1F1B
period, ``(P(2M) - P(M)) / M`` with P the group makespan of spec section 5.2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .partition import partition_group
from .refmodel import group_makespan, group_op_times
from .search import candidate_plans
from .structure_planner import Planner
from .types import Cluster, Group, Job, Model, Plan, Stage

__all__ = ["AsyncChoice", "StepsModel", "choose_by_time_to_accuracy", "cut_points", "mean_staleness",
           "pipeline_cut"]


class StepsModel(Protocol):
    def iterations(self, staleness: float) -> float:
        """Optimizer steps (one per microbatch) to the target at this mean staleness."""
        ...


def mean_staleness(stages: int) -> float:
    """Mean over the stages of PipeDream's staleness ``S - j - 1``."""
    return (stages - 1) / 2.0


@dataclass(frozen=True)
class AsyncChoice:
    plan: Plan
    asynchronous: bool
    stages: int
    per_microbatch_s: float
    """Seconds per microbatch: the steady-state period (async) or iteration_s / M (sync)."""
    tta_s: float
    """Estimated time to accuracy: steps(mean staleness) x per_microbatch_s."""


def choose_by_time_to_accuracy(
    cluster: Cluster, model: Model, job: Job, steps: StepsModel, *,
    max_stages: int | None = None, synchronous: bool = True,
) -> list[AsyncChoice]:
    """Every candidate, asynchronous pipelines of 1..max_stages stages and (unless
    ``synchronous=False``) the planner's synchronous candidates, fastest to
    accuracy first."""
    out: list[AsyncChoice] = []
    microbatches = job.microbatches
    if synchronous:
        for cand in candidate_plans(cluster, model, job):
            stages = max(len(g.stages) for g in cand.plan.groups)
            per_mb = cand.iteration_s / microbatches
            out.append(AsyncChoice(cand.plan, False, stages, per_mb, steps.iterations(0.0) * per_mb))
    ranked = sorted(cluster.devices, key=lambda d: (-d.tflops, d.id))
    limit = min(len(ranked), model.num_layers, max_stages or len(ranked))
    for n in range(1, limit + 1):
        plan = pipeline_cut(cluster, model, job, [d.id for d in ranked[:n]])
        if plan is None:
            continue
        times = group_op_times(cluster, model, plan.groups[0], job.microbatch_size)
        period = (group_makespan(times, "1f1b", 2 * microbatches)
                  - group_makespan(times, "1f1b", microbatches)) / microbatches
        out.append(AsyncChoice(plan, True, n, period, steps.iterations(mean_staleness(n)) * period))
    return sorted(out, key=lambda c: (c.tta_s, c.asynchronous, c.stages))


def pipeline_cut(cluster: Cluster, model: Model, job: Job, device_ids: Sequence[str]) -> Plan | None:
    """One 1f1b pipeline over ``device_ids`` in that order (e.g. the ranks an
    asynchronous run already has), cut by the planner; None if it does not fit.
    This is the re-cut of a running pipeline when its devices' speeds change."""
    planner = Planner(cluster, model, job)
    devs = [cluster.by_id[d] for d in device_ids]
    cut = partition_group(planner.arr, devs, planner.links(devs), job.microbatch_size,
                          job.microbatches, "1f1b")
    if cut is None:
        return None
    stages = tuple(Stage(device=d.id, layers=(cut.bounds[j], cut.bounds[j + 1]),
                         recompute=cut.recompute[j]) for j, d in enumerate(devs))
    return Plan(microbatch_size=job.microbatch_size, schedule="1f1b",
                groups=(Group(samples=job.global_batch, stages=stages),))


def cut_points(plan: Plan) -> Sequence[int]:
    """Layer boundaries of a one-group plan: ``(0, b1, ..., L)``."""
    stages = plan.groups[0].stages
    return (0, *(s.layers[1] for s in stages))
