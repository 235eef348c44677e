"""Lyapunov drift-plus-penalty controller (spec v1 section 6).

One :class:`Controller` per job. Each slot, :meth:`Controller.step` takes the
cluster as the controller observes it (devices that are down are absent) and

1. *settles* the previous slot: the queues are recomputed with the cost rates
   the previous plan really had, now that this slot's observation shows the
   prices of the last slot (reports arrive after the fact);
2. asks the planner's tentative search for candidate plans (one per device
   subset and group structure) and adds the running plan, re-scored on the
   observed cluster. Under budgets it also searches the cluster without its
   least cost-efficient devices (lowest TFLOP/s per unit of budgeted cost,
   costs weighed by their budgets), dropping 1/16, 1/8, 1/4, 1/2 and 3/4 of
   them: the planner drops the *slowest* devices, which are often the cheap
   ones, so without this the cheap end of the trade-off would be missing;
3. picks the candidate minimising ``V * T + sum_k Q_k * c_k`` (policy
   ``lyapunov``), where a candidate other than the running plan also pays the
   time it takes to switch to it (:mod:`hetpilot.planner.switching`) spread
   over the slot's iterations, and switches only when that beats the running
   plan by ``hysteresis * V * T_running`` (so plans do not flap on noise);
4. updates the virtual queues ``Q_k(t+1) = max(Q_k + c_k - budget_k, 0)``.

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

The same object runs the simulator's comparison policies (``fastest``,
``budget-greedy``, ``static``), chosen by :attr:`ControllerConfig.policy`, so
every policy shares the running-plan bookkeeping, switching cost and handling
of devices that go down. A budget below the cheapest plan the search finds
is a warning in :attr:`Decision.warnings`; the controller then does its best
(the queue grows and pushes it to the cheapest plans). When no plan fits at
all, :meth:`step` raises :class:`~hetpilot.planner.errors.InfeasibleError`
and the controller's state is unchanged.

Pure: no grpc, asyncio or torch. The daemon and the simulator both drive it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

from . import serde
from .candidates import Candidate, plan_costs
from .elastic import surviving_plan
from .errors import InfeasibleError, ValidationError
from .refmodel import evaluate
from .switching import SwitchCost, switch_cost
from .types import COST_KINDS, Cluster, Job, Model, Plan

__all__ = ["POLICIES", "Controller", "ControllerConfig", "Decision", "Gate", "PlannerSearch",
           "PredictFn", "SearchFn", "planner_search"]

#: Policies one controller can run (``lyapunov`` is the product; the rest are
#: the simulator's comparison points).
POLICIES = ("lyapunov", "fastest", "budget-greedy", "static", "static-replan")

#: The tentative search: cluster, model, job -> scored candidate plans.
SearchFn = Callable[[Cluster, Model, Job], Sequence[Candidate]]

#: Observed cluster -> the cluster predicted for the next slot.
PredictFn = Callable[[Cluster], Cluster]


class Gate(Protocol):
    """Decides whether a switch away from a working plan may happen."""

    held: list[str]

    def observe(self, cluster: Cluster) -> None:
        """See this slot's (predicted) cluster; called once per step."""
        ...

    def admit(self, *, running_s: float, candidate_s: float, switch_s: float,
              iterations_left: float) -> bool:
        """``running_s``/``candidate_s``: objective per iteration in seconds
        (``score / V``); ``switch_s``: switching time; ``iterations_left``:
        iterations in the slot."""
        ...

    def to_state(self) -> dict[str, Any]: ...

    def load_state(self, state: Mapping[str, Any]) -> None: ...


_STATE_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    slot_s: float = 60.0
    """Wall-clock length of one slot (an epoch), used to weigh switching cost
    when ``iterations_per_slot`` is not given (iterations = slot_s / T)."""
    hysteresis: float = 0.02
    """Switch only when the predicted saving, net of the switching cost, beats
    the running plan by this fraction of its ``V * T`` term."""
    iterations_per_slot: int | None = None
    """Iterations in one slot (epoch size / global batch), if known."""
    cost_subsets: bool = True
    """Also search without the least cost-efficient devices when budgets are set."""
    policy: str = "lyapunov"
    """One of :data:`POLICIES`: ``lyapunov`` minimises ``V*T + sum Q*c``;
    ``fastest`` ignores budgets; ``budget-greedy`` takes the fastest candidate
    whose cost rates fit the budgets this slot; ``static`` plans once like
    budget-greedy and keeps that plan: while devices of it are down, the
    groups that lost one stop and the others take their samples
    (:mod:`hetpilot.planner.elastic`), and they rejoin when the devices return;
    only when no group survives does it re-plan (and keep that plan).
    ``static-replan`` is the kinder reading: it re-plans from scratch on the
    devices that are up as soon as one of its plan's devices goes down, and
    keeps the new plan after the device returns."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.slot_s) and self.slot_s > 0):
            raise ValidationError("config.slot_s", f"must be > 0, got {self.slot_s}")
        if not (math.isfinite(self.hysteresis) and self.hysteresis >= 0):
            raise ValidationError("config.hysteresis", f"must be >= 0, got {self.hysteresis}")
        if self.iterations_per_slot is not None and self.iterations_per_slot < 1:
            raise ValidationError(
                "config.iterations_per_slot", f"must be >= 1, got {self.iterations_per_slot}"
            )
        if self.policy not in POLICIES:
            raise ValidationError(
                "config.policy", f"must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )


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
        from .search import candidate_plans

        return candidate_plans(cluster, model, job, focus=3, pairs=pairs)


#: The default search, shared: the planner's memo of cuts is process-wide anyway.
planner_search = PlannerSearch()


def _check_budgets(budgets: Mapping[str, Any], path: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind, value in budgets.items():
        if kind not in COST_KINDS:
            raise ValidationError(f"{path}.{kind}", f"unknown cost kind; known: {', '.join(COST_KINDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValidationError(f"{path}.{kind}", f"must be a finite number, got {value!r}")
        if value < 0:
            raise ValidationError(f"{path}.{kind}", f"must be >= 0, got {value}")
        out[kind] = float(value)
    return out


def _check_v(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValidationError(path, f"must be a finite number, got {value!r}")
    if value <= 0:
        raise ValidationError(path, f"must be > 0, got {value}")
    return float(value)


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
        self._budgets = _check_budgets(job.budgets, "job.budgets")
        self._V = _check_v(job.V, "job.V")
        self._queues: dict[str, float] = {k: 0.0 for k in self._budgets}
        self._plan: Plan | None = None
        self._origin: Plan | None = None  # policy static: the plan chosen once
        self._version = 0
        self._slot = 0
        self._pending: _Pending | None = None
        self._short: set[str] = set()  # budgets currently below the cheapest candidate

    # -- public surface ------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        return self._plan

    @property
    def version(self) -> int:
        return self._version

    @property
    def queues(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._queues))

    @property
    def budgets(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._budgets))

    @property
    def V(self) -> float:
        return self._V

    def set_budgets(
        self, budgets: Mapping[str, float] | None = None, V: float | None = None
    ) -> None:
        """Change the budgets (the whole mapping) and/or V from the next slot on.

        A new cost kind starts with an empty queue; a kind no longer budgeted
        loses its queue. Raises ValidationError naming the field.
        """
        new_budgets = None if budgets is None else _check_budgets(budgets, "budgets")
        new_v = None if V is None else _check_v(V, "V")
        if new_budgets is not None:
            self._budgets = new_budgets
            self._queues = {k: self._queues.get(k, 0.0) for k in new_budgets}
            self._short &= set(new_budgets)
        if new_v is not None:
            self._V = new_v

    def candidates(self, observed: Cluster) -> list[Candidate]:
        """The plans a slot on ``observed`` weighs (the search and the cost-aware
        subsets), without choosing: for benchmarks that bound what any policy
        choosing among them could do."""
        return self._candidates(observed, replace(self.job, budgets=dict(self._budgets), V=self._V))

    def step(self, observed: Cluster) -> Decision:
        """Decide the plan for the next slot on the ``observed`` cluster."""
        queues = self._settled_queues(observed)
        if self._predict is not None:
            observed = self._predict(observed)
        if self._gate is not None:
            self._gate.observe(observed)
            self._gate.held.clear()
        job = replace(self.job, budgets=dict(self._budgets), V=self._V)
        running, why_not = self._running_candidate(observed)
        keeps = self.config.policy in ("static", "static-replan") and running is not None
        found = [] if keeps else self._candidates(observed, job)  # nothing to choose
        pool = [c for c in found if running is None or c.plan != running.plan]
        if running is None and not pool:
            raise InfeasibleError("no plan fits the observed cluster's memory")
        warnings = self._budget_warnings(pool + ([running] if running else []))
        chosen, switch = self._choose(observed, running, pool, queues)
        switched = running is None or chosen is not running or chosen.plan != self._plan
        if switched and running is not None and chosen is running:  # static: groups left or rejoined
            switch = switch_cost(observed, self.model, self._plan, chosen.plan)
        if self.config.policy == "static" and (self._origin is None or running is None):
            self._origin = chosen.plan
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
        self._queues = self._updated(queues, self._budgets, costs)
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
            "origin": None if self._origin is None else serde.plan_to_dict(self._origin),
            "queues": dict(self._queues),
            "budgets": dict(self._budgets),
            "V": self._V,
            "pending": pending,
            "short": sorted(self._short),
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
        ctl._budgets = _check_budgets(_mapping(state, "budgets"), "state.budgets")
        ctl._V = _check_v(state.get("V"), "state.V")
        queues = _check_budgets(_mapping(state, "queues"), "state.queues")
        ctl._queues = {k: queues.get(k, 0.0) for k in ctl._budgets}
        ctl._slot = _count(state, "slot")
        ctl._version = _count(state, "version")
        raw_plan = state.get("plan")
        ctl._plan = None if raw_plan is None else serde.plan_from_dict(raw_plan, "state.plan")
        raw_origin = state.get("origin")
        ctl._origin = None if raw_origin is None else serde.plan_from_dict(raw_origin, "state.origin")
        raw_pending = state.get("pending")
        if raw_pending is not None:
            if not isinstance(raw_pending, Mapping):
                raise ValidationError("state.pending", "must be an object or null")
            ctl._pending = _Pending(
                MappingProxyType(_check_budgets(_mapping(raw_pending, "queues_before", "state.pending"),
                                                "state.pending.queues_before")),
                MappingProxyType(_check_budgets(_mapping(raw_pending, "budgets", "state.pending"),
                                                "state.pending.budgets")),
                MappingProxyType(_check_budgets(_mapping(raw_pending, "costs", "state.pending"),
                                                "state.pending.costs")),
            )
        short = state.get("short", [])
        if not isinstance(short, list) or any(k not in COST_KINDS for k in short):
            raise ValidationError("state.short", f"must be a list of cost kinds, got {short!r}")
        ctl._short = set(short)
        raw_gate = state.get("gate")
        if gate is not None and raw_gate is not None:
            if not isinstance(raw_gate, Mapping):
                raise ValidationError("state.gate", "must be an object")
            gate.load_state(raw_gate)
        return ctl

    # -- internals -----------------------------------------------------------

    @staticmethod
    def _updated(
        queues: Mapping[str, float], budgets: Mapping[str, float], costs: Mapping[str, float]
    ) -> dict[str, float]:
        return {k: max(queues.get(k, 0.0) + costs.get(k, 0.0) - b, 0.0) for k, b in budgets.items()}

    def _settled_queues(self, observed: Cluster) -> dict[str, float]:
        """Q(t): the last update redone with the cost rates the last plan really had."""
        queues = dict(self._queues)
        pending, plan = self._pending, self._plan
        if pending is not None and plan is not None and all(d in observed.by_id for d in plan.devices):
            real = plan_costs(observed, plan)
            redone = self._updated(pending.queues_before, pending.budgets, real)
            queues.update({k: v for k, v in redone.items() if k in queues})
        return {k: queues.get(k, 0.0) for k in self._budgets}

    def _candidates(self, observed: Cluster, job: Job) -> list[Candidate]:
        found: list[Candidate] = []
        if not observed.devices:
            return found
        subsets: list[Cluster] = [observed]
        if self.config.cost_subsets and self._budgets and self.config.policy != "fastest":
            subsets.extend(_cost_subsets(observed, self._budgets))
        from .search import BIG_CLUSTER, structure_pairs

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
        return found

    def _running_candidate(self, observed: Cluster) -> tuple[Candidate | None, str | None]:
        plan = self._plan
        if plan is None:
            return None, None
        if self.config.policy == "static" and self._origin is not None:
            return self._static_candidate(observed)
        missing = [d for d in plan.devices if d not in observed.by_id]
        if missing:
            return None, f"plan v{self._version} uses devices no longer present ({', '.join(missing[:4])}); re-planned"
        ev = evaluate(observed, self.model, plan, self.job.global_batch)
        if not ev.valid or ev.iteration_s is None:
            return None, f"plan v{self._version} is no longer valid ({ev.error}); re-planned"
        return Candidate(plan, ev.iteration_s, plan_costs(observed, plan), "running"), None

    def _static_candidate(self, observed: Cluster) -> tuple[Candidate | None, str | None]:
        """The plan chosen once, less the groups that lost a device (see :mod:`.elastic`)."""
        assert self._origin is not None
        plan = surviving_plan(self._origin, observed, self.model, self.job.global_batch)
        if plan is None:
            return None, (f"static: no group of the plan chosen once can run on the devices "
                          f"that are up; re-planned (plan v{self._version + 1} is kept from now on)")
        ev = evaluate(observed, self.model, plan, self.job.global_batch)
        if not ev.valid or ev.iteration_s is None:
            return None, f"static: the plan chosen once is no longer valid ({ev.error}); re-planned"
        why = None
        if plan != self._plan:
            kept = len(plan.groups)
            why = (f"static: {len(self._origin.groups) - kept} group(s) of the plan chosen once "
                   f"wait for down devices; the other {kept} take their samples"
                   if plan is not self._origin else
                   "static: every device of the plan chosen once is up; its groups rejoin")
        return Candidate(plan, ev.iteration_s, plan_costs(observed, plan), "running"), why

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

    def _choose(
        self,
        observed: Cluster,
        running: Candidate | None,
        pool: list[Candidate],
        queues: Mapping[str, float],
    ) -> tuple[Candidate, SwitchCost]:
        policy = self.config.policy
        no_switch = SwitchCost(0.0, 0.0)
        if policy in ("static", "static-replan") and running is not None:
            return running, no_switch
        if policy in ("budget-greedy", "static", "static-replan") and self._budgets:
            everyone = pool + ([running] if running else [])
            fitting = [c for c in everyone if self._fits(c)]
            if not fitting:  # nothing fits: the least over budget, relative to each budget
                def excess(c: Candidate) -> float:
                    return sum(max(c.costs.get(k, 0.0) - b, 0.0) / max(b, 1e-9)
                               for k, b in self._budgets.items())
                least = min(excess(c) for c in everyone)
                fitting = [c for c in everyone if excess(c) <= least * (1 + 1e-9)]
            if running is not None and running not in fitting:
                running = None  # must move: the running plan breaks the budget
            pool = [c for c in fitting if c is not running]
            if not pool:
                assert running is not None
                return running, no_switch
        scored_q: Mapping[str, float] = queues if policy == "lyapunov" else {}
        V = self._V

        def score(c: Candidate) -> float:
            return c.score(V, scored_q)

        pool.sort(key=score)
        best: Candidate | None = None
        best_eff, best_switch = math.inf, no_switch
        for cand in pool:
            raw = score(cand)
            if raw >= best_eff:
                break  # penalties are >= 0: nothing later can win
            sw = switch_cost(observed, self.model, self._plan, cand.plan)
            eff = raw + V * self._per_iteration(sw.seconds, cand.iteration_s)
            if eff < best_eff:
                best, best_eff, best_switch = cand, eff, sw
        if running is None:
            assert best is not None
            return best, best_switch
        keep = score(running)
        better = best is not None and best_eff < keep - self.config.hysteresis * V * running.iteration_s
        if better and best is not None and (self._gate is None or self._gate.admit(
            running_s=keep / V, candidate_s=score(best) / V, switch_s=best_switch.seconds,
            iterations_left=self._iterations(best.iteration_s),
        )):
            return best, best_switch
        return running, no_switch

    def _iterations(self, iteration_s: float) -> float:
        """Iterations one slot holds (config, else slot_s / iteration time)."""
        n = self.config.iterations_per_slot
        if n is None:
            return max(self.config.slot_s / max(iteration_s, 1e-12), 1.0)
        return float(n)

    def _per_iteration(self, switch_s: float, iteration_s: float) -> float:
        """Switching time spread over the slot's iterations (seconds per iteration)."""
        if switch_s == 0.0:
            return 0.0
        n = self.config.iterations_per_slot
        if n is None:
            n_f = max(self.config.slot_s / max(iteration_s, 1e-12), 1.0)
            return switch_s / n_f
        return switch_s / n


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
