"""The policies the simulator compares, behind one small interface.

- ``lyapunov`` (default), ``fastest``, ``budget-greedy`` and ``static`` are
  :class:`~hetpilot.planner.controller.Controller` objects with that
  ``policy``: they share the tentative search, the switching cost and the
  handling of devices that go down.
- ``even-dp``, ``uniform-pp``, ``megatron`` and ``balanced-homogeneous`` are
  the planner's baselines run as static policies: planned once at slot 0 by
  ``make_plan(policy=NAME)``, ignoring budgets, like a user who picks a
  layout and keeps it.

Every static policy (``static`` and the baselines) keeps its plan as a job
with torchelastic-style recovery would (:mod:`hetpilot.planner.elastic`):
while devices of it are down, the groups that lost one stop and the others
take their samples; the groups rejoin when the devices return. Only when no
group survives does it re-plan on the devices that are up (a down device
never appears in a plan) and keep that plan. ``static-replan`` is the
kindest reading of "plan once": it re-plans from scratch on the devices that
are up as soon as one of its devices goes down and keeps the new plan.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Protocol

from hetpilot.planner.candidates import Candidate, plan_costs
from hetpilot.planner.controller import Controller, ControllerConfig, Decision, SearchFn
from hetpilot.planner.elastic import surviving_plan
from hetpilot.planner.errors import InfeasibleError
from hetpilot.planner.refmodel import evaluate
from hetpilot.planner.switching import switch_cost
from hetpilot.planner.types import Cluster, Job, Model, Plan

__all__ = [
    "BASELINES",
    "CONTROLLED",
    "POLICY_NAMES",
    "CachedSearch",
    "Policy",
    "make_policy",
]

CONTROLLED = ("lyapunov", "static", "static-replan", "fastest", "budget-greedy")
BASELINES = ("even-dp", "uniform-pp", "megatron", "balanced-homogeneous")
POLICY_NAMES = CONTROLLED + BASELINES

MakePlanFn = Callable[..., Plan]


class Policy(Protocol):
    name: str

    def decide(self, observed: Cluster, budgets: Mapping[str, float], V: float) -> Decision:
        """The plan for this slot; raises InfeasibleError when nothing fits."""
        ...


class CachedSearch:
    """Memoises the tentative search, so that several policies run over one
    timeline search each distinct cluster once.

    The key leaves out what cannot change a plan's iteration time: device
    prices and power (the candidates' cost rates are recomputed for the
    cluster asked about) and the job's budgets and V (the planner's search
    reads neither; they are the controller's). Spot-price swings then cost
    no search at all.
    """

    def __init__(self, search: SearchFn, size: int = 64) -> None:
        self._search = search
        self._size = size
        self._cache: OrderedDict[tuple[object, ...], tuple[Cluster, list[Candidate]]] = OrderedDict()
        self.narrowable = bool(getattr(search, "narrowable", False))
        """Passes ``pairs=`` through, like the search it wraps (see PlannerSearch)."""

    def __call__(self, cluster: Cluster, model: Model, job: Job, *,
                 pairs: Sequence[tuple[str, str]] | None = None) -> list[Candidate]:
        bare = Cluster(devices=tuple(replace(d, price_per_hour=0.0, power_watts=0.0)
                                     for d in cluster.devices), network=cluster.network)
        key = (bare, id(model), job.global_batch, job.microbatch_size, job.schedules,
               None if pairs is None else tuple(pairs))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            source, found = hit
        else:
            extra = {} if pairs is None else {"pairs": pairs}
            source, found = cluster, list(self._search(cluster, model, job, **extra))  # type: ignore[call-arg]
            self._cache[key] = (cluster, found)
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        if source is cluster or source == cluster:
            return found
        return [replace(c, costs=plan_costs(cluster, c.plan)) for c in found]


class _Controlled:
    def __init__(self, name: str, model: Model, job: Job, config: ControllerConfig,
                 search: SearchFn | None) -> None:
        self.name = name
        self.controller = Controller(model, job, config, search=search)

    def decide(self, observed: Cluster, budgets: Mapping[str, float], V: float) -> Decision:
        ctl = self.controller
        if dict(ctl.budgets) != dict(budgets) or ctl.V != V:
            ctl.set_budgets(budgets, V)
        return ctl.step(observed)


class _Baseline:
    """A planner baseline planned once, kept through failures like ``static``."""

    def __init__(self, name: str, model: Model, job: Job, make_plan: MakePlanFn) -> None:
        self.name = name
        self.model = model
        self.job = job
        self._make_plan = make_plan
        self._plan: Plan | None = None
        self._origin: Plan | None = None
        self._version = 0
        self._slot = 0

    def decide(self, observed: Cluster, budgets: Mapping[str, float], V: float) -> Decision:
        old = self._plan
        plan = None
        warnings: tuple[str, ...] = ()
        if self._origin is not None:
            plan = surviving_plan(self._origin, observed, self.model, self.job.global_batch)
            if plan is not None and plan != old:
                warnings = (f"{self.name}: groups with down devices wait; the others take "
                            "their samples" if plan is not self._origin else
                            f"{self.name}: every device is back; the groups rejoin",)
        if plan is None:
            plan = self._make_plan(observed, self.model, self.job, policy=self.name)
            if self._origin is not None:
                warnings = (f"{self.name}: no group of its plan can run; re-planned",)
            self._origin = plan
        ev = evaluate(observed, self.model, plan, self.job.global_batch)
        if not ev.valid or ev.iteration_s is None:
            raise InfeasibleError(f"{self.name} plan is invalid: {ev.error}")
        switched = plan != old
        sw = switch_cost(observed, self.model, old, plan) if switched else None
        if switched:
            self._version += 1
        self._plan = plan
        decision = Decision(
            slot=self._slot,
            plan=plan,
            version=self._version,
            switched=switched,
            iteration_s=ev.iteration_s,
            costs=plan_costs(observed, plan),
            queues=MappingProxyType({}),
            switch_cost_s=0.0 if sw is None else sw.seconds,
            warnings=warnings,
            switch_mb=0.0 if sw is None else sw.mb,
            label=self.name,
            forced=old is None or switched,
            candidates=1,
        )
        self._slot += 1
        return decision


def make_policy(
    name: str,
    model: Model,
    job: Job,
    *,
    iterations_per_slot: int,
    hysteresis: float = ControllerConfig.hysteresis,
    local_search_budget: int = ControllerConfig.local_search_budget,
    search: SearchFn | None = None,
    make_plan: MakePlanFn | None = None,
) -> Policy:
    if name in CONTROLLED:
        config = ControllerConfig(policy=name, iterations_per_slot=iterations_per_slot,
                                  hysteresis=hysteresis, local_search_budget=local_search_budget)
        return _Controlled(name, model, job, config, search)
    if name in BASELINES:
        if make_plan is None:
            from hetpilot.planner.search import make_plan as planner_make_plan

            make_plan = planner_make_plan
        return _Baseline(name, model, job, make_plan)
    raise ValueError(f"unknown policy {name!r}")


def parse_policies(text: str, path: str = "--policy") -> Sequence[str]:
    from hetpilot.planner.errors import ValidationError

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValidationError(path, "names no policy")
    for n in names:
        if n not in POLICY_NAMES:
            raise ValidationError(path, f"unknown policy {n!r}; known: {', '.join(POLICY_NAMES)}")
    return list(dict.fromkeys(names))
