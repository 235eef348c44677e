"""Tentative search over group structures: the hetpilot planner.


For each structure (:mod:`.structures`) and built-in schedule the planner
(:class:`~.structure_planner.Planner`) cuts every group, assigns microbatches
across groups and scores the whole plan. Each structure is also tried on device
subsets without the slowest devices (stragglers that would only slow the
whole); on small clusters every subset is tried. On clusters of 5 to 16 devices
the best mappings are improved one move at a time (:mod:`.localsearch`;
:func:`make_plan` only, see :func:`candidate_plans`). Baseline plans are
candidates too, so the planner is never worse than the baselines under the
reference model. Finally, where the job allows "custom", eager-1f1b orders
(more warm-up forwards where memory allows) are tried on the best plan.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import replace

from . import memos
from .baselines import BASELINES
from .candidates import Candidate
from .errors import InfeasibleError
from .localsearch import (
    LOCAL_SEARCH_BUDGET,
    LOCAL_SEARCH_DEVICES,
    LOCAL_SEARCH_STARTS,
    DeviceMapping,
    descend,
)
from .structure_planner import Planner, model_token
from .structures import (
    BIG_CLUSTER,
    EVERY_MAPPING_DEVICES,
    Structure,
    searched_schedules,
    structures,
)
from .types import Cluster, Device, Job, Model, Plan

__all__ = ["candidate_plans", "make_plan", "structure_pairs"]

_EXHAUSTIVE_DEVICES = 6
"""On clusters of up to this many devices every device subset is tried."""


def _subsets(devices: Sequence[Device]) -> list[tuple[str, list[Device]]]:
    """Device subsets to try: all of them on small clusters, else without stragglers."""
    n = len(devices)
    if n <= _EXHAUSTIVE_DEVICES:
        out = []
        for k in range(n, 0, -1):
            for combo in itertools.combinations(devices, k):
                out.append((f"subset{k}", list(combo)))
        return out
    out = [("all", list(devices))]
    if n > BIG_CLUSTER:  # big clusters: without stragglers, then drop whole speed tiers, slowest first
        slow = _stragglers(devices)
        kept = [d for d in devices if d.id not in slow]
        if slow:
            out.append((f"drop{len(slow)}slow", kept))
        tiers = sorted({d.tflops for d in kept})
        for t in tiers[:-1]:
            out.append((f"above{t:g}", [d for d in kept if d.tflops > t]))
        return out
    slow_first = sorted(devices, key=lambda d: (d.tflops, d.id))
    k = 1
    while k < n:
        dropped = {d.id for d in slow_first[:k]}
        out.append((f"drop{k}", [d for d in devices if d.id not in dropped]))
        k *= 2
    return out


def _stragglers(devices: Sequence[Device]) -> set[str]:
    """Devices at less than half the median speed of their host (a co-located job,
    throttling): on a big cluster they are dropped as one subset rather than each
    slowed speed becoming a tier of its own."""
    by_host: dict[str, list[float]] = {}
    for d in devices:
        by_host.setdefault(d.host, []).append(d.tflops)
    median = {h: _median(v) for h, v in by_host.items()}
    return {d.id for d in devices if d.tflops < 0.5 * median[d.host]}


def _median(values: list[float]) -> float:
    """statistics.median's value (the middle one, or the mean of the two middle ones
    as (a + b) / 2), without importing statistics at start-up (it imports fractions
    and decimal)."""
    data = sorted(values)
    n = len(data)
    if n % 2:
        return data[n // 2]
    return (data[n // 2 - 1] + data[n // 2]) / 2


_FOUND: OrderedDict[tuple[object, ...], tuple[Candidate, ...]] = OrderedDict()
_FOUND_LOCK = threading.Lock()
_FOUND_SIZE = 64


def _forget_found() -> None:
    with _FOUND_LOCK:
        _FOUND.clear()


memos.register(_forget_found)


def candidate_plans(cluster: Cluster, model: Model, job: Job, *,
                    focus: int | None = None,
                    pairs: Collection[tuple[str, str]] | None = None,
                    local_search: bool = False, top: int | None = None) -> list[Candidate]:
    """The best plan of every structure and device subset tried, each scored.

    Memoised on everything the search reads (the cluster, the model, the batch,
    microbatch size and schedules, ``focus``, ``pairs``; not budgets or V, which
    only the controller weighs): a controller stepping every slot on a cluster
    that did not change gets the same candidates back at once.

    Every candidate is valid under the reference model. The list is what the
    Lyapunov controller chooses from; :func:`make_plan` takes the fastest.

    ``focus=k`` (used by :func:`make_plan` on clusters of more than 64 devices,
    where only the fastest plan matters): rank every (structure, schedule)
    pair on all devices, then try the device subsets only for the k best
    pairs. The controller uses it too on big clusters: every structure is
    still tried on all devices, and its cost-aware subsets supply the
    cheaper candidates.

    ``pairs`` (the controller's cost-aware subsets of a big cluster): only
    these (structure, schedule) pairs, on all devices of ``cluster``; no
    device subsets and no baselines. :func:`structure_pairs` reads them off
    candidates.

    ``local_search`` (:func:`make_plan`, so ``hetpilot plan``): on clusters of 5 to
    16 devices, also the best mappings improved by :mod:`.localsearch`. It costs
    up to 300 plannings per schedule (1-3 s on 16 devices), so the controller,
    which plans every job every slot in one process, leaves it off (with it, 8 jobs
    on 16 devices fell behind 5 s slots, ``bench/daemon_jobs.py``) and carries a
    budgeted one from slot to slot instead (:class:`~.carried_descent.CarriedDescent`).

    ``top=k`` (a caller that looks only at the k fastest candidates: the TP search's
    quick plans, k = 1; :func:`make_plan`, which re-scores its 3 first, k = 3):
    structures whose plan is provably slower than k candidates already found (by
    more than a relative 1e-8, so not tied with them to 10 digits) are not scored
    (:meth:`~.structure_planner.Planner.plan_structure`'s ``beat``), so the list
    holds fewer of the slower plans; its k fastest plans, and which (structure,
    schedule) pairs ``focus`` keeps, are the same as without. Off where the local
    search runs (it starts from more of the fastest plans).
    """
    key = (cluster, model_token(model), job.global_batch, job.microbatch_size,
           tuple(job.schedules), focus, None if pairs is None else tuple(sorted(pairs)),
           local_search, top)
    with _FOUND_LOCK:
        hit = _FOUND.get(key)
        if hit is not None:
            _FOUND.move_to_end(key)
            return list(hit)
    found = _search(cluster, model, job, focus=focus, pairs=pairs, local_search=local_search,
                    top=top)
    with _FOUND_LOCK:
        _FOUND[key] = tuple(found)
        while len(_FOUND) > _FOUND_SIZE:
            _FOUND.popitem(last=False)
    return found


def _search(cluster: Cluster, model: Model, job: Job, *, focus: int | None,
            pairs: Collection[tuple[str, str]] | None, local_search: bool,
            top: int | None = None) -> list[Candidate]:
    planner = Planner(cluster, model, job)
    if local_search and EVERY_MAPPING_DEVICES < len(cluster.devices) <= LOCAL_SEARCH_DEVICES:
        top = None
    times: list[float] = []  # with ``top``: the times found so far, fastest first
    beat: float | None = None  # ... and a bound past which a plan is slower than top of them

    def seen(cand: Candidate) -> float | None:
        if top is None:
            return None
        bisect.insort(times, cand.iteration_s)
        return times[top - 1] * (1.0 + 1e-8) if len(times) >= top else None

    schedules = searched_schedules(job)
    found: list[Candidate] = []
    subsets = _subsets(list(cluster.devices))
    keep: set[tuple[str, str]] | None = None
    if pairs is not None:
        keep = set(pairs)
        subsets = subsets[:1]
    elif focus is not None and len(cluster.devices) > BIG_CLUSTER:
        label, subset = subsets[0]
        ranked = []
        for structure in structures(cluster, subset, planner.arr, planner.micro):
            for schedule in schedules:
                cand = planner.plan_structure(
                    Structure(f"{label}/{structure.label}", structure.groups), schedule, beat)
                if cand is not None:
                    found.append(cand)
                    ranked.append((cand.iteration_s, structure.label, schedule))
                    beat = seen(cand)
        keep = {(name, schedule) for _, name, schedule in sorted(ranked)[:focus]}
        subsets = subsets[1:]
    every_mapping = len(cluster.devices) <= EVERY_MAPPING_DEVICES
    for label, subset in subsets:
        for structure in structures(cluster, subset, planner.arr, planner.micro,
                                    every_mapping):
            for schedule in schedules:
                if keep is not None and (structure.label, schedule) not in keep:
                    continue
                cand = planner.plan_structure(
                    Structure(f"{label}/{structure.label}", structure.groups), schedule, beat
                )
                if cand is not None:
                    found.append(cand)
                    beat = seen(cand)
    if (local_search and pairs is None and found
            and EVERY_MAPPING_DEVICES < len(cluster.devices) <= LOCAL_SEARCH_DEVICES):
        found.extend(_local_search(planner, found, schedules))
    for name, baseline in BASELINES.items() if pairs is None else ():
        try:
            plan = baseline(cluster, model, job)
        except InfeasibleError:
            continue
        cand = planner.score(plan, f"baseline/{name}")
        if cand is not None:
            found.append(cand)
    if found and "custom" in job.schedules:
        best = min(found, key=lambda c: c.iteration_s)
        found.extend(planner.eager_variants(best))
    return found


def _local_search(planner: Planner, found: Sequence[Candidate],
                  schedules: Sequence[str]) -> list[Candidate]:
    """Improvements on the :data:`~.localsearch.LOCAL_SEARCH_STARTS` fastest distinct mappings of each
    schedule (:func:`.localsearch.descend`), fastest first, while the schedule's budget
    of :data:`~.localsearch.LOCAL_SEARCH_BUDGET` plannings lasts; labelled ``local/<start>+<n>``."""
    out: list[Candidate] = []
    devices = list(planner.cluster.devices)
    for schedule in schedules:
        starts: dict[tuple[tuple[str, ...], ...], Candidate] = {}
        for cand in sorted((c for c in found if c.plan.schedule == schedule),
                           key=lambda c: c.iteration_s):
            starts.setdefault(tuple(g.devices for g in cand.plan.groups), cand)
            if len(starts) == LOCAL_SEARCH_STARTS:
                break
        spent = [0]
        for start in starts.values():
            label = start.label.partition("/")[2] or start.label

            def plan(groups: DeviceMapping, label: str = label, schedule: str = schedule,
                     spent: list[int] = spent) -> Candidate | None:
                spent[0] += 1
                return planner.plan_structure(Structure(f"local/{label}", groups), schedule)

            if spent[0] >= LOCAL_SEARCH_BUDGET:
                break
            steps = descend(start, devices, plan, LOCAL_SEARCH_BUDGET - spent[0])
            out.extend(replace(c, label=f"{c.label}+{i + 1}") for i, c in enumerate(steps))
    return out


def structure_pairs(found: Sequence[Candidate], k: int) -> list[tuple[str, str]]:
    """The (structure, schedule) pairs of the k fastest planner candidates (labels
    ``subset/structure[+eagerN]``; baselines are skipped; an eager variant counts as
    its 1f1b structure)."""
    out: list[tuple[str, str]] = []
    for cand in sorted(found, key=lambda c: c.iteration_s):
        subset, _, rest = cand.label.partition("/")
        if not rest or subset in ("baseline", "local"):
            continue
        structure, eager, _ = rest.partition("+eager")
        pair = (structure, "1f1b" if eager else cand.plan.schedule)
        if pair not in out:
            out.append(pair)
        if len(out) == k:
            break
    return out


def make_plan(cluster: Cluster, model: Model, job: Job, *, policy: str = "hetpilot") -> Plan:
    """The plan of ``policy``: hetpilot's fastest, or a baseline's."""
    if policy != "hetpilot":
        if policy not in BASELINES:
            raise ValueError(f"unknown policy {policy!r}")
        plan = BASELINES[policy](cluster, model, job)
        planner = Planner(cluster, model, job)
        scored = planner.score(plan, policy)
        scored = None if scored is None else planner.exact(scored)
        if scored is None:
            raise InfeasibleError(f"{policy}: its plan does not fit in memory")
        return scored.plan
    found = candidate_plans(cluster, model, job, focus=3, local_search=True, top=3)
    if not found:
        raise InfeasibleError(
            "no plan fits in memory: no device or pipeline of devices can hold the model "
            f"with microbatch size {job.microbatch_size}, even with recompute"
        )
    planner = Planner(cluster, model, job)
    ranked = sorted(found, key=_preference)
    exact = [e for e in (planner.exact(c) for c in ranked[:3]) if e is not None]
    if not exact:  # pragma: no cover - candidates are valid by construction
        raise InfeasibleError("no candidate plan passed the reference model")
    return min(exact, key=_preference).plan


_SCHEDULE_RANK = {"1f1b": 0, "gpipe": 1, "custom": 2}


def _preference(cand: Candidate) -> tuple[float, int, int]:
    """Fastest first; on a tie (to 10 digits) fewer devices, then the simpler schedule
    (1f1b keeps fewer microbatches in flight than gpipe; built-ins before custom)."""
    return (float(f"{cand.iteration_s:.10g}"), len(cand.plan.devices),
            _SCHEDULE_RANK[cand.plan.schedule])
