"""The simulation loop: drive a policy through a scenario, score every slot.

Slot t:

1. the policy *observes* the cluster: the devices that are up in slot t (the
   daemon learns at once when an agent drops out, so a down device is never
   offered), with the measurements of slot t-1 (reports arrive after the
   fact; slot 0 sees slot 0), optionally multiplied by noise
   ``max(0.05, 1 + noise * N(0, 1))`` per device TFLOP/s and per link
   Gbit/s from a generator seeded with ``seed``;
2. it decides a plan (:class:`~hetpilot.planner.controller.Decision`);
3. the plan is scored with the reference model (spec section 5) against slot
   t's truth; a switch is charged the time the switching model gives on the
   truth, spread over the slot's iterations (``effective_iteration_s``);
4. the simulator's own queues are updated from the true cost rates, so that
   every policy's backlog is measured the same way.

A slot in which nothing fits (every device down, say) is a stall: no plan,
``iteration_s`` null, no cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from hetpilot.planner import serde
from hetpilot.planner.candidates import plan_costs
from hetpilot.planner.controller import SearchFn
from hetpilot.planner.errors import InfeasibleError
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.switching import switch_cost
from hetpilot.planner.types import COST_KINDS, Cluster, Link, Plan

from .policies import MakePlanFn, make_policy
from .scenario import Scenario, Timeline

__all__ = ["Observer", "SlotRecord", "simulate", "summarize"]


@dataclass(frozen=True)
class SlotRecord:
    policy: str
    slot: int
    iteration_s: float | None
    """Reference-model iteration time on this slot's truth (None: stalled)."""
    effective_iteration_s: float | None
    """iteration_s plus this slot's switching time spread over its iterations."""
    costs: Mapping[str, float]
    budgets: Mapping[str, float]
    queues: Mapping[str, float]
    switched: bool
    switch_s: float
    version: int
    plan: Plan | None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self, emit_plan: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "slot": self.slot,
            "iteration_s": _r(self.iteration_s),
            "effective_iteration_s": _r(self.effective_iteration_s),
            "price_per_hour": _r(self.costs.get("price_per_hour", 0.0)),
            "power_watts": _r(self.costs.get("power_watts", 0.0)),
            "queues": {k: _r(v) for k, v in self.queues.items()},
            "switched": self.switched,
            "switch_s": _r(self.switch_s),
            "version": self.version,
        }
        if self.warnings:
            out["warnings"] = list(self.warnings)
        if emit_plan:
            out["plan"] = None if self.plan is None else serde.plan_to_dict(self.plan)
        return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class Observer:
    """What a policy sees of slot t (see the module docstring)."""

    def __init__(self, timeline: Timeline, noise: float = 0.0, seed: int = 0) -> None:
        self.timeline = timeline
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self._cache: dict[tuple[int, frozenset[str]], Cluster] = {}

    def observe(self, t: int) -> Cluster:
        tl = self.timeline
        src = tl.full(t - 1 if t > 0 else 0)
        up = tl.up(t)
        if self.noise <= 0.0:
            key = (id(src), up)
            hit = self._cache.get(key)
            if hit is None:
                hit = self._cache[key] = src.without(frozenset(src.by_id) - up)
                if len(self._cache) > 64:
                    self._cache.pop(next(iter(self._cache)))
            return hit
        return self._noisy(src, up)

    def _noisy(self, src: Cluster, up: frozenset[str]) -> Cluster:
        def f(n: int) -> np.ndarray:
            return np.maximum(0.05, 1.0 + self.noise * self.rng.standard_normal(n))

        dev_f = f(len(src.devices))
        devices = tuple(
            replace(d, tflops=d.tflops * float(k))
            for d, k in zip(src.devices, dev_f, strict=True) if d.id in up
        )
        net = src.network
        link_f = f(2 + len(net.host_links) + len(net.device_links))

        def links(ls: tuple[Link, ...], fs: np.ndarray) -> tuple[Link, ...]:
            return tuple(replace(lk, gbps=lk.gbps * float(k)) for lk, k in zip(ls, fs, strict=True))

        nh = len(net.host_links)
        network = replace(
            net,
            intra_host_gbps=net.intra_host_gbps * float(link_f[0]),
            inter_host_gbps=net.inter_host_gbps * float(link_f[1]),
            host_links=links(net.host_links, link_f[2:2 + nh]),
            device_links=tuple(lk for lk in links(net.device_links, link_f[2 + nh:])
                               if lk.a in up and lk.b in up),
        )
        return Cluster(devices=devices, network=network)


def simulate(
    scenario: Scenario,
    policy: str = "lyapunov",
    *,
    seed: int = 0,
    noise: float = 0.0,
    slots: int | None = None,
    V: float | None = None,
    hysteresis: float | None = None,
    local_search_budget: int | None = None,
    timeline: Timeline | None = None,
    search: SearchFn | None = None,
    make_plan: MakePlanFn | None = None,
) -> Iterator[SlotRecord]:
    """Run one policy through the scenario, yielding one record per slot.

    ``V`` overrides the job's V (V events still apply later); ``hysteresis`` and
    ``local_search_budget`` the controller's defaults (:class:`ControllerConfig`). Deterministic:
    the same arguments give the same records.
    """
    tl = timeline or Timeline(scenario, slots)
    n = min(len(tl), scenario.slots if slots is None else slots)
    job = scenario.job if V is None else replace(scenario.job, V=V)
    kwargs: dict[str, Any] = {} if hysteresis is None else {"hysteresis": hysteresis}
    if local_search_budget is not None:
        kwargs["local_search_budget"] = local_search_budget
    pol = make_policy(policy, scenario.model, job, iterations_per_slot=scenario.iterations_per_slot,
                      search=search, make_plan=make_plan, **kwargs)
    observer = Observer(tl, noise, seed)
    model, batch = scenario.model, scenario.job.global_batch
    queues: dict[str, float] = {}
    prev_plan: Plan | None = None
    v_now = job.V
    for t in range(n):
        budgets = tl.budgets(t)
        if t > 0 and tl.V(t) != tl.V(t - 1):
            v_now = tl.V(t)
        queues = {k: queues.get(k, 0.0) for k in budgets}
        observed = observer.observe(t)
        truth = tl.truth(t)
        try:
            d = pol.decide(observed, budgets, v_now)
        except InfeasibleError as exc:
            yield SlotRecord(policy, t, None, None, dict.fromkeys(COST_KINDS, 0.0), budgets,
                             dict(queues), False, 0.0, 0, None, (f"stalled: {exc}",))
            queues = {k: max(q - budgets[k], 0.0) for k, q in queues.items()}
            continue
        down = [dev for dev in d.plan.devices if dev not in truth.by_id]
        if down:  # the observer never offers a down device: this is a bug, not input
            raise RuntimeError(f"slot {t}: policy {policy} planned on down devices {down}")
        ev = evaluate(truth, model, d.plan, batch)
        warnings = list(d.warnings)
        if not ev.valid or ev.iteration_s is None:
            warnings.append(f"stalled: the plan is invalid on this slot's truth: {ev.error}")
            yield SlotRecord(policy, t, None, None, dict.fromkeys(COST_KINDS, 0.0), budgets,
                             dict(queues), d.switched, 0.0, d.version, d.plan, tuple(warnings))
            continue
        sw = switch_cost(truth, model, prev_plan, d.plan).seconds if d.switched else 0.0
        prev_plan = d.plan
        costs = dict(plan_costs(truth, d.plan))
        queues = {k: max(q + costs.get(k, 0.0) - budgets[k], 0.0) for k, q in queues.items()}
        yield SlotRecord(
            policy, t, ev.iteration_s, ev.iteration_s + sw / scenario.iterations_per_slot,
            costs, budgets, dict(queues), d.switched, sw, d.version, d.plan, tuple(warnings),
        )


def summarize(records: Sequence[SlotRecord], transient: int | None = None) -> dict[str, Any]:
    """Averages over the run; ``tail_*`` leave out the first ``transient`` slots
    (default a tenth of the run)."""
    n = len(records)
    skip = max(1, n // 10) if transient is None else transient
    ran = [r for r in records if r.iteration_s is not None]
    tail = [r for r in records[skip:]]

    def avg(xs: Sequence[float]) -> float | None:
        return _r(sum(xs) / len(xs)) if xs else None

    out: dict[str, Any] = {
        "summary": True,
        "policy": records[0].policy if records else None,
        "slots": n,
        "stalled_slots": n - len(ran),
        "avg_iteration_s": avg([r.iteration_s for r in ran if r.iteration_s is not None]),
        "avg_effective_iteration_s": avg(
            [r.effective_iteration_s for r in ran if r.effective_iteration_s is not None]),
    }
    for kind in COST_KINDS:
        out[f"avg_{kind}"] = avg([r.costs.get(kind, 0.0) for r in records])
    out["transient_slots"] = skip
    for kind in COST_KINDS:
        out[f"tail_avg_{kind}"] = avg([r.costs.get(kind, 0.0) for r in tail])
    tail_ran = [r.iteration_s for r in tail if r.iteration_s is not None]
    out["tail_avg_iteration_s"] = avg(tail_ran)
    out["budgets"] = dict(records[-1].budgets) if records else {}
    out["tail_avg_budgets"] = {
        k: avg([r.budgets.get(k, math.nan) for r in tail]) for k in out["budgets"]
    }
    out["final_queues"] = {k: _r(v) for k, v in records[-1].queues.items()} if records else {}
    out["max_queues"] = {
        k: _r(max(r.queues.get(k, 0.0) for r in records)) for k in out["final_queues"]
    }
    out["avg_queues"] = {
        k: avg([r.queues.get(k, 0.0) for r in records]) for k in out["final_queues"]
    }
    out["switches"] = sum(1 for r in records[1:] if r.switched)
    out["switch_s"] = _r(sum(r.switch_s for r in records))
    out["warnings"] = list(dict.fromkeys(w for r in records for w in r.warnings))
    return out
