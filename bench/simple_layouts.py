"""Exhaustive search over simple layouts: a yardstick for the planner on real profiles.

A *simple layout* is K identical pipelines ("groups") of S <= 4 stages on K * S devices:

* devices: all of them in host-major order (hosts in order of first appearance, devices in
  cluster order within a host), or, when K * S is less than the device count, the K * S
  fastest (ties in host-major order) or the first K * S in host-major order;
* placement: *group-major* (group g on devices g*S .. g*S+S-1 of that order: each pipeline on
  neighbouring devices) or *stage-major* (stage s of every group on devices s*K .. s*K+K-1:
  the replicas of a stage sit together, so its all-reduce runs on the links among them,
  while each pipeline crosses from one such block to the next);
* every cut: all combinations of S - 1 cut points, the same in every group;
* schedule 1f1b or gpipe; the job's microbatch size;
* samples: as evenly as whole microbatches allow (extra microbatches to the fastest groups),
  and, when the groups' devices differ, proportional to each group's summed TFLOP/s;
* recompute off, and on for exactly the stages that do not fit in memory without it.

Every candidate is scored with the spec v1 reference model (section 5), vectorised over the
cuts: for built-in schedules the dependency graph of a group's ops does not depend on the
durations, so one topological order of the ops, replayed with numpy arrays holding every
cut's stage times, gives every cut's exact makespan (FIFO channels included). With the same
cut in every group, each stage's layers form one all-reduce bucket over that stage's devices,
so ``T_sync`` is the largest per-stage ring all-reduce. The best plan is re-scored with
:func:`hetpilot.planner.refmodel.evaluate`, which must agree.

    from simple_layouts import search
    result = search(cluster, model, job)   # result.iteration_s, result.plan, result.label
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from hetpilot.planner.makespans import vector_makespans
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.types import Cluster, Device, Group, Job, Model, Plan, Stage

__all__ = ["Result", "device_order", "search"]

MAX_STAGES = 4
_REL = 1e-9


@dataclass(frozen=True)
class Result:
    iteration_s: float
    plan: Plan | None
    label: str
    candidates: int = 0
    """(layout, cut) pairs scored, feasible or not."""
    per_layout: dict[str, float] = field(default_factory=dict)
    """Best time of each (placement) family: 'group-major', 'stage-major', 'dp', 'single'."""


def device_order(cluster: Cluster) -> list[Device]:
    """Host-major: hosts in order of first appearance, devices in cluster order within one."""
    rank = {h: i for i, h in enumerate(cluster.hosts)}
    return sorted(cluster.devices, key=lambda d: rank[d.host])  # sorted() is stable


def _subsets(devs: list[Device], size: int) -> list[tuple[str, list[Device]]]:
    if size == len(devs):
        return [("all", devs)]
    pos = {d.id: i for i, d in enumerate(devs)}
    fastest = sorted(sorted(devs, key=lambda d: -d.tflops)[:size], key=lambda d: pos[d.id])
    first = devs[:size]
    out = [(f"fastest{size}", fastest)]
    if [d.id for d in first] != [d.id for d in fastest]:
        out.append((f"first{size}", first))
    return out


@lru_cache(maxsize=256)
def _cuts(num_layers: int, stages: int) -> np.ndarray:
    """(C, S + 1) stage bounds for every combination of S - 1 cut points."""
    if stages > num_layers:
        return np.zeros((0, stages + 1), dtype=np.int64)
    combos = np.array(list(itertools.combinations(range(1, num_layers), stages - 1)),
                      dtype=np.int64).reshape(-1, stages - 1) if stages > 1 else np.zeros(
                          (1, 0), dtype=np.int64)
    n = combos.shape[0]
    return np.hstack([np.zeros((n, 1), np.int64), combos, np.full((n, 1), num_layers, np.int64)])


def makespans(fwd: Sequence[np.ndarray], bwd: Sequence[np.ndarray],
              comm: Sequence[np.ndarray], schedule: str, micro: int) -> np.ndarray:
    """Spec 5.2 makespan of one group for many candidates at once (arrays of equal length):
    the planner's column-wise simulation, :func:`hetpilot.planner.makespans.vector_makespans`
    (the best plan found is re-scored with the plain reference model)."""
    n = fwd[0].shape[0]
    return vector_makespans(np.column_stack(fwd), np.column_stack(bwd),
                            np.column_stack(comm) if comm else np.zeros((n, 0)), schedule, micro)


class _Arrays:
    """Prefix sums of the model's per-layer figures."""

    def __init__(self, model: Model) -> None:
        layers = model.layers

        def pre(values: list[float]) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum(values)])

        self.num_layers = len(layers)
        self.fwd = pre([x.fwd_gflop for x in layers])
        self.bwd = pre([x.bwd_gflop for x in layers])
        self.act = pre([x.act_mb for x in layers])
        self.param = pre([x.param_mb for x in layers])
        self.inp = pre([0.0] + [x.out_mb for x in layers[:-1]])
        self.out = np.array([x.out_mb for x in layers])
        self.opt = model.optimizer_factor


@dataclass
class _GroupEval:
    span: np.ndarray  # makespan per cut (inf where it does not fit)
    recompute: np.ndarray  # (C, S) bool


class _Searcher:
    def __init__(self, cluster: Cluster, model: Model, job: Job) -> None:
        self.cluster = cluster
        self.model = model
        self.job = job
        self.arr = _Arrays(model)
        self.micro = job.microbatch_size
        self.total = job.microbatches
        self.cache: dict[tuple[object, ...], _GroupEval] = {}
        self.scored = 0

    def group_eval(self, devs: Sequence[Device], schedule: str, m: int) -> _GroupEval:
        s = len(devs)
        links = tuple(self.cluster.link(devs[j].id, devs[j + 1].id) for j in range(s - 1))
        key = (tuple((d.tflops, d.memory_gb) for d in devs), links, schedule, m)
        found = self.cache.get(key)
        if found is not None:
            return found
        a = self.arr
        bounds = _cuts(a.num_layers, s)
        lo, hi = bounds[:, :-1], bounds[:, 1:]
        micro = self.micro
        fwd, bwd, comm = [], [], []
        fits = np.ones(bounds.shape[0], dtype=bool)
        recompute = np.zeros((bounds.shape[0], s), dtype=bool)
        for j, d in enumerate(devs):
            x, y = lo[:, j], hi[:, j]
            rate = 1000.0 * d.tflops
            f = micro * (a.fwd[y] - a.fwd[x]) / rate
            b = micro * (a.bwd[y] - a.bwd[x]) / rate
            flight = m if schedule == "gpipe" else min(s - j, m)
            params = (a.param[y] - a.param[x]) * (1.0 + a.opt)
            act = a.act[y] - a.act[x]
            plain = params + flight * micro * act
            # recompute keeps each layer's input (in_mb, 0 for layer 0) per microbatch in flight
            again = params + flight * micro * (a.inp[y] - a.inp[x]) + micro * act
            cap = 1000.0 * d.memory_gb
            rc = plain > cap
            fits &= ~rc | (again <= cap)
            recompute[:, j] = rc
            fwd.append(f)
            bwd.append(b + np.where(rc, f, 0.0))
            if j + 1 < s:
                gbps, lat = links[j]
                comm.append(lat + micro * a.out[y - 1] * 8.0 / (1000.0 * gbps))
        span = makespans(fwd, bwd, comm, schedule, m)
        span[~fits] = np.inf
        self.scored += bounds.shape[0]
        found = self.cache[key] = _GroupEval(span, recompute)
        return found

    def sync(self, groups: list[list[Device]]) -> np.ndarray:
        """T_sync per cut: stage j's layers are one bucket over the groups' stage-j devices."""
        k = len(groups)
        s = len(groups[0])
        bounds = _cuts(self.arr.num_layers, s)
        if k == 1:
            return np.zeros(bounds.shape[0])
        worst = np.zeros(bounds.shape[0])
        for j in range(s):
            ring = [g[j].id for g in groups]
            gbps, lat = math.inf, 0.0
            for i in range(k):
                g, la = self.cluster.link(ring[i], ring[(i + 1) % k])
                gbps, lat = min(gbps, g), max(lat, la)
            size = self.arr.param[bounds[:, j + 1]] - self.arr.param[bounds[:, j]]
            ar = 2.0 * (k - 1) / k * size * 8.0 / (1000.0 * gbps) + 2.0 * (k - 1) * lat
            worst = np.maximum(worst, ar)
        return worst

    def splits(self, groups: list[list[Device]]) -> list[tuple[str, list[int]]]:
        k = len(groups)
        speed = [sum(d.tflops for d in g) for g in groups]
        rank = sorted(range(k), key=lambda g: -speed[g])  # extras to the fastest
        base, extra = divmod(self.total, k)
        even = [base] * k
        for g in rank[:extra]:
            even[g] += 1
        out = [("even", even)]
        if len(set(speed)) > 1:
            share = [self.total * sp / sum(speed) for sp in speed]
            prop = [max(1, int(x)) for x in share]
            while sum(prop) > self.total:  # pragma: no cover - only with tiny totals
                g = max((g for g in range(k) if prop[g] > 1), key=lambda g: prop[g] - share[g])
                prop[g] -= 1
            by_rest = sorted(range(k), key=lambda g: -(share[g] - prop[g]))
            for g in by_rest[: self.total - sum(prop)]:
                prop[g] += 1
            if prop != even:
                out.append(("proportional", prop))
        return out


def _family(k: int, s: int, placement: str) -> str:
    if s == 1:
        return "dp" if k > 1 else "single"
    if k == 1:
        return "pipeline"
    return placement


def search(cluster: Cluster, model: Model, job: Job, *,
           max_stages: int = MAX_STAGES, verify: bool = True) -> Result:
    """The fastest simple layout under the reference model (see the module docstring)."""
    me = _Searcher(cluster, model, job)
    devs = device_order(cluster)
    n = len(devs)
    schedules = [s for s in ("1f1b", "gpipe") if s in job.schedules] or ["1f1b"]
    best_t, best = math.inf, None
    per_family: dict[str, float] = {}
    for s in range(1, min(max_stages, model.num_layers) + 1):
        bounds = _cuts(model.num_layers, s)
        for k in range(1, n // s + 1):
            if k > me.total:
                break
            for subset_label, subset in _subsets(devs, k * s):
                placements = ["group-major", "stage-major"] if (k > 1 and s > 1) else [
                    "group-major"]
                for placement in placements:
                    if placement == "group-major":
                        groups = [subset[g * s:(g + 1) * s] for g in range(k)]
                    else:
                        groups = [[subset[j * k + g] for j in range(s)] for g in range(k)]
                    sync = me.sync(groups)
                    for split_label, split in me.splits(groups):
                        for schedule in schedules:
                            spans = np.zeros(bounds.shape[0])
                            evals = []
                            for g, m in zip(groups, split, strict=True):
                                ev = me.group_eval(g, schedule, m)
                                evals.append(ev)
                                spans = np.maximum(spans, ev.span)
                            total = spans + sync
                            c = int(np.argmin(total))
                            t = float(total[c])
                            fam = _family(k, s, placement)
                            per_family[fam] = min(per_family.get(fam, math.inf), t)
                            if t < best_t * (1 - _REL):
                                best_t = t
                                best = (k, s, placement, subset_label, split_label, schedule,
                                        groups, split, bounds[c], [e.recompute[c] for e in evals])
    if best is None:
        return Result(math.inf, None, "nothing fits", me.scored, per_family)
    k, s, placement, subset_label, split_label, schedule, groups, split, cut, rcs = best
    plan = Plan(
        microbatch_size=me.micro, schedule=schedule,
        groups=tuple(
            Group(samples=m * me.micro, stages=tuple(
                Stage(device=d.id, layers=(int(cut[j]), int(cut[j + 1])), recompute=bool(rc[j]))
                for j, d in enumerate(g)))
            for g, m, rc in zip(groups, split, rcs, strict=True)),
        predicted_iteration_s=best_t,
    )
    label = (f"K={k} S={s} {_family(k, s, placement)} {schedule} {split_label} "
             f"devices={subset_label} cuts={[int(x) for x in cut[1:-1]]}")
    if verify:
        ev = evaluate(cluster, model, plan, job.global_batch)
        if not ev.valid or ev.iteration_s is None or abs(ev.iteration_s - best_t) > 1e-9 * best_t:
            raise AssertionError(f"simple-layouts disagrees with evaluate: {best_t} vs {ev}")
    return Result(best_t, plan, label, me.scored, per_family)
