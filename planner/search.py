"""Tentative search over group structures: the hetpilot planner.

A *structure* fixes which devices form data-parallel groups and the stage
order inside each group (device mapping). For each structure and schedule the
planner cuts every group (:mod:`.partition`), assigns microbatches across
groups (:mod:`.assign`) and scores the whole plan with the reference model
(:mod:`.refmodel`), gradient synchronisation included. Structures tried:

* ``dp``: every device its own replica;
* ``host``: one pipeline per host (fast intra-host links);
* ``chain``: one pipeline over all devices, hosts chained along fast links;
* ``split-host`` / ``host-pairs``: halves of hosts, pairs of linked hosts;
* ``chunk-s``: pipelines of s devices along the chain (s = 2, 4, 8);
* ``speed-class``: per-host pipelines of devices of similar speed;
* ``fit-dp``: replicas where the model fits, pipelines of the rest;
* ``stage-major-S`` / ``stage-major-speed-S``: K = n / S identical pipelines of
  S stages whose copies of stage s sit side by side (on one host, or in one
  speed class): the pipelines cross hosts, and each stage's gradient
  all-reduce runs among neighbours on fast links (PipeDream's and AMP's
  layouts for hierarchical networks);
* ``mixed-K-slow-first`` / ``mixed-K-fast-first`` (devices of speeds 1.5x or
  more apart): K pipelines of about equal total speed, slow devices beside fast
  ones (Metis' layouts for mixed GPU types);
* ``mapping-i``: on clusters of at most 4 devices, every split into groups with
  every stage order;
* ``local/...``: on clusters of 5 to 16 devices, the best mappings improved one
  move at a time (:mod:`.localsearch`; :func:`make_plan` only, see
  :func:`candidate_plans`).

Where every group of a structure has the same devices, links and memory
(identical pipelines) and at most four stages, the groups share one cut
chosen with the gradient sync in view (:meth:`Planner.joint_cut`): every cut
is ranked by its pipeline time plus the all-reduce its stages imply, since
moving a cut moves parameters between stages whose replicas may sit on links
of very different speed.

Each structure is also tried on device subsets without the slowest devices
(stragglers that would only slow the whole); on small clusters every subset
is tried. Baseline plans are candidates too, so the planner is never worse
than the baselines under the reference model. Finally, where the job allows
"custom", eager-1f1b orders (more warm-up forwards where memory allows) are
tried on the best plan.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from .candidates import Candidate, plan_costs
from .errors import InfeasibleError, InvalidPlanError
from .localsearch import DeviceMapping, descend, mapping_key
from .partition import (
    EXHAUSTIVE_STAGES,
    GroupCut,
    ModelArrays,
    cut_fits,
    evaluate_cut,
    exhaustive_cuts,
    fast_makespan,
    partition_group,
    stage_params_mb,
)
from .refmodel import evaluate, group_makespan, group_op_times, validate_plan
from .schedules import format_order, warmup_order
from .types import Cluster, Device, Group, Job, Model, Plan, Stage

__all__ = ["BIG_CLUSTER", "CarriedDescent", "Structure", "candidate_plans", "clear_memos", "make_plan", "structure_pairs", "structures"]

_EXHAUSTIVE_DEVICES = 6
_EVERY_MAPPING_DEVICES = 4
"""On clusters of up to this many devices every device mapping is a structure (on 5-6
devices, whose every subset is tried, it tripled the planning time)."""
_LOCAL_SEARCH_DEVICES = 16
"""On clusters of more than :data:`_EVERY_MAPPING_DEVICES` and up to this many devices the
best candidates are improved by local search over mappings (:mod:`.localsearch`)."""
_LOCAL_SEARCH_STARTS = 3
"""Candidates per schedule the local search starts from (the fastest distinct mappings)."""
_LOCAL_SEARCH_BUDGET = 300
"""Mappings planned per schedule, at most, over all starts (a 5-device neighbourhood is
about 70 mappings, a 16-device one about 500; a planning takes 1-5 ms)."""
BIG_CLUSTER = 64
"""Above this many devices the search narrows (see candidate_plans, Planner.cut)."""
_BUILTIN = ("1f1b", "gpipe")
_THOROUGH_CLUSTER = 16
"""Up to this many devices every cut of a group of <= 4 stages is tried at any M."""
_JOINT_TOP = 8
"""Cuts simulated exactly for a shared cut (the proxy plus the exact sync ranks all)."""


@dataclass(frozen=True)
class Structure:
    label: str
    groups: tuple[tuple[Device, ...], ...]


# -- structures -----------------------------------------------------------------

def _host_chain(cluster: Cluster, devices: Sequence[Device]) -> list[str]:
    """Hosts ordered greedily so that consecutive hosts share fast links."""
    hosts = list(dict.fromkeys(d.host for d in devices))
    if len(hosts) <= 2:
        return hosts
    rep: dict[str, str] = {}
    for d in devices:
        rep.setdefault(d.host, d.id)
    if len(hosts) > 64:  # uniform big clusters: keep the given order (O(n^2) otherwise)
        return hosts
    chain = [hosts[0]]
    left = set(hosts[1:])
    while left:
        last = rep[chain[-1]]
        nxt = max(sorted(left), key=lambda h: cluster.link(last, rep[h])[0])
        chain.append(nxt)
        left.remove(nxt)
    return chain


def _by_host(cluster: Cluster, devices: Sequence[Device]) -> dict[str, list[Device]]:
    out: dict[str, list[Device]] = {h: [] for h in _host_chain(cluster, devices)}
    for d in devices:
        out[d.host].append(d)
    for h in out:  # biggest memory first: stage 0 keeps the most microbatches in flight
        out[h].sort(key=lambda d: (-d.memory_gb, -d.tflops, d.id))
    return out


def _chunks(items: Sequence[Device], size: int) -> list[tuple[Device, ...]]:
    return [tuple(items[i:i + size]) for i in range(0, len(items), size)]


def _fits_alone(arr: ModelArrays, dev: Device, micro: int) -> bool:
    total = arr.num_layers
    params = arr.segment_sum(arr.param, 0, total) * (1 + arr.opt)
    rc = params + micro * arr.segment_sum(arr.inp, 0, total) + micro * arr.segment_sum(arr.act, 0, total)
    return rc <= 1000.0 * dev.memory_gb


def structures(cluster: Cluster, devices: Sequence[Device], arr: ModelArrays,
               micro: int, every_mapping: bool = False) -> list[Structure]:
    """Candidate device mappings for ``devices`` (a subset of the cluster); with
    ``every_mapping`` (clusters of at most :data:`_EVERY_MAPPING_DEVICES`), all of them."""
    max_stages = arr.num_layers
    by_host = _by_host(cluster, devices)
    chain = [d for h in by_host for d in by_host[h]]
    out: list[Structure] = []

    def add(label: str, groups: Iterable[Sequence[Device]]) -> None:
        split: list[tuple[Device, ...]] = []
        for g in groups:
            if g:
                split.extend(_chunks(list(g), max_stages))
        out.append(Structure(label, tuple(split)))

    add("dp", [[d] for d in chain])
    add("host", by_host.values())
    if len(chain) <= 16:  # deeper single pipelines come from chunks and host pairs
        add("chain", [chain])
    add("split-host", [half for g in by_host.values()
                       for half in (g[: (len(g) + 1) // 2], g[(len(g) + 1) // 2:])])
    hosts = list(by_host.values())
    add("host-pairs", [hosts[i] + (hosts[i + 1] if i + 1 < len(hosts) else [])
                       for i in range(0, len(hosts), 2)])
    big = len(chain) > BIG_CLUSTER  # big clusters: fewer, coarser structures
    for size in (2, 4) if big else (2, 4, 8, 16):
        if size < len(chain):
            add(f"chunk-{size}", _chunks(chain, size))
    tiers: dict[tuple[str, int], list[Device]] = {}
    for d in chain:
        tiers.setdefault((d.host, round(math.log(d.tflops, 1.5))), []).append(d)
    add("speed-class", tiers.values())
    fit = [d for d in chain if _fits_alone(arr, d, micro)]
    fit_ids = {d.id for d in fit}
    rest: dict[str, list[Device]] = {}
    for d in chain:
        if d.id not in fit_ids:
            rest.setdefault(d.host, []).append(d)
    add("fit-dp", [[d] for d in fit] + list(rest.values()))
    by_speed = sorted(chain, key=lambda d: -d.tflops)  # stable: host order within a speed
    for size in _stage_counts(len(chain), max_stages, big):
        add(f"stage-major-{size}", _stage_major(chain, size))
        add(f"stage-major-speed-{size}", _stage_major(by_speed, size))
    if by_speed[0].tflops >= 1.5 * by_speed[-1].tflops and not big:
        for k in _mixed_counts(by_speed):
            add(f"mixed-{k}-slow-first", _balanced(by_speed, k, slow_first=True))
            add(f"mixed-{k}-fast-first", _balanced(by_speed, k, slow_first=False))
    if every_mapping:
        for i, groups in enumerate(_ordered_partitions(chain)):
            add(f"mapping-{i}", groups)
    unique: dict[tuple[tuple[str, ...], ...], Structure] = {}
    for s in out:
        key = tuple(tuple(d.id for d in g) for g in s.groups)
        unique.setdefault(key, s)
    return list(unique.values())


def _stage_counts(n: int, max_stages: int, big: bool) -> list[int]:
    """Stage counts S of the stage-major structures: S divides n, K = n / S >= 2."""
    sizes = (2, 4) if big else (2, 3, 4, 6, 8) if n <= 32 else (2, 4, 8)
    return [s for s in sizes if s <= max_stages and n % s == 0 and n // s >= 2]


def _ordered_partitions(devices: Sequence[Device]) -> Iterator[list[tuple[Device, ...]]]:
    """Every split of ``devices`` into groups, with every stage order of each group (73
    for 4 devices): on a handful of devices the order that wins depends on memory, links
    and which layers are heavy together, which no rule above gets right every time (a
    randomized comparison with brute force on 3-4 devices found the best order neither
    fastest- nor slowest-first in half the gaps; bench/RESULTS-planner.md)."""
    if not devices:
        yield []
        return
    first, rest = devices[0], devices[1:]
    for part in _ordered_partitions(rest):
        yield [(first,), *part]
        for i, g in enumerate(part):
            for at in range(len(g) + 1):
                yield [*part[:i], (*g[:at], first, *g[at:]), *part[i + 1:]]


def _mixed_counts(by_speed: Sequence[Device]) -> list[int]:
    """Group counts K of the mixed structures: as many groups as fast devices (each slow
    device then joins a fast one), and 2 and 4, for K < n."""
    n = len(by_speed)
    fast = sum(1 for d in by_speed if d.tflops >= by_speed[0].tflops / 1.5)
    return sorted({k for k in (fast, 2, 4) if 2 <= k < n})


def _balanced(by_speed: Sequence[Device], k: int, slow_first: bool) -> list[tuple[Device, ...]]:
    """K pipelines of about equal total speed, each mixing fast and slow devices: the
    devices, fastest first, each to the group with the least speed so far. A slow device
    then takes a short stage beside a fast one instead of sitting idle or slowing a group of
    its own (Metis' GPT on A100 and T4: a T4 with the first 2 of 10 layers ahead of an
    A100). Each group runs slowest first or fastest first: stage 0 holds the most
    microbatches in flight, and the first layers (an embedding) are often the heavy ones."""
    groups: list[list[Device]] = [[] for _ in range(k)]
    speed = [0.0] * k
    for d in by_speed:
        i = min(range(k), key=lambda j: (speed[j], j))
        groups[i].append(d)
        speed[i] += d.tflops
    return [tuple(reversed(g)) if slow_first else tuple(g) for g in groups]


def _stage_major(devices: Sequence[Device], size: int) -> list[tuple[Device, ...]]:
    """K = n / size pipelines; stage s of every pipeline on devices s*K .. s*K + K - 1."""
    k = len(devices) // size
    return [tuple(devices[s * k + g] for s in range(size)) for g in range(k)]


# -- planning one structure -------------------------------------------------------

@lru_cache(maxsize=16)
def _model_arrays(model: Model) -> ModelArrays:
    return ModelArrays(model)


_MODEL_TOKENS: dict[Model, int] = {}


_MODEL_TOKENS_LOCK = threading.Lock()


def _model_token(model: Model) -> int:
    """A small int per distinct model: hashing the model itself in every memo key is slow.

    Under a lock: two threads planning two new models at once must not both get
    ``len(_MODEL_TOKENS)``, which would make one model's memo entries the other's."""
    found = _MODEL_TOKENS.get(model)
    if found is None:
        with _MODEL_TOKENS_LOCK:
            found = _MODEL_TOKENS.setdefault(model, len(_MODEL_TOKENS))
    return found


class _Memo:
    """A bounded memo shared by every Planner of the process.

    Keys hold every number a cut depends on (the model, the microbatch size,
    device speeds and memory, links, M, schedule), so entries stay valid across
    calls: a controller re-planning each slot on a cluster where a few devices
    changed re-cuts only the groups whose signature changed.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.data: OrderedDict[tuple[object, ...], GroupCut | None] = OrderedDict()

    def get(self, key: tuple[object, ...], make: Callable[[], GroupCut | None]) -> GroupCut | None:
        try:
            self.data.move_to_end(key)
            return self.data[key]
        except KeyError:
            value = self.data[key] = make()
            if len(self.data) > self.size:
                self.data.popitem(last=False)
            return value


_CUTS = _Memo(20_000)
_EVALS = _Memo(100_000)
_STAGES: dict[tuple[object, ...], tuple[Stage, ...]] = {}
"""Stages of a group (device ids) under a cut (bounds, recompute): immutable, shared."""


def clear_memos() -> None:
    """Forget every memoised cut, makespan and LP solution (benchmarks that time cold searches)."""
    from .assign import _SOLVED
    from .partition import _TRACES, _exact, _regime
    from .refmodel import _cached_makespan

    _model_arrays.cache_clear()  # with them each model's memos of stage costs and DP cuts
    with _FOUND_LOCK:
        _FOUND.clear()
    _CUTS.data.clear()
    _EVALS.data.clear()
    _STAGES.clear()
    _SOLVED.clear()
    _regime.cache_clear()
    _exact.cache_clear()
    _TRACES.clear()
    _cached_makespan.cache_clear()


class Planner:
    """Plans one (cluster, model, job); cuts are memoised by group signature."""

    def __init__(self, cluster: Cluster, model: Model, job: Job) -> None:
        self.cluster = cluster
        self.model = model
        self.job = job
        self.arr = _model_arrays(model)
        self.micro = job.microbatch_size
        self.total = job.microbatches
        self._key = (_model_token(model), self.micro)
        self._big = len(cluster.devices) > BIG_CLUSTER  # rank cuts by the proxy only
        self._thorough = len(cluster.devices) <= _THOROUGH_CLUSTER  # every cut of <= 4 stages
        self._signatures: dict[tuple[str, ...], tuple[object, ...]] = {}
        self._by_object: dict[int, tuple[Sequence[Device], tuple[object, ...]]] = {}

    def links(self, devs: Sequence[Device]) -> tuple[tuple[float, float], ...]:
        return tuple(self.cluster.link(devs[i].id, devs[i + 1].id) for i in range(len(devs) - 1))

    def _signature(self, devs: Sequence[Device]) -> tuple[object, ...]:
        """What a group's cut and makespan depend on: speeds, memory, links in order."""
        held = self._by_object.get(id(devs))
        if held is not None and held[0] is devs:  # the same group object: the common case
            return held[1]
        ids = tuple(d.id for d in devs)
        found = self._signatures.get(ids)
        if found is None:
            found = (tuple((d.tflops, d.memory_gb) for d in devs), self.links(devs))
            self._signatures[ids] = found
        self._by_object[id(devs)] = (devs, found)  # holding devs keeps its id unique
        return found

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
                                 microbatches, schedule),
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

    def plan_structure(self, structure: Structure, schedule: str) -> Candidate | None:
        total = self.total
        groups = [g for g in structure.groups if g]
        speed = [sum(d.tflops for d in g) for g in groups]
        whole = sum(speed)
        cuts: list[tuple[tuple[Device, ...], GroupCut]] = []
        for g, sp in zip(groups, speed, strict=True):
            guess = max(1, min(total, round(total * sp / whole)))
            c = self.cut(g, guess, schedule) or self.cut(g, 1, schedule)
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
        found = self._candidate(structure.label, cuts, counts, schedule)
        for other in (self._shared_cut(structure, groups, schedule),
                      self._aligned(structure.label, cuts, schedule)):
            if other is not None and (found is None or other.iteration_s < found.iteration_s):
                found = other
        return found

    def _aligned(self, label: str, cuts: list[tuple[tuple[Device, ...], GroupCut]],
                 schedule: str) -> Candidate | None:
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
                        self._candidate(f"{label}+aligned", moved, counts, schedule))
                if cand is not None and (best is None or cand.iteration_s < best.iteration_s):
                    best = cand
        return best

    def _shared_cut(self, structure: Structure, groups: Sequence[tuple[Device, ...]],
                    schedule: str) -> Candidate | None:
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
                               schedule)

    def joint_cut(self, groups: Sequence[tuple[Device, ...]], microbatches: int,
                  schedule: str) -> GroupCut | None:
        """One cut for K identical groups of at most four stages: the cut minimising the
        group's makespan plus spec 5.3's sync, over every cut (None when the groups
        differ, have one or more than four stages, or the cluster is big).

        With one cut for all groups, each stage is one bucket whose ring runs over the
        copies of that stage (group order, wrapping around), and every device holds one
        stage, so ``T_sync = max_s AR_s``: ``2 (K-1)/K * param_mb(stage s) * 8 /
        (1000 * min ring gbps) + 2 (K-1) * max ring latency``. All cuts are ranked by
        the proxy makespan plus that term (:func:`exhaustive_cuts`), the best few
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
        from .assign import assign_microbatches

        total = self.total
        classes: list[int] = []
        reps: list[int] = []
        class_ids: dict[tuple[object, ...], int] = {}
        for i, (g, c) in enumerate(cuts):
            key = (self._signature(g), c.bounds)
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
                   counts: list[int], schedule: str) -> Candidate | None:
        groups = []
        makespans = []
        for (g, cut), m in zip(cuts, counts, strict=True):
            c = self.at(g, cut.bounds, m, schedule)
            if c is None:
                return None
            key = (tuple(d.id for d in g), c.bounds, c.recompute)
            stages = _STAGES.get(key)
            if stages is None:  # the same group and cut recur across structures, subsets, slots
                if len(_STAGES) >= 8192:
                    _STAGES.clear()
                stages = _STAGES[key] = tuple(
                    Stage(device=d.id, layers=(c.bounds[j], c.bounds[j + 1]),
                          recompute=c.recompute[j])
                    for j, d in enumerate(g)
                )
            groups.append(Group(samples=m * self.micro, stages=stages))
            makespans.append(c.makespan)
        plan = Plan(microbatch_size=self.micro, schedule=schedule, groups=tuple(groups))
        return self.score(plan, label, makespans)

    def score(self, plan: Plan, label: str,
              makespans: Sequence[float] | None = None) -> Candidate | None:
        """Check validity and score: group makespans (given or simulated) plus sync.

        Built-in schedules use :func:`fast_makespan`, exact up to a few times S
        microbatches per group and extrapolated from the periodic regime beyond;
        :func:`make_plan` re-scores its pick with the exact reference model.
        """
        try:
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


# -- the search -----------------------------------------------------------------------

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
    median = {h: statistics.median(v) for h, v in by_host.items()}
    return {d.id for d in devices if d.tflops < 0.5 * median[d.host]}


_FOUND: OrderedDict[tuple[object, ...], tuple[Candidate, ...]] = OrderedDict()
_FOUND_LOCK = threading.Lock()
_FOUND_SIZE = 64


def candidate_plans(cluster: Cluster, model: Model, job: Job, *,
                    focus: int | None = None,
                    pairs: Collection[tuple[str, str]] | None = None,
                    local_search: bool = False) -> list[Candidate]:
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
    budgeted one from slot to slot instead (:class:`CarriedDescent`).
    """
    key = (cluster, _model_token(model), job.global_batch, job.microbatch_size,
           tuple(job.schedules), focus, None if pairs is None else tuple(sorted(pairs)),
           local_search)
    with _FOUND_LOCK:
        hit = _FOUND.get(key)
        if hit is not None:
            _FOUND.move_to_end(key)
            return list(hit)
    found = _search(cluster, model, job, focus=focus, pairs=pairs, local_search=local_search)
    with _FOUND_LOCK:
        _FOUND[key] = tuple(found)
        while len(_FOUND) > _FOUND_SIZE:
            _FOUND.popitem(last=False)
    return found


def _search(cluster: Cluster, model: Model, job: Job, *, focus: int | None,
            pairs: Collection[tuple[str, str]] | None, local_search: bool) -> list[Candidate]:
    planner = Planner(cluster, model, job)
    schedules = [s for s in _BUILTIN if s in job.schedules] or ["1f1b"]
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
                    Structure(f"{label}/{structure.label}", structure.groups), schedule)
                if cand is not None:
                    found.append(cand)
                    ranked.append((cand.iteration_s, structure.label, schedule))
        keep = {(name, schedule) for _, name, schedule in sorted(ranked)[:focus]}
        subsets = subsets[1:]
    every_mapping = len(cluster.devices) <= _EVERY_MAPPING_DEVICES
    for label, subset in subsets:
        for structure in structures(cluster, subset, planner.arr, planner.micro,
                                    every_mapping):
            for schedule in schedules:
                if keep is not None and (structure.label, schedule) not in keep:
                    continue
                cand = planner.plan_structure(
                    Structure(f"{label}/{structure.label}", structure.groups), schedule
                )
                if cand is not None:
                    found.append(cand)
    if (local_search and pairs is None and found
            and _EVERY_MAPPING_DEVICES < len(cluster.devices) <= _LOCAL_SEARCH_DEVICES):
        found.extend(_local_search(planner, found, schedules))
    from .baselines import BASELINES

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
    """Improvements on the :data:`_LOCAL_SEARCH_STARTS` fastest distinct mappings of each
    schedule (:func:`.localsearch.descend`), fastest first, while the schedule's budget
    of :data:`_LOCAL_SEARCH_BUDGET` plannings lasts; labelled ``local/<start>+<n>``."""
    out: list[Candidate] = []
    devices = list(planner.cluster.devices)
    for schedule in schedules:
        starts: dict[tuple[tuple[str, ...], ...], Candidate] = {}
        for cand in sorted((c for c in found if c.plan.schedule == schedule),
                           key=lambda c: c.iteration_s):
            starts.setdefault(tuple(g.devices for g in cand.plan.groups), cand)
            if len(starts) == _LOCAL_SEARCH_STARTS:
                break
        spent = [0]
        for start in starts.values():
            label = start.label.partition("/")[2] or start.label

            def plan(groups: DeviceMapping, label: str = label, schedule: str = schedule,
                     spent: list[int] = spent) -> Candidate | None:
                spent[0] += 1
                return planner.plan_structure(Structure(f"local/{label}", groups), schedule)

            if spent[0] >= _LOCAL_SEARCH_BUDGET:
                break
            steps = descend(start, devices, plan, _LOCAL_SEARCH_BUDGET - spent[0])
            out.extend(replace(c, label=f"{c.label}+{i + 1}") for i, c in enumerate(steps))
    return out


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

    ``make_plan`` spends up to :data:`_LOCAL_SEARCH_BUDGET` plannings per schedule at
    once (1-3 s on 16 devices); a controller plans every job every slot in one
    process, and 8 jobs on 16 devices fell behind 5 s slots with that. So each slot
    here spends at most ``budget`` plannings per schedule, resuming the descents where
    the last slot stopped, skipping mappings they planned while the cluster was the
    same. The first descent starts from the faster of the mapping carried over and
    this slot's fastest candidate; when it reaches a local optimum the next starts
    from the next fastest distinct candidate, as ``make_plan``'s do, up to
    :data:`_LOCAL_SEARCH_STARTS`. Once all are done on an unchanged cluster, slots cost
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
        if self.budget <= 0 or not found or not (_EVERY_MAPPING_DEVICES < n <= _LOCAL_SEARCH_DEVICES):
            return []
        key = (tuple((d.id, d.host) for d in cluster.devices), _model_token(model),
               job.global_batch, job.microbatch_size, tuple(job.schedules))
        figures = _figures(cluster)
        if key != self._key or _drifted(self._figures, figures):
            self._key, self._figures, self._walks = key, figures, {}
        planner = Planner(cluster, model, job)
        out: list[Candidate] = []
        for schedule in [s for s in _BUILTIN if s in job.schedules] or ["1f1b"]:
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
                if len(walks) >= _LOCAL_SEARCH_STARTS:
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
        from .baselines import BASELINES

        if policy not in BASELINES:
            raise ValueError(f"unknown policy {policy!r}")
        plan = BASELINES[policy](cluster, model, job)
        planner = Planner(cluster, model, job)
        scored = planner.score(plan, policy)
        scored = None if scored is None else planner.exact(scored)
        if scored is None:
            raise InfeasibleError(f"{policy}: its plan does not fit in memory")
        return scored.plan
    found = candidate_plans(cluster, model, job, focus=3, local_search=True)
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
