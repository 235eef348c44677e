"""Exhaustive optimum for tiny cases: the yardstick for the planner.

Enumerates every device subset, every split of it into ordered pipeline
groups, every cut of every group, every recompute choice the memory forces,
every split of the microbatches, and the gpipe and 1f1b schedules, scoring
each with the reference model. Custom orders are not enumerated. Only for a
handful of devices and layers: the count grows super-exponentially.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from .refmodel import group_makespan, group_op_times, stage_memory_mb, sync_time
from .types import Cluster, Group, Job, Model, Plan, Stage

__all__ = ["brute_force"]


def _set_partitions(items: list[str]) -> Iterator[list[list[str]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]
        yield [[first], *part]


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def _group_variants(cluster: Cluster, model: Model, devs: Sequence[str], micro: int,
                    schedule: str, max_m: int) -> list[dict[int, tuple[float, tuple[Stage, ...]]]]:
    """Every cut of one ordered group: M -> (makespan, stages) for each M that fits.

    Recompute is switched on per M, only on stages that do not fit without it.
    """
    n_layers = model.num_layers
    out = []
    for cuts in itertools.combinations(range(1, n_layers), len(devs) - 1):
        bounds = (0, *cuts, n_layers)
        spans: dict[int, tuple[float, tuple[Stage, ...]]] = {}
        for m in range(1, max_m + 1):
            built = []
            for j, d in enumerate(devs):
                flight = m if schedule == "gpipe" else min(len(devs) - j, m)
                cap = 1000.0 * cluster.by_id[d].memory_gb
                stage = Stage(device=d, layers=(bounds[j], bounds[j + 1]))
                if stage_memory_mb(model, stage, micro, flight) > cap:
                    stage = Stage(device=d, layers=stage.layers, recompute=True)
                    if stage_memory_mb(model, stage, micro, flight) > cap:
                        break
                built.append(stage)
            else:
                group = Group(samples=m * micro, stages=tuple(built))
                times = group_op_times(cluster, model, group, micro)
                spans[m] = (group_makespan(times, schedule, m), group.stages)
                continue
            break
        if spans:
            out.append(spans)
    return out


def brute_force(cluster: Cluster, model: Model, job: Job) -> tuple[float, Plan | None]:
    """(best iteration time, its plan) over everything enumerated."""
    micro = job.microbatch_size
    total = job.microbatches
    ids = [d.id for d in cluster.devices]
    best_t, best_plan = float("inf"), None
    schedules = [s for s in ("1f1b", "gpipe") if s in job.schedules] or ["1f1b"]
    for schedule in schedules:
        for k in range(1, len(ids) + 1):
            for subset in itertools.combinations(ids, k):
                for part in _set_partitions(list(subset)):
                    if len(part) > total:
                        continue
                    ordered_groups = [list(itertools.permutations(g)) for g in part]
                    for orders in itertools.product(*ordered_groups):
                        variants = [_group_variants(cluster, model, o, micro, schedule, total)
                                    for o in orders]
                        for choice in itertools.product(*variants):
                            # sync depends on owners only, not on recompute or samples
                            any_stages = [next(iter(c.values()))[1] for c in choice]
                            sync = sync_time(cluster, model,
                                             [Group(samples=micro, stages=st) for st in any_stages])
                            if sync >= best_t:
                                continue
                            for split in _compositions(total, len(choice)):
                                found = [c.get(m) for c, m in zip(choice, split, strict=True)]
                                if any(f is None for f in found):
                                    continue
                                t = max(f[0] for f in found if f is not None) + sync
                                if t < best_t:
                                    best_t = t
                                    best_plan = Plan(
                                        microbatch_size=micro, schedule=schedule,
                                        groups=tuple(
                                            Group(samples=m * micro, stages=f[1])
                                            for f, m in zip(found, split, strict=True)
                                            if f is not None
                                        ),
                                    )
    return best_t, best_plan
