"""Planning one structure: cut each group, assign microbatches, score the plan.

:class:`Planner` turns a :class:`~.structures.Structure` and a schedule into a
scored :class:`~.candidates.Candidate`: each group is cut (:mod:`.partition`),
microbatches are assigned across groups (:mod:`.assign`), and the whole plan is
scored with the reference model (:mod:`.refmodel`), gradient synchronisation
included.

Where every group of a structure has the same devices, links and memory
(identical pipelines) and at most four stages, the groups share one cut chosen
with the gradient sync in view (:meth:`Planner.joint_cut`): every cut is ranked
by its pipeline time plus the all-reduce its stages imply, since moving a cut
moves parameters between stages whose replicas may sit on links of very
different speed.

Cuts and makespans are memoised process-wide (:mod:`.memos`) on every number
they depend on, so a controller re-planning each slot on a cluster where a few
devices changed re-cuts only the groups whose signature changed.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import weakref
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from . import memos
from .assign import assign_microbatches
from .candidates import Candidate, plan_costs
from .errors import InvalidPlanError
from .makespans import fast_makespan
from .partition import (
    EXHAUSTIVE_STAGES,
    GroupCut,
    ModelArrays,
    cut_fits,
    evaluate_cut,
    exhaustive_cuts,
    partition_group,
    stage_params_mb,
)
from .refmodel import (
    evaluate,
    group_makespan,
    group_op_times,
    memory_needs,
    stage_memory_mb,
    validate_plan,
)
from .schedules import Op, format_order, warmup_order
from .signatures import GroupSignatures
from .structures import BIG_CLUSTER, Structure
from .types import Cluster, Device, Group, Job, Model, Plan, Stage

__all__ = ["Planner", "model_arrays", "model_token"]

_THOROUGH_CLUSTER = 16
"""Up to this many devices every cut of a group of <= 4 stages is tried at any M."""
_JOINT_TOP = 8
"""Cuts simulated exactly for a shared cut (the proxy plus the exact sync ranks all)."""


@lru_cache(maxsize=16)
def model_arrays(model: Model) -> ModelArrays:
    """The model's prefix sums, shared (with them each model's memos of stage costs and DP cuts)."""
    return ModelArrays(model)


memos.register(model_arrays.cache_clear)

_MODEL_TOKENS: weakref.WeakKeyDictionary[Model, int] = weakref.WeakKeyDictionary()
_NEXT_TOKEN = itertools.count()
_MODEL_TOKENS_LOCK = threading.Lock()


def model_token(model: Model) -> int:
    """A small int per distinct model: hashing the model itself in every memo key is slow.

    Equal models alive at once share a token; a token is never given twice, and a
    model no longer referenced anywhere leaves the table (a daemon's planning process
    sees a new model every time measurements change it: a plain dict held them all).
    Under a lock: two threads planning two new models at once must not share one."""
    found = _MODEL_TOKENS.get(model)
    if found is None:
        with _MODEL_TOKENS_LOCK:
            found = _MODEL_TOKENS.get(model)
            if found is None:
                found = _MODEL_TOKENS[model] = next(_NEXT_TOKEN)
    return found


_CUTS: memos.BoundedMemo[tuple[object, ...], GroupCut | None] = memos.BoundedMemo(20_000)
_EVALS: memos.BoundedMemo[tuple[object, ...], GroupCut | None] = memos.BoundedMemo(100_000)
_STAGES: dict[tuple[object, ...], tuple[Stage, ...]] = {}
"""Stages of a group (device ids) under a cut (bounds, recompute): immutable, shared."""
memos.register(_STAGES.clear)


class Planner:
    """Plans one (cluster, model, job); cuts are memoised by group signature
    (:mod:`.signatures`). One thread at a time (each search makes its own)."""

    def __init__(self, cluster: Cluster, model: Model, job: Job) -> None:
        self.cluster = cluster
        self.model = model
        self.job = job
        self.arr = model_arrays(model)
        self.micro = job.microbatch_size
        self.total = job.microbatches
        self._key = (model_token(model), self.micro)
        self._big = len(cluster.devices) > BIG_CLUSTER  # rank cuts by the proxy only
        self._thorough = len(cluster.devices) <= _THOROUGH_CLUSTER  # every cut of <= 4 stages
        self.sigs = GroupSignatures(cluster, kinds=model.kind_scaled)

    def links(self, devs: Sequence[Device]) -> tuple[tuple[float, float], ...]:
        return self.sigs.links(devs)

    def _signature(self, devs: Sequence[Device]) -> tuple[object, ...]:
        """What a group's cut and makespan depend on: speeds, memory, links in order."""
        return self.sigs.of(devs)[0]

    def _signature_id(self, devs: Sequence[Device]) -> tuple[tuple[object, ...], int]:
        return self.sigs.of(devs)

    def cut(self, devs: Sequence[Device], microbatches: int, schedule: str) -> GroupCut | None:
        sig = self._signature(devs)
        return _CUTS.get(
            (self._key, sig, microbatches, schedule, self._big, self._thorough),
            lambda: partition_group(self.arr, devs, sig[1], self.micro,  # type: ignore[arg-type]
                                    microbatches, schedule, always_proxy=self._big,
                                    thorough=self._thorough),
        )

    def at(self, devs: Sequence[Device], bounds: tuple[int, ...], microbatches: int,
           schedule: str) -> GroupCut | None:
        sig = self._signature(devs)
        return _EVALS.get(
            (self._key, sig, bounds, microbatches, schedule),
            lambda: evaluate_cut(self.arr, devs, sig[1], bounds, self.micro,  # type: ignore[arg-type]
                                 microbatches, schedule,
                                 memo=self.arr.times_memo(devs, sig[1], self.micro)),  # type: ignore[arg-type]
        )

    def _cap(self, devs: Sequence[Device], bounds: tuple[int, ...], schedule: str) -> int:
        """Most microbatches the cut holds in memory. gpipe keeps all in flight; 1f1b at
        most S - s on stage s, so a cut that holds S (or all, if fewer) holds any count,
        and one that does not caps the group below S (it was taken as uncapped, and a
        group given more than it holds made its whole structure fail)."""
        sig = self._signature(devs)
        lo, hi = 0, self.total
        if schedule != "gpipe":
            hi = min(self.total, len(bounds) - 1)
            if cut_fits(self.arr, devs, sig[1], bounds, self.micro, hi, schedule):  # type: ignore[arg-type]
                return self.total
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cut_fits(self.arr, devs, sig[1], bounds, self.micro, mid, schedule):  # type: ignore[arg-type]
                lo = mid
            else:
                hi = mid - 1
        return lo

    def plan_structure(self, structure: Structure, schedule: str,
                       beat: float | None = None) -> Candidate | None:
        """The structure's plan under ``schedule``, scored (None: nothing fits).

        ``beat`` (a search that wants only its fastest plan): a plan none of whose
        candidates can be faster than ``beat`` is not scored and None is returned. A
        plan's time is its largest group makespan plus a sync of at least 0, so one
        whose largest makespan exceeds ``beat`` is slower; the others are scored as
        without it."""
        total = self.total
        groups = [g for g in structure.groups if g]
        sids = self.sigs.numbers(structure.groups)
        speeds = self.sigs.speeds
        speed = [speeds[sid] for sid in sids]
        whole = sum(speed)
        cuts: list[tuple[tuple[Device, ...], GroupCut]] = []
        made: dict[tuple[int, int], GroupCut | None] = {}  # equal signatures, equal cuts
        for g, sp, sid in zip(groups, speed, sids, strict=True):
            guess = max(1, min(total, round(total * sp / whole)))
            key = (sid, guess)
            if key in made:
                c = made[key]
            else:
                c = made[key] = self.cut(g, guess, schedule) or self.cut(g, 1, schedule)
            if c is not None:
                cuts.append((g, c))
        if not cuts:
            return None
        if len(cuts) > total:  # more groups than microbatches: keep the fastest
            cuts.sort(key=lambda gc: gc[1].makespan)
            cuts = cuts[:total]
        counts: list[int] | None = None
        for _ in range(2):
            counts = self._assign(cuts, schedule)
            if counts is None:
                return None
            if self._big:  # keep the cuts made for each group's proportional share
                break
            changed = False
            for i, ((g, c), m) in enumerate(zip(cuts, counts, strict=True)):
                fresh = self.cut(g, m, schedule)
                kept = self.at(g, c.bounds, m, schedule)
                if fresh is not None and (kept is None or fresh.makespan < kept.makespan):
                    changed = changed or fresh.bounds != c.bounds
                    cuts[i] = (g, fresh)
            if not changed:
                break
        assert counts is not None
        found = self._candidate(structure.label, cuts, counts, schedule, beat)
        for other in (self._shared_cut(structure, groups, schedule, beat),
                      self._aligned(structure.label, cuts, schedule, beat)):
            if other is not None and (found is None or other.iteration_s < found.iteration_s):
                found = other
        return found

    def _aligned(self, label: str, cuts: list[tuple[tuple[Device, ...], GroupCut]],
                 schedule: str, beat: float | None = None) -> Candidate | None:
        """Groups of as many stages, different devices, all cut where one of them was
        (each group's cut in turn), microbatches assigned again. Cut apart, the stages
        of different groups hold different layers and spec 5.3 syncs one bucket per
        run of layers that every group keeps together, so one group's cut can split the
        sync of all (a randomized comparison with brute force found such plans 1.16-1.79x
        slower; bench/RESULTS-planner.md). Identical groups get :meth:`joint_cut`."""
        if self._big or len(cuts) < 2:
            return None
        n = len(cuts[0][1].bounds)
        options = sorted({c.bounds for _, c in cuts})
        if n < 3 or len(options) < 2 or any(len(c.bounds) != n for _, c in cuts):
            return None
        best: Candidate | None = None
        for bounds in options:
            moved = []
            for g, _ in cuts:
                c = self.at(g, bounds, 1, schedule)
                if c is None:
                    break
                moved.append((g, c))
            else:
                counts = self._assign(moved, schedule)
                cand = (None if counts is None else
                        self._candidate(f"{label}+aligned", moved, counts, schedule, beat))
                if cand is not None and (best is None or cand.iteration_s < best.iteration_s):
                    best = cand
        return best

    def _shared_cut(self, structure: Structure, groups: Sequence[tuple[Device, ...]],
                    schedule: str, beat: float | None = None) -> Candidate | None:
        """Identical groups with one cut chosen with the sync in view (:meth:`joint_cut`),
        microbatches split evenly (the groups are equally fast)."""
        k = len(groups)
        if k < 2 or k > self.total:
            return None
        counts = [self.total // k + (1 if i < self.total % k else 0) for i in range(k)]
        cut = self.joint_cut(groups, counts[0], schedule)
        if cut is None:
            return None
        return self._candidate(f"{structure.label}+sync", [(g, cut) for g in groups], counts,
                               schedule, beat)

    def joint_cut(self, groups: Sequence[tuple[Device, ...]], microbatches: int,
                  schedule: str) -> GroupCut | None:
        """One cut for K identical groups of at most four stages: the cut minimising the
        group's makespan plus spec 5.3's sync, over every cut (None when the groups
        differ, have one or more than four stages, or the cluster is big).

        With one cut for all groups, each stage is one bucket whose ring runs over the
        copies of that stage (group order, wrapping around), and every device holds one
        stage, so ``T_sync = max_s AR_s``: ``2 (K-1)/K * param_mb(stage s) * 8 /
        (1000 * min ring gbps) + 2 (K-1) * max ring latency``. All cuts are ranked by
        the proxy makespan plus that term (:func:`~.partition.exhaustive_cuts`), the best few
        simulated exactly."""
        k = len(groups)
        first = groups[0]
        n = len(first)
        if self._big or k < 2 or not 2 <= n <= EXHAUSTIVE_STAGES:
            return None
        sig = self._signature(first)
        if any(len(g) != n or self._signature(g) != sig for g in groups[1:]):
            return None
        link = self.cluster.link
        ring = []
        for j in range(n):
            gbps, lat = math.inf, 0.0
            for g in range(k):
                here, there = link(groups[g][j].id, groups[(g + 1) % k][j].id)
                gbps, lat = min(gbps, here), max(lat, there)
            ring.append((gbps, lat))
        factor, hops = 2.0 * (k - 1) / k, 2.0 * (k - 1)
        ring_gbps = np.asarray([r[0] for r in ring])
        ring_lat = np.asarray([r[1] for r in ring])

        def sync(bounds: np.ndarray) -> np.ndarray:
            params = stage_params_mb(self.arr, bounds)
            out: np.ndarray = (factor * params * 8.0 / (1000.0 * ring_gbps)
                               + hops * ring_lat).max(axis=1)
            return out

        def make() -> GroupCut | None:
            ranked = exhaustive_cuts(self.arr, first, sig[1], self.micro,  # type: ignore[arg-type]
                                     microbatches, schedule, extra=sync, top=_JOINT_TOP)
            best, best_t = None, math.inf
            for bounds in ranked or ():
                cut = self.at(first, bounds, microbatches, schedule)
                if cut is None:
                    continue
                total = cut.makespan + float(sync(np.asarray([bounds]))[0])
                if total < best_t:
                    best, best_t = cut, total
            return best

        return _CUTS.get((self._key, sig, tuple(ring), k, microbatches, schedule, "joint"),
                         make)

    def _assign(self, cuts: list[tuple[tuple[Device, ...], GroupCut]],
                schedule: str) -> list[int] | None:
        total = self.total
        classes: list[int] = []
        reps: list[int] = []
        class_ids: dict[tuple[int, tuple[int, ...]], int] = {}
        for i, (g, c) in enumerate(cuts):
            key = (self._signature_id(g)[1], c.bounds)
            if key not in class_ids:
                class_ids[key] = len(reps)
                reps.append(i)
            classes.append(class_ids[key])
        memo: dict[tuple[int, int], float] = {}

        def makespan(i: int, m: int) -> float:
            if m < 1:
                return 0.0
            key = (classes[i], m)
            if key not in memo:
                g, c = cuts[reps[classes[i]]]
                found = self.at(g, c.bounds, m, schedule)
                memo[key] = math.inf if found is None else found.makespan
            return memo[key]

        fill, cycle, caps = [], [], []
        share = max(1, total // len(cuts))
        for rep in reps:
            i = rep
            g, cut = cuts[i]
            m1 = min(total, share)
            m2 = m1 + max(2, len(g))
            p1, p2 = makespan(i, m1), makespan(i, m2)
            if not math.isfinite(p2):
                p1, m1, p2, m2 = makespan(i, 1), 1, makespan(i, 2), 2
            slope = (p2 - p1) / (m2 - m1) if math.isfinite(p2) else p1
            cycle.append(max(slope, 1e-12))
            fill.append(max(p1 - slope * m1, 0.0))
            caps.append(self._cap(g, cut.bounds, schedule))
        expand = [classes[i] for i in range(len(cuts))]
        return assign_microbatches(
            makespan,
            [fill[c] for c in expand],
            [cycle[c] for c in expand],
            [caps[c] for c in expand],
            total,
            classes,
        )

    def _candidate(self, label: str, cuts: list[tuple[tuple[Device, ...], GroupCut]],
                   counts: list[int], schedule: str,
                   beat: float | None = None) -> Candidate | None:
        made: list[GroupCut] = []
        evaluated: dict[tuple[int, tuple[int, ...], int], GroupCut | None] = {}
        for (g, cut), m in zip(cuts, counts, strict=True):
            key = (self._signature_id(g)[1], cut.bounds, m)
            if key in evaluated:
                c = evaluated[key]
            else:
                c = evaluated[key] = self.at(g, cut.bounds, m, schedule)
            if c is None:
                return None
            made.append(c)
        if beat is not None and max(c.makespan for c in made) > beat:
            return None  # slower than ``beat`` whatever its sync (plan_structure)
        groups = []
        makespans = []
        for (g, _), m, c in zip(cuts, counts, made, strict=True):
            stage_key = (tuple(d.id for d in g), c.bounds, c.recompute)
            stages = _STAGES.get(stage_key)
            if stages is None:  # the same group and cut recur across structures, subsets, slots
                if len(_STAGES) >= 8192:
                    _STAGES.clear()
                stages = _STAGES[stage_key] = tuple(
                    Stage(device=d.id, layers=(c.bounds[j], c.bounds[j + 1]),
                          recompute=c.recompute[j])
                    for j, d in enumerate(g)
                )
            groups.append(Group(samples=m * self.micro, stages=stages))
            makespans.append(c.makespan)
        plan = Plan(microbatch_size=self.micro, schedule=schedule, groups=tuple(groups))
        return self.score(plan, label, makespans,
                          valid=_passes(self, cuts, counts, made, schedule))

    def score(self, plan: Plan, label: str,
              makespans: Sequence[float] | None = None, *, valid: bool = False) -> Candidate | None:
        """Check validity and score: group makespans (given or simulated) plus sync.

        Built-in schedules use :func:`~.makespans.fast_makespan`, exact up to a few times S
        microbatches per group and extrapolated from the periodic regime beyond;
        :func:`~.search.make_plan` re-scores its pick with the exact reference model.
        ``valid`` (with ``makespans``): the caller has checked what
        :func:`~.refmodel.validate_plan` would (:meth:`_passes`).
        """
        try:
            all_orders: list[list[tuple[Op, ...]] | None]
            if valid and makespans is not None:
                all_orders = [None] * len(plan.groups)
            else:
                all_orders = validate_plan(self.cluster, self.model, plan, self.job.global_batch)
            if makespans is None:
                makespans = []
                for g, orders in zip(plan.groups, all_orders, strict=True):
                    times = group_op_times(self.cluster, self.model, g, self.micro)
                    m = g.samples // self.micro
                    if orders is not None:
                        makespans.append(group_makespan(times, "custom", m, orders))
                    else:
                        makespans.append(fast_makespan(times, plan.schedule, m))
        except InvalidPlanError:
            return None
        iteration = max(makespans) + self.sync_time(plan.groups)
        plan = Plan(microbatch_size=plan.microbatch_size, schedule=plan.schedule,
                    groups=plan.groups, predicted_iteration_s=iteration)
        return Candidate(plan, iteration, plan_costs(self.cluster, plan), label)

    def sync_time(self, groups: Sequence[Group]) -> float:
        """:func:`~hetpilot.planner.refmodel.sync_time` of a *valid* plan's groups
        (:meth:`score` validates first): the same float, found with far fewer steps.

        In a valid plan every stage holds a distinct device and each group's
        stages cover the layers in order, so the reference's buckets (runs of
        layers with the same owner in every group) are the ranges between
        consecutive stage ends of any group; a bucket's ring is the slowest
        link and the largest latency between neighbouring groups' owners, and a
        device's sum is over its stage's buckets, which only the group's stage
        ends decide. So links are looked up once per run of buckets over which
        two neighbours keep their stages, and sums are formed once per pattern
        of stage ends, each with the reference's arithmetic in its order.
        """
        k = len(groups)
        if k <= 1:
            return 0.0
        ends = sorted({s.layers[1] for g in groups for s in g.stages})
        n_buckets = len(ends)
        patterns: dict[tuple[int, ...], int] = {}
        stage_of: list[list[int]] = []  # per pattern: the stage holding each bucket
        pattern_of: list[int] = []
        for g in groups:
            mine = tuple(s.layers[1] for s in g.stages)
            p = patterns.get(mine)
            if p is None:
                p = patterns[mine] = len(stage_of)
                stage_of.append([bisect.bisect_left(mine, e) for e in ends])
            pattern_of.append(p)
        runs: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        link = self.cluster.link
        whole_gbps, whole_lat = math.inf, 0.0  # neighbours that keep one stage pair throughout
        rows_gbps: list[list[float]] = []
        rows_lat: list[list[float]] = []
        for i in range(k):
            j = (i + 1) % k
            key = (pattern_of[i], pattern_of[j])
            found = runs.get(key)
            if found is None:
                found = runs[key] = _runs(stage_of[key[0]], stage_of[key[1]])
            a, b = groups[i].stages, groups[j].stages
            if len(found) == 1:
                _, si, sj = found[0]
                gbps, lat = link(a[si].device, b[sj].device)
                whole_gbps = min(whole_gbps, gbps)
                whole_lat = max(whole_lat, lat)
                continue
            row_gbps: list[float] = []
            row_lat: list[float] = []
            for length, si, sj in found:
                gbps, lat = link(a[si].device, b[sj].device)
                row_gbps.extend([gbps] * length)
                row_lat.extend([lat] * length)
            rows_gbps.append(row_gbps)
            rows_lat.append(row_lat)
        ring_gbps = [whole_gbps] * n_buckets
        ring_lat = [whole_lat] * n_buckets
        if rows_gbps:  # min and max pick one of the values: exact in any order
            ring_gbps = np.minimum(np.min(np.asarray(rows_gbps), axis=0), whole_gbps).tolist()
            ring_lat = np.maximum(np.max(np.asarray(rows_lat), axis=0), whole_lat).tolist()
        layers = self.model.layers
        factor = 2.0 * (k - 1) / k
        lat_hops = 2.0 * (k - 1)
        all_reduce = []
        start = 0
        for end, gbps, lat in zip(ends, ring_gbps, ring_lat, strict=True):
            size = 0.0
            for layer in range(start, end):
                size += layers[layer].param_mb
            all_reduce.append(factor * size * 8.0 / (1000.0 * gbps) + lat_hops * lat)
            start = end
        worst = 0.0
        for stages in stage_of:  # a device's sum: its stage's buckets, in order, from 0.0
            sums: dict[int, float] = {}
            for si, value in zip(stages, all_reduce, strict=True):
                sums[si] = sums.get(si, 0.0) + value
            worst = max(worst, *sums.values())
        return worst

    def exact(self, cand: Candidate) -> Candidate | None:
        """Re-score with the exact reference model (spec section 5)."""
        result = evaluate(self.cluster, self.model, cand.plan, self.job.global_batch)
        if not result.valid or result.iteration_s is None:
            return None
        plan = Plan(microbatch_size=cand.plan.microbatch_size, schedule=cand.plan.schedule,
                    groups=cand.plan.groups, predicted_iteration_s=result.iteration_s)
        return Candidate(plan, result.iteration_s, cand.costs, cand.label)

    def eager_variants(self, best: Candidate) -> list[Candidate]:
        """Custom orders with more warm-up forwards than 1f1b (memory permitting)."""
        plan = best.plan
        if plan.schedule != "1f1b" or all(len(g.stages) == 1 for g in plan.groups):
            return []
        out = []
        for extra in (1, 2, 4):
            groups = []
            for g in plan.groups:
                m = g.samples // self.micro
                n = len(g.stages)
                stages = tuple(
                    Stage(device=s.device, layers=s.layers, recompute=s.recompute,
                          order=format_order(warmup_order(n - j - 1 + extra, m)))
                    for j, s in enumerate(g.stages)
                )
                groups.append(Group(samples=g.samples, stages=stages))
            cand = self.score(Plan(microbatch_size=self.micro, schedule="custom",
                                   groups=tuple(groups)), f"{best.label}+eager{extra}")
            if cand is not None:
                out.append(cand)
        return out


def _passes(planner: Planner, cuts: list[tuple[tuple[Device, ...], GroupCut]], counts: list[int],
            made: list[GroupCut], schedule: str) -> bool:
    """Whether the plan :meth:`Planner._candidate` builds of these groups, counts and cuts
    passes :func:`~.refmodel.validate_plan` (True only where that is certain; False
    leaves the check to it). Such a plan has built-in schedule and one-device stages
    covering the layers in order; what remains is checked here: each device the
    cluster's own and used once, every group at least one microbatch, the global
    batch, and stage memory (spec 5.4) once per (signature, cut, count), the same
    need and device memory as validate_plan compares."""
    if schedule not in ("1f1b", "gpipe") or not counts or min(counts) < 1 \
            or sum(counts) * planner.micro != planner.job.global_batch:
        return False
    by_id = planner.cluster.by_id
    count = 0
    ids: set[str] = set()
    for g, _ in cuts:
        for d in g:
            if by_id.get(d.id) is not d:
                return False
            ids.add(d.id)
        count += len(g)
    if len(ids) != count:
        return False
    needs = memory_needs(planner.model, planner.micro)
    num_layers = planner.model.num_layers
    checked: set[tuple[object, ...]] = set()
    for (g, _), m, c in zip(cuts, counts, made, strict=True):
        key = (planner._signature_id(g)[1], c.bounds, c.recompute, m)
        if key in checked:
            continue
        checked.add(key)
        bounds = c.bounds
        n = len(g)
        if len(bounds) != n + 1 or bounds[0] != 0 or bounds[-1] != num_layers:
            return False
        for j, d in enumerate(g):
            a, b = bounds[j], bounds[j + 1]
            if b <= a:
                return False
            flight = m if schedule == "gpipe" else (n - j if n - j < m else m)
            need_key = (a, b, c.recompute[j], flight, 1)
            need = needs.get(need_key)
            if need is None:
                need = needs[need_key] = stage_memory_mb(
                    planner.model, Stage(device=d.id, layers=(a, b), recompute=c.recompute[j]),
                    planner.micro, flight)
            if need > 1000.0 * d.memory_gb:
                return False
    return True


def _runs(first: Sequence[int], second: Sequence[int]) -> list[tuple[int, int, int]]:
    """(length, stage, stage) of each run of buckets over which two groups keep their stages."""
    out: list[tuple[int, int, int]] = []
    length = 0
    pair = (first[0], second[0])
    for si, sj in zip(first, second, strict=True):
        if (si, sj) != pair:
            out.append((length, *pair))
            pair, length = (si, sj), 0
        length += 1
    out.append((length, *pair))
    return out
