"""Lyapunov drift-plus-penalty controller of one job's plan (spec v1 section 6).

One :class:`Controller` per job. Each slot, :meth:`Controller.step` takes the
cluster as the controller observes it (devices that are down are absent) and

1. *settles* the previous slot: the queues are recomputed with the cost rates
   the previous plan really had, now that this slot's observation shows the
   prices of the last slot (reports arrive after the fact);
2. asks the planner's tentative search for candidate plans (one per device
   subset and group structure) and adds the running plan, re-scored on the
   observed cluster ([Note: cost-aware subsets]);
3. has its policy (:mod:`.control_policies`) pick a candidate: ``lyapunov``
   minimises ``V * T + sum_k Q_k * c_k``, where a candidate other than the
   running plan also pays the time it takes to switch to it (:mod:`.switching`)
   spread over the slot's iterations, and switches only when that beats the
   running plan by ``hysteresis * V * T_running`` (so plans do not flap on noise);
4. updates the virtual queues ``Q_k(t+1) = max(Q_k + c_k - budget_k, 0)``.

That is the contract, used as it stands when the job gives its V. ``V = 0``
(:data:`DEFAULT_V`) means the job gives none ([Note: the default V]).

Two optional hooks (keyword arguments of :class:`Controller`, both off by
default, so the contract is unchanged without them):

- ``predict``: maps the observed cluster to the cluster *predicted* for the
  next slot (e.g. device speeds from the random-forest slowdown estimator of
  :mod:`hetpilot.adapt`); the controller then plans with predicted rather
  than last-seen speeds. Cost rates still come from the observation.
- ``gate``: a :class:`Gate` that sees every (predicted) observation and must
  admit a switch away from a running plan that still works, e.g.
  :class:`hetpilot.adapt.gate.ReplanGate` (no re-cut for a transient spike;
  the gain over the slot must beat the switching cost). Its state travels in
  :meth:`Controller.to_state` under ``"gate"``.

The simulator's comparison policies (``fastest``, ``budget-greedy``, ``static``,
``static-replan``) run in the same object, chosen by
:attr:`ControllerConfig.policy`, so every policy shares the running-plan
bookkeeping, switching cost and handling of devices that go down. A budget
below the cheapest plan the search finds is a warning in
:attr:`Decision.warnings`; the controller then does its best (the queue grows
and pushes it to the cheapest plans). When no plan fits at all, :meth:`step`
raises :class:`~hetpilot.planner.errors.InfeasibleError` and the controller's
state is unchanged.

Pure: no grpc, asyncio or torch. The daemon and the simulator both drive it.

[Note: cost-aware subsets] Under budgets the controller also searches the
cluster without its least cost-efficient devices (lowest TFLOP/s per unit of
budgeted cost, costs weighed by their budgets), dropping 1/16, 1/8, 1/4, 1/2
and 3/4 of them: the planner drops the *slowest* devices, which are often the
cheap ones, so without this the cheap end of the trade-off would be missing.

[Note: the default V] V's units (seconds against ($/h)^2: ``Q / V`` is an
exchange rate in seconds per $/h) are not the job owner's problem. With one
budget the controller learns the rate from the cost/time frontiers of the last
slots (:mod:`.exchange_rate`), carries it as the queue ``Q = V_eff * rate``, and
where no plan sits at the budget while prices hold still it time-shares the two
plans that straddle it on a schedule of slots whose switches are paid for
(:mod:`.timeshare`). With several budgets the default is the drift-plus-penalty
normalised by the budgets and the job's iteration time (:class:`~.slot.Scale`).
See docs/controller.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from . import serde
from .candidates import Candidate, Frontier, budget_multiplier, frontier, plan_costs
from .carried_descent import CarriedDescent
from .control_policies import make_policy
from .controller_config import POLICIES, ControllerConfig, Gate, PredictFn, SearchFn
from .errors import InfeasibleError, ValidationError
from .exchange_rate import LearnedRate
from .search import candidate_plans, structure_pairs
from .slot import MIN_UNIT, Scale, Slot, capped, check_budgets, check_v, updated_queues
from .structures import BIG_CLUSTER
from .switching import switch_cost
from .timeshare import TimeShare
from .tpsearch import tp_candidates
from .types import COST_KINDS, DEFAULT_V, Cluster, Job, Model, Plan

__all__ = ["DEFAULT_V", "POLICIES", "Controller", "ControllerConfig", "Decision", "Gate",
           "PlannerSearch", "PredictFn", "SearchFn", "planner_search"]

_STATE_FORMAT = 1


@dataclass(frozen=True)
class Decision:
    slot: int
    plan: Plan
    version: int
    """Increments each time the running plan changes; starts at 1."""
    switched: bool
    iteration_s: float
    """Reference-model iteration time of ``plan`` on the observed cluster."""
    costs: Mapping[str, float]
    queues: Mapping[str, float]
    """Virtual queues after this slot's update."""
    switch_cost_s: float = 0.0
    warnings: tuple[str, ...] = field(default_factory=tuple)
    switch_mb: float = 0.0
    """MB of parameters and optimizer state the switch moves."""
    label: str = ""
    """Which structure of the tentative search the plan came from."""
    forced: bool = False
    """The running plan could not continue (a device down, or no plan yet)."""
    candidates: int = 0
    """How many candidates the slot compared (the running plan included)."""
    held: tuple[str, ...] = field(default_factory=tuple)
    """Why the gate kept the running plan against a better candidate (empty: it did not)."""
    V: float = 0.0
    """The V this slot weighed speed with, in the contract's units (the job's own
    V, or the default's equivalent for the first budget kind)."""
    mix: float = 0.0
    """When the slot is part of a time-sharing schedule: the share of slots the
    dearer of its two plans runs (0: no schedule)."""


@dataclass(frozen=True)
class _Pending:
    """What the last slot charged, kept so the next slot can settle it."""

    queues_before: Mapping[str, float]
    budgets: Mapping[str, float]
    costs: Mapping[str, float]


class PlannerSearch:
    """The planner's tentative search, the controller's default :data:`SearchFn`.

    On clusters of more than 64 devices it searches the speed-tier subsets for
    the 3 best (structure, schedule) pairs only (``focus``), and accepts
    ``pairs=`` (``narrowable``): the controller then searches its cost-aware
    subsets with the pairs that were best on the whole cluster instead of
    repeating the whole search on each.
    """

    narrowable = True

    def __call__(self, cluster: Cluster, model: Model, job: Job, *,
                 pairs: Sequence[tuple[str, str]] | None = None) -> Sequence[Candidate]:
        found = candidate_plans(cluster, model, job, focus=3, pairs=pairs)
        if job.tensor_parallel and pairs is None:  # only jobs whose trainer runs TP stages
            found = [*found, *tp_candidates(cluster, model, job)]
        return found


#: The default search, shared: the planner's memo of cuts is process-wide anyway.
planner_search = PlannerSearch()


class Controller:
    """Drift-plus-penalty control of one job's plan under long-term budgets."""

    def __init__(
        self,
        model: Model,
        job: Job,
        config: ControllerConfig | None = None,
        *,
        search: SearchFn | None = None,
        predict: PredictFn | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.model = model
        self.job = job
        self.config = config or ControllerConfig()
        self._search = search or planner_search
        self._predict = predict
        self._gate = gate
        self._budgets = check_budgets(job.budgets, "job.budgets", rates=True)
        self._V = check_v(job.V, "job.V")
        self._queues: dict[str, float] = {k: 0.0 for k in self._budgets}
        self._plan: Plan | None = None
        self._version = 0
        self._slot = 0
        self._pending: _Pending | None = None
        self._short: set[str] = set()  # budgets currently below the cheapest candidate
        # the default V (job V = 0): its scale, fixed on the first slot that needs it
        self._auto: Scale | None = None
        self._fresh: set[str] = set(self._budgets)  # queues the default V may warm-start
        self._carry: dict[str, float] = {}  # shadow prices to keep across a change of scale
        self._rate = LearnedRate(self.config)
        self._share = TimeShare(self.config)
        self._policy = make_policy(self.config.policy, self._rate, self._share)
        self._descent = CarriedDescent(self.config.local_search_budget)

    # -- public surface ------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        return self._plan

    @property
    def version(self) -> int:
        return self._version

    @property
    def local_search_planned(self) -> int:
        """Mappings the carried local search (:class:`~.carried_descent.CarriedDescent`) has planned."""
        return self._descent.planned

    @property
    def queues(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._queues))

    @property
    def budgets(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._budgets))

    @property
    def V(self) -> float:
        """The job's V as given; 0 (:data:`DEFAULT_V`): the job gave none."""
        return self._V

    @property
    def effective_V(self) -> float | None:
        """The V the controller weighs with, in the contract's units (for the
        first budget kind): the job's own V, or the default's
        ``default_v * b**2 / T_ref`` once the first slot has fixed ``T_ref``
        (None before)."""
        if self._V > 0:
            return self._V
        return None if self._auto is None else self._auto.contract_V(list(self._budgets))

    def set_budgets(
        self, budgets: Mapping[str, float] | None = None, V: float | None = None
    ) -> None:
        """Change the budgets (the whole mapping) and/or V from the next slot on.

        A new cost kind starts with an empty queue; a kind no longer budgeted
        loses its queue. ``V = 0`` is the default V. Raises ValidationError
        naming the field. Setting what is already set changes nothing (the
        daemon re-applies the job's budgets after every restart). When the
        default V is involved (before or after), the default's scale is fixed
        again on the next slot and each queue is rescaled so that its shadow
        price (what a unit of cost is worth in seconds) carries over.
        """
        new_budgets = None if budgets is None else check_budgets(budgets, "budgets", rates=True)
        new_v = None if V is None else check_v(V, "V")
        if new_budgets == self._budgets:
            new_budgets = None
        if new_v == self._V:
            new_v = None
        if new_budgets is None and new_v is None:
            return
        old_scale = self._scale_now()
        if old_scale is not None and (self._V == 0.0 or new_v == 0.0):
            self._carry = {k: old_scale.shadow(k, q) for k, q in self._queues.items()}
        if new_budgets is not None:
            self._fresh |= set(new_budgets) - set(self._budgets)
            if set(new_budgets) != set(self._budgets):  # another kind: another frontier
                self._rate.forget()
            self._budgets = new_budgets
            self._queues = {k: self._queues.get(k, 0.0) for k in new_budgets}
            self._short &= set(new_budgets)
        if new_v is not None:
            self._V = new_v
        if self._V == 0.0:
            self._auto = None  # fixed again on the next slot
        elif self._carry:
            scale = self._scale_now()
            assert scale is not None
            self._queues.update({k: scale.queue(k, lam) for k, lam in self._carry.items()
                                 if k in self._queues})
            self._carry = {}

    def candidates(self, observed: Cluster) -> list[Candidate]:
        """The plans a slot on ``observed`` weighs (the search and the cost-aware
        subsets), without choosing: for benchmarks that bound what any policy
        choosing among them could do."""
        return self._candidates(observed, self._job_now())

    def step(self, observed: Cluster) -> Decision:
        """Decide the plan for the next slot on the ``observed`` cluster."""
        queues = self._settled_queues(observed)
        if self._predict is not None:
            observed = self._predict(observed)
        if self._gate is not None:
            self._gate.observe(observed)
            self._gate.held.clear()
        job = self._job_now()
        running, why_not = self._running_candidate(observed)
        keeps = self._policy.keeps_working_plan and running is not None
        found = [] if keeps else self._candidates(observed, job)  # nothing to choose
        pool = [c for c in found if running is None or c.plan != running.plan]
        if running is None and not pool:
            raise InfeasibleError("no plan fits the observed cluster's memory")
        everyone = pool + ([running] if running else [])
        warnings = self._budget_warnings(everyone)
        scale = self._scale_for(everyone, queues)
        self._learn(everyone, queues, scale)
        self._share.mixing = 0.0
        chosen, switch = self._policy.choose(Slot(
            observed=observed, model=self.model, plan=self._plan, running=running, pool=pool,
            queues=queues, scale=scale, budgets=self._budgets, config=self.config,
            gate=self._gate, learning=self._learning()))
        switched = running is None or chosen is not running or chosen.plan != self._plan
        if switched and running is not None and chosen is running:  # static: groups left or rejoined
            switch = switch_cost(observed, self.model, self._plan, chosen.plan)
        self._policy.chose(chosen.plan, running)
        if switched:
            self._version += 1
        if why_not:
            warnings.append(why_not)
        self._plan = chosen.plan
        costs = {k: float(chosen.costs.get(k, 0.0)) for k in COST_KINDS}
        self._pending = _Pending(
            MappingProxyType(dict(queues)), MappingProxyType(dict(self._budgets)),
            MappingProxyType(costs),
        )
        self._queues = updated_queues(queues, self._budgets, costs)
        decision = Decision(
            slot=self._slot,
            plan=chosen.plan,
            version=self._version,
            switched=switched,
            iteration_s=chosen.iteration_s,
            costs=MappingProxyType(costs),
            queues=MappingProxyType(dict(self._queues)),
            switch_cost_s=switch.seconds,
            warnings=tuple(warnings),
            switch_mb=switch.mb,
            label="running" if chosen is running else chosen.label,
            forced=running is None,
            candidates=len(pool) + (running is not None),
            held=tuple(self._gate.held) if self._gate is not None else (),
            V=scale.contract_V(list(self._budgets)),
            mix=self._share.mixing,
        )
        self._slot += 1
        return decision

    # -- state ---------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """Everything needed to resume: JSON-able, restored by :meth:`from_state`."""
        pending = None
        if self._pending is not None:
            pending = {
                "queues_before": dict(self._pending.queues_before),
                "budgets": dict(self._pending.budgets),
                "costs": dict(self._pending.costs),
            }
        return {
            "format": _STATE_FORMAT,
            "slot": self._slot,
            "version": self._version,
            "plan": None if self._plan is None else serde.plan_to_dict(self._plan),
            **self._policy.to_state(),
            "queues": dict(self._queues),
            "budgets": dict(self._budgets),
            "V": self._V,
            "pending": pending,
            "short": sorted(self._short),
            "auto": None if self._auto is None else {
                "a": self._auto.a, "w": dict(self._auto.w), "t_ref": self._auto.t_ref},
            "fresh": sorted(self._fresh),
            "carry": dict(self._carry),
            "learned": dict(self._rate.learned),
            "debt": dict(self._rate.debt),
            "mix": self._share.to_state(),
            "frontiers": self._rate.frontier_runs(),
            "front_devices": [list(d) for d in self._rate.front_devices],
            **({"gate": self._gate.to_state()} if self._gate is not None else {}),
        }

    @classmethod
    def from_state(
        cls,
        model: Model,
        job: Job,
        state: Mapping[str, Any],
        config: ControllerConfig | None = None,
        *,
        search: SearchFn | None = None,
        predict: PredictFn | None = None,
        gate: Gate | None = None,
    ) -> Controller:
        """Rebuild a controller from :meth:`to_state`; ValidationError names the field.

        A state without ``"gate"`` (written without one) leaves ``gate`` fresh."""
        if not isinstance(state, Mapping):
            raise ValidationError("state", "must be an object")
        if state.get("format") != _STATE_FORMAT:
            raise ValidationError("state.format", f"must be {_STATE_FORMAT}, got {state.get('format')!r}")
        ctl = cls(model, job, config, search=search, predict=predict, gate=gate)
        ctl._budgets = check_budgets(_mapping(state, "budgets"), "state.budgets")
        ctl._V = check_v(state.get("V"), "state.V")
        queues = check_budgets(capped(_mapping(state, "queues")), "state.queues")
        ctl._queues = {k: queues.get(k, 0.0) for k in ctl._budgets}
        ctl._slot = _count(state, "slot")
        ctl._version = _count(state, "version")
        raw_plan = state.get("plan")
        ctl._plan = None if raw_plan is None else serde.plan_from_dict(raw_plan, "state.plan")
        ctl._policy.load_state(state)
        raw_pending = state.get("pending")
        if raw_pending is not None:
            if not isinstance(raw_pending, Mapping):
                raise ValidationError("state.pending", "must be an object or null")
            ctl._pending = _Pending(
                MappingProxyType(check_budgets(capped(_mapping(raw_pending, "queues_before",
                                                                 "state.pending")),
                                                "state.pending.queues_before")),
                MappingProxyType(check_budgets(_mapping(raw_pending, "budgets", "state.pending"),
                                                "state.pending.budgets")),
                MappingProxyType(check_budgets(_mapping(raw_pending, "costs", "state.pending"),
                                                "state.pending.costs")),
            )
        short = state.get("short", [])
        if not isinstance(short, list) or any(k not in COST_KINDS for k in short):
            raise ValidationError("state.short", f"must be a list of cost kinds, got {short!r}")
        ctl._short = set(short)
        raw_auto = state.get("auto")  # absent in states written before the default V
        if raw_auto is not None:
            if not isinstance(raw_auto, Mapping):
                raise ValidationError("state.auto", "must be an object or null")
            a = check_v(raw_auto.get("a"), "state.auto.a")
            w = check_budgets(_mapping(raw_auto, "w", "state.auto"), "state.auto.w")
            t_ref = check_v(raw_auto.get("t_ref", 0.0), "state.auto.t_ref")
            ctl._auto = Scale(a, MappingProxyType(w), t_ref) if a > 0 else None
        fresh = state.get("fresh", [])
        if not isinstance(fresh, list) or any(k not in COST_KINDS for k in fresh):
            raise ValidationError("state.fresh", f"must be a list of cost kinds, got {fresh!r}")
        ctl._fresh = set(fresh) & set(ctl._budgets)
        raw_carry = state.get("carry", {})
        if not isinstance(raw_carry, Mapping):
            raise ValidationError("state.carry", "must be an object")
        ctl._carry = check_budgets(capped(raw_carry), "state.carry")
        ctl._rate.load_state(state)
        ctl._share.load_state(state.get("mix"))
        raw_gate = state.get("gate")
        if gate is not None and raw_gate is not None:
            if not isinstance(raw_gate, Mapping):
                raise ValidationError("state.gate", "must be an object")
            gate.load_state(raw_gate)
        return ctl

    # -- internals -----------------------------------------------------------

    def _settled_queues(self, observed: Cluster) -> dict[str, float]:
        """Q(t): the last update redone with the cost rates the last plan really had."""
        queues = dict(self._queues)
        pending, plan = self._pending, self._plan
        real: Mapping[str, float] | None = None
        if pending is not None and plan is not None and all(d in observed.by_id for d in plan.devices):
            real = plan_costs(observed, plan)
            redone = updated_queues(pending.queues_before, pending.budgets, real)
            queues.update({k: v for k, v in redone.items() if k in queues})
        if self._learning():
            (kind, _), = self._budgets.items()
            self._rate.settle(observed, kind)
        if pending is not None:
            self._rate.charge(pending.budgets, real if real is not None else pending.costs,
                              self._budgets)
        return {k: queues.get(k, 0.0) for k in self._budgets}

    def _candidates(self, observed: Cluster, job: Job) -> list[Candidate]:
        found: list[Candidate] = []
        if not observed.devices:
            return found
        subsets: list[Cluster] = [observed]
        if self.config.cost_subsets and self._budgets and self._policy.cost_subsets:
            subsets.extend(_cost_subsets(observed, self._budgets))
        narrow = len(observed.devices) > BIG_CLUSTER and getattr(self._search, "narrowable", False)
        pairs: list[tuple[str, str]] | None = None
        for cluster in subsets:
            try:
                if pairs:  # a big cluster's cost-aware subset: the best structures only
                    searched = self._search(cluster, self.model, job, pairs=pairs)  # type: ignore[call-arg]
                else:
                    searched = self._search(cluster, self.model, job)
                if cluster is observed and narrow:
                    pairs = structure_pairs(searched, 3)
                for cand in searched:
                    if cluster is not observed:
                        cand = replace(cand, label=f"cost-{len(observed.devices) - len(cluster.devices)}/{cand.label}")
                    found.append(cand)
            except InfeasibleError:
                continue
        found.extend(self._descent(observed, self.model, job, found))
        return found

    def _running_candidate(self, observed: Cluster) -> tuple[Candidate | None, str | None]:
        if self._plan is None:
            return None, None
        return self._policy.running(observed, self.model, self.job, self._plan, self._version)

    def _fits(self, cand: Candidate) -> bool:
        return all(cand.costs.get(k, 0.0) <= b * (1 + 1e-9) for k, b in self._budgets.items())

    def _budget_warnings(self, cands: Sequence[Candidate]) -> list[str]:
        out = []
        short = set()
        for kind, budget in self._budgets.items():
            cheapest = min(c.costs.get(kind, 0.0) for c in cands)
            if cheapest > budget * (1 + 1e-9):
                short.add(kind)
                if kind not in self._short:
                    out.append(
                        f"job.budgets.{kind}: {budget:g} is below the cheapest feasible plan "
                        f"({cheapest:g}); its queue will grow and the controller keeps to the "
                        "cheapest plans it finds"
                    )
        self._short = short
        return out

    def _job_now(self) -> Job:
        """The job as the search sees it: current budgets and V (the search does not read V)."""
        return replace(self.job, budgets=dict(self._budgets), V=self._V)

    def _scale_now(self) -> Scale | None:
        """The weights of the slot objective, where known without candidates."""
        if self._V > 0:
            return Scale(self._V, MappingProxyType(dict.fromkeys(self._budgets, 1.0)))
        return self._auto

    def _scale_for(self, cands: Sequence[Candidate], queues: dict[str, float]) -> Scale:
        """The slot's weights; with the default V, fixed here the first time (and
        after a change of budgets or V), warm-starting fresh queues."""
        known = self._scale_now()
        if known is not None:
            return known
        budgets = self._budgets
        fitting = [c for c in cands if self._fits(c)]
        if fitting:
            t_ref = min(c.iteration_s for c in fitting)
        else:  # nothing fits: the candidate least over its budgets
            def over(c: Candidate) -> float:
                return max((c.costs.get(k, 0.0) / b if b > 0 else math.inf)
                           for k, b in budgets.items())
            t_ref = min(cands, key=lambda c: (over(c), c.iteration_s)).iteration_s
        weights = {}
        for k, b in budgets.items():
            unit = b if b > 0 else min((c.costs.get(k, 0.0) for c in cands if c.costs.get(k, 0.0) > 0),
                                       default=1.0)
            weights[k] = 1.0 / max(unit, MIN_UNIT) ** 2  # 1e-200 ** 2 would be 0
        scale = Scale(self.config.default_v / max(t_ref, 1e-12), MappingProxyType(weights), t_ref)
        self._auto = scale
        if self._carry:
            queues.update({k: scale.queue(k, lam) for k, lam in self._carry.items() if k in queues})
            self._carry = {}
        if self.config.warm_start and self._policy.weighs_queues and not self._learning():
            for k in sorted(self._fresh & set(queues)):
                if queues[k] > 0.0:
                    continue
                slope = budget_multiplier([_frontier(cands, k)], budgets[k])
                if slope is not None:
                    queues[k] = scale.queue(k, slope)
        self._fresh.clear()
        return scale

    def _learning(self) -> bool:
        """Whether cost is weighed by the learned exchange rate (:mod:`.exchange_rate`)."""
        return (self._policy.weighs_queues and self._V == 0.0 and len(self._budgets) == 1
                and self.config.learn_window > 0)

    def _learn(self, cands: Sequence[Candidate], queues: dict[str, float], scale: Scale) -> None:
        """The default V with one budget: the learned exchange rate, carried in the
        queue (``Q = V * rate``)."""
        if not self._learning():
            return
        (kind, budget), = self._budgets.items()
        queues[kind] = scale.queue(kind, self._rate.learn(cands, kind, budget))


def _cost_subsets(cluster: Cluster, budgets: Mapping[str, float]) -> list[Cluster]:
    """The cluster without its least cost-efficient 1/16, 1/8, 1/4, 1/2, 3/4."""
    n = len(cluster.devices)
    if n < 2:
        return []

    def weighted_cost(d: Any) -> float:
        return sum(d.cost(k) / b if b > 0 else d.cost(k) * 1e9 for k, b in budgets.items())

    def efficiency(d: Any) -> float:
        cost = weighted_cost(d)
        return math.inf if cost <= 0 else d.tflops / cost

    worst_first = sorted(cluster.devices, key=lambda d: (efficiency(d), d.id))
    drops = sorted({max(1, round(n * f)) for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4)} - {n})
    return [cluster.without(frozenset(d.id for d in worst_first[:k])) for k in drops]


def _frontier(cands: Sequence[Candidate], kind: str) -> Frontier:
    return frontier([(c.costs.get(kind, 0.0), c.iteration_s) for c in cands])


def _mapping(obj: Mapping[str, Any], key: str, path: str = "state") -> Mapping[str, Any]:
    value = obj.get(key)
    if not isinstance(value, Mapping):
        raise ValidationError(f"{path}.{key}", "must be an object")
    return value


def _count(obj: Mapping[str, Any], key: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValidationError(f"state.{key}", f"must be an integer >= 0, got {value!r}")
    return value
