"""The controller's local search over device mappings, carried from slot to slot.

:func:`~.search.make_plan` improves its best mappings by local search
(:mod:`.localsearch`) in one go; a controller, which plans every job every slot,
spends a small budget per slot instead and resumes where the last slot stopped
(:class:`CarriedDescent`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .candidates import Candidate
from .localsearch import (
    LOCAL_SEARCH_DEVICES,
    LOCAL_SEARCH_STARTS,
    DeviceMapping,
    descend,
    mapping_key,
)
from .structure_planner import Planner, model_token
from .structures import EVERY_MAPPING_DEVICES, Structure, searched_schedules
from .types import Cluster, Job, Model, Plan

__all__ = ["CarriedDescent"]


@dataclass
class _Walk:
    """One descent of :class:`CarriedDescent`: where it is, what it planned, whether it
    reached a local optimum."""

    current: DeviceMapping
    origin: tuple[tuple[str, ...], ...]
    """The mapping it started from."""
    tried: set[tuple[tuple[str, ...], ...]] = field(default_factory=set)
    done: bool = False


_DRIFT = 0.1
"""Relative change of a device's or link's figures that restarts :class:`CarriedDescent`."""


def _figures(cluster: Cluster) -> dict[object, tuple[float, float]]:
    """What a mapping's time depends on besides the model: each device's (TFLOP/s, GB) and
    each pair's (Gbit/s, latency)."""
    out: dict[object, tuple[float, float]] = {d.id: (d.tflops, d.memory_gb) for d in cluster.devices}
    ids = [d.id for d in cluster.devices]
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            out[(a, b)] = cluster.link(a, b)
    return out


def _drifted(old: dict[object, tuple[float, float]], new: dict[object, tuple[float, float]]) -> bool:
    if old.keys() != new.keys():
        return True
    return any(abs(x - y) > _DRIFT * max(abs(x), abs(y))
               for k, pair in new.items() for x, y in zip(old[k], pair, strict=True))


def _mapping_of(plan: Plan, cluster: Cluster) -> DeviceMapping:
    """``plan``'s groups as ``cluster``'s devices, in stage order."""
    return tuple(tuple(cluster.by_id[s.device] for s in g.stages) for g in plan.groups)


class CarriedDescent:
    """The controller's local search (:mod:`.localsearch`), carried from slot to slot.

    ``make_plan`` spends up to :data:`~.localsearch.LOCAL_SEARCH_BUDGET` plannings per schedule at
    once (1-3 s on 16 devices); a controller plans every job every slot in one
    process, and 8 jobs on 16 devices fell behind 5 s slots with that. So each slot
    here spends at most ``budget`` plannings per schedule, resuming the descents where
    the last slot stopped, skipping mappings they planned while the cluster was the
    same. The first descent starts from the faster of the mapping carried over and
    this slot's fastest candidate; when it reaches a local optimum the next starts
    from the next fastest distinct candidate, as ``make_plan``'s do, up to
    :data:`~.localsearch.LOCAL_SEARCH_STARTS`. Once all are done on an unchanged cluster, slots cost
    a re-planning of the best mapping only. A changed cluster starts afresh from the
    best mapping carried over: other devices, or a device's speed or memory or a
    link's bandwidth or latency more than :data:`_DRIFT` away from where the scan
    started. Smaller changes (a daemon's measurements move a little every slot) keep
    the scan going, or it would re-plan the same first neighbours every slot; prices
    and power, which the search does not read, change nothing.

    One object per job. Not persisted: a restarted controller starts again from its
    search's candidates.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._key: tuple[object, ...] | None = None
        self._figures: dict[object, tuple[float, float]] = {}
        self._best: dict[str, DeviceMapping] = {}
        self._walks: dict[str, list[_Walk]] = {}
        self.planned = 0
        """Mappings planned over the object's life (for benchmarks)."""

    def __call__(self, cluster: Cluster, model: Model, job: Job,
                 found: Sequence[Candidate]) -> list[Candidate]:
        """The fastest mapping per schedule found so far, as a candidate on ``cluster``
        (labelled ``local/carried``) where it beats ``found``; nothing outside 5-16
        devices."""
        n = len(cluster.devices)
        if self.budget <= 0 or not found or not (EVERY_MAPPING_DEVICES < n <= LOCAL_SEARCH_DEVICES):
            return []
        key = (tuple((d.id, d.host) for d in cluster.devices), model_token(model),
               job.global_batch, job.microbatch_size, tuple(job.schedules))
        figures = _figures(cluster)
        if key != self._key or _drifted(self._figures, figures):
            self._key, self._figures, self._walks = key, figures, {}
        planner = Planner(cluster, model, job)
        out: list[Candidate] = []
        for schedule in searched_schedules(job):
            best = self._schedule(planner, schedule, found)
            if best is not None and best.label.startswith("local/"):
                out.append(replace(best, label="local/carried"))
        return out

    def _schedule(self, planner: Planner, schedule: str,
                  found: Sequence[Candidate]) -> Candidate | None:
        cluster = planner.cluster
        spent = [0]
        planned: dict[tuple[tuple[str, ...], ...], Candidate | None] = {}

        def plan(groups: DeviceMapping) -> Candidate | None:
            k = mapping_key(groups)
            if k not in planned:
                spent[0] += 1
                planned[k] = planner.plan_structure(Structure("local/carried", groups), schedule)
            return planned[k]

        def on_cluster(groups: DeviceMapping) -> DeviceMapping | None:
            if all(d.id in cluster.by_id for g in groups for d in g):
                return tuple(tuple(cluster.by_id[d.id] for d in g) for g in groups)
            return None

        ranked = sorted((c for c in found if c.plan.schedule == schedule),
                        key=lambda c: c.iteration_s)
        starts: dict[tuple[tuple[str, ...], ...], DeviceMapping] = {}
        for cand in ranked:
            groups = _mapping_of(cand.plan, cluster)
            starts.setdefault(mapping_key(groups), groups)
        best = ranked[0] if ranked else None
        walks = self._walks.setdefault(schedule, [])
        for walk in walks:  # the same devices (the key holds their ids), today's figures
            walk.current = tuple(tuple(cluster.by_id[d.id] for d in g) for g in walk.current)
        if not walks:
            carried = self._best.get(schedule)
            carried = None if carried is None else on_cluster(carried)
            first = None if carried is None else plan(carried)
            if first is not None and (best is None or first.iteration_s < best.iteration_s):
                best = first
            if best is None:
                return None
            groups = _mapping_of(best.plan, cluster)
            walks.append(_Walk(groups, origin=mapping_key(groups)))
        for standing in walks:  # where each walk stands on this cluster
            here = plan(standing.current)
            if here is not None and (best is None or here.iteration_s < best.iteration_s):
                best = here
        while spent[0] < self.budget:
            active = next((w for w in walks if not w.done), None)
            if active is None:
                if len(walks) >= LOCAL_SEARCH_STARTS:
                    break
                origins = {w.origin for w in walks}
                fresh = next((k for k in starts if k not in origins), None)
                if fresh is None:
                    break
                active = _Walk(starts[fresh], origin=fresh)
                walks.append(active)
            walk = active
            start = plan(walk.current)
            if start is None:
                walk.done = True
                continue
            allowed = self.budget - spent[0]
            calls = [0]

            def counted(groups: DeviceMapping, calls: list[int] = calls) -> Candidate | None:
                calls[0] += 1
                return plan(groups)

            steps = descend(start, list(cluster.devices), counted, allowed, walk.tried)
            if steps:
                walk.current = _mapping_of(steps[-1].plan, cluster)
                if best is None or steps[-1].iteration_s < best.iteration_s:
                    best = steps[-1]
            if calls[0] < allowed:
                walk.done = True  # a local optimum with budget to spare
        self.planned += spent[0]
        if best is not None:
            self._best[schedule] = _mapping_of(best.plan, cluster)
        return best
