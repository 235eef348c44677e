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

That is the contract, used as it stands when the job gives its V. ``V = 0``
(:data:`DEFAULT_V`) means the job gives none, and V's units (seconds against
($/h)^2: ``Q / V`` is an exchange rate in seconds per $/h) are not the job
owner's problem (issue 17): with one budget the controller learns the rate
from the cost/time frontiers of the last slots (the offline oracle's linear
programme solved on the past, at the budget less the debt so far spread over
``repay_slots``), carries it as the queue ``Q = V_eff * rate``, and where no
plan sits at the budget while prices hold still it time-shares the two plans
that straddle it on a schedule of slots whose switches are paid for
(:meth:`Controller._mix`). With several budgets the default is the
drift-plus-penalty normalised by the budgets and the job's iteration time.
See docs/controller.md.

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

import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from . import serde
from .candidates import (
    Candidate,
    Frontier,
    budget_multiplier,
    frontier,
    lower_hull,
    plan_costs,
    tie_share,
)
from .elastic import surviving_plan
from .errors import InfeasibleError, ValidationError
from .refmodel import evaluate
from .switching import SwitchCost, switch_cost
from .types import COST_KINDS, DEFAULT_V, Cluster, Job, Model, Plan, budget_problem

__all__ = ["DEFAULT_V", "POLICIES", "Controller", "ControllerConfig", "Decision", "Gate",
           "PlannerSearch", "PredictFn", "SearchFn", "planner_search"]


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


_MIN_UNIT = 1e-9
"""A budget below this (in its own unit) is weighed as this in the default V's scale."""

_MAX_QUEUE = 1e150
"""The largest virtual queue (and shadow price) kept. A queue carried across a change
of V is its shadow price rescaled (``q * w / V``): a V near the smallest float (a
request may set 5e-324) would make it infinite, and the state then could not be
stored or read back. 1e150 still outweighs any cost times any iteration time, and
its squares and products with the weights stay finite."""


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
    local_search_budget: int = 24
    """On 5-16 devices: mappings the local search (:class:`~.carried_descent.CarriedDescent`)
    plans per schedule per slot, resuming from the last slot's best; 0 turns it off."""
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

    default_v: float = 25.0
    """How the default (a job giving ``V = 0``) reports its V and, with several
    budgets, weighs: ``V = default_v * b**2 / T_ref`` for a budget ``b``, with
    ``T_ref`` the iteration time of the fastest plan that fits the budgets on
    the first slot (:attr:`Controller.effective_V`). Read it as the backlog, in
    slots' worth of budget, at which 1% of cost is worth 1% of iteration time.
    With one budget the default learns its exchange rate instead
    (``learn_window``), and this only sets the units the queue is reported in."""
    warm_start: bool = True
    """With the default V and several budgets: start each queue at the backlog
    whose shadow price puts the first slot's choice at the budget (the slope of
    the candidates' cost/time frontier there) instead of at 0. A job's explicit
    V keeps the contract's empty start."""
    learn_window: int = 300
    """With the default V and one budget: the controller keeps the cost/time
    frontiers of the last ``learn_window`` slots it observed and weighs cost by
    the exchange rate (seconds per unit of cost rate) that would have held the
    budget over them: the offline oracle's linear programme solved on the
    past (:func:`~hetpilot.planner.candidates.budget_multiplier`). 0: no
    learning (the normalised drift-plus-penalty of ``default_v``)."""
    learn_smoothing: float = 0.01
    """With a learned rate: the rate comes from the entropy-regularised
    programme over the window (each slot's choice a softmin with a temperature
    of this fraction of its fastest iteration time;
    :func:`~hetpilot.planner.candidates.budget_multiplier`'s ``smooth``)
    instead of the linear programme itself. The linear programme's rate pins
    to a kink of frontiers that recur in the window while the target sits in
    the jump of spend there, and the debt then moves nothing until it carries
    the target past the jump; the smoothed rate follows the target. 0: the
    linear programme."""
    repay_slots: int = 25
    """With a learned rate: spending over (under) the budget so far is repaid
    (spent) over about this many slots, by learning the rate at
    ``budget - debt / repay_slots``."""
    max_credit: float = 1.0
    """With a learned rate: unspent budget is banked, but the target it allows
    stays below ``(1 + max_credit) * budget``."""
    repay_rate: float = 1.0
    """With a learned rate: a debt is repaid no faster than at ``1 + repay_rate``
    times the rate that holds the budget itself: where ``repay_slots`` would
    ask for more (the frontier has a gap below the budget, so repaying fast
    means a much slower plan), the debt is spread over twice as many slots,
    and again, up to ``repay_max_slots``. 0: always ``repay_slots``."""
    repay_max_slots: int = 200
    """The longest a debt is spread over (see ``repay_rate``)."""
    mix: bool = True
    """With a learned rate: where the rate sits on the kink between two plans
    that straddle the budget (no plan near it), time-share them on a schedule
    of whole slots whose switches are paid for (:meth:`Controller._mix`)."""
    mix_overhead: float = 0.03
    """A time-sharing cycle is made long enough that its two switches cost at
    most this fraction of what mixing gains over the cheaper plan alone."""
    mix_max_cycle: int = 50
    """Longest time-sharing cycle in slots; when even that does not amortise the
    switches, the controller does not mix."""
    mix_after: int = 25
    """Time-share only once this many slots have shown the same frontier. Before
    that the smoothed rate (``learn_smoothing``) shares through the debt: on the
    trace library a schedule made on the first few slots of a price level lost
    speed (mean gap to the oracle 3.07% with schedules from the first slot,
    3.03% from the 10th, 2.97% from the 25th, the same as never)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.default_v) and self.default_v > 0):
            raise ValidationError("config.default_v", f"must be > 0, got {self.default_v}")
        if not (math.isfinite(self.slot_s) and self.slot_s > 0):
            raise ValidationError("config.slot_s", f"must be > 0, got {self.slot_s}")
        if not (math.isfinite(self.hysteresis) and self.hysteresis >= 0):
            raise ValidationError("config.hysteresis", f"must be >= 0, got {self.hysteresis}")
        for name in ("learn_window", "repay_slots", "mix_max_cycle", "repay_max_slots", "mix_after",
                     "local_search_budget"):
            low = 0 if name in ("learn_window", "local_search_budget") else 1
            if getattr(self, name) < low:
                raise ValidationError(f"config.{name}", f"must be >= {low}, got {getattr(self, name)}")
        for name in ("max_credit", "mix_overhead", "repay_rate", "learn_smoothing"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValidationError(f"config.{name}", f"must be >= 0, got {getattr(self, name)}")
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
        from .search import candidate_plans

        return candidate_plans(cluster, model, job, focus=3, pairs=pairs)


#: The default search, shared: the planner's memo of cuts is process-wide anyway.
planner_search = PlannerSearch()


def _check_budgets(budgets: Mapping[str, Any], path: str, *, rates: bool = False
                   ) -> dict[str, float]:
    """Per cost kind, finite numbers >= 0 (queues, debts' bounds); with ``rates``,
    budgets (:func:`~hetpilot.planner.types.budget_problem`: 0 or in [1e-9, 1e12])."""
    out: dict[str, float] = {}
    for kind, value in budgets.items():
        if kind not in COST_KINDS:
            raise ValidationError(f"{path}.{kind}", f"unknown cost kind; known: {', '.join(COST_KINDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValidationError(f"{path}.{kind}", f"must be a finite number, got {value!r}")
        if value < 0:
            raise ValidationError(f"{path}.{kind}", f"must be >= 0, got {value}")
        if rates and (problem := budget_problem(float(value))) is not None:
            raise ValidationError(f"{path}.{kind}", problem)
        out[kind] = float(value)
    return out


def _check_v(value: Any, path: str) -> float:
    """A finite V >= 0; 0 (:data:`DEFAULT_V`) means the job gives none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValidationError(path, f"must be a finite number, got {value!r}")
    if value < 0:
        raise ValidationError(path, f"must be > 0, or 0 for the default, got {value}")
    return float(value)


@dataclass(frozen=True)
class _Scale:
    """How the default V weighs a slot: ``a * T + sum_k w_k * Q_k * c_k``."""

    a: float
    """Weight of the iteration time (the job's V, or default_v / T_ref)."""
    w: Mapping[str, float]
    """Weight of each queue (1 with the job's V, 1 / b_k**2 with the default)."""
    t_ref: float = 0.0
    """The default's reference iteration time (0 with the job's own V)."""

    def objective(self, cand: Candidate, queues: Mapping[str, float]) -> float:
        return cand.score(self.a, {k: self.w.get(k, 1.0) * q for k, q in queues.items()})

    def shadow(self, kind: str, queue: float) -> float:
        """Seconds of iteration time a unit of cost rate of ``kind`` is worth."""
        return min(self.w.get(kind, 1.0) * queue / self.a, _MAX_QUEUE)

    def queue(self, kind: str, shadow: float) -> float:
        return min(shadow * self.a / self.w.get(kind, 1.0), _MAX_QUEUE)

    def contract_V(self, kinds: Sequence[str]) -> float:
        """The contract's V equivalent to this scale for the first kind."""
        if not kinds:
            return self.a
        return self.a / self.w.get(kinds[0], 1.0)


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
        self._budgets = _check_budgets(job.budgets, "job.budgets", rates=True)
        self._V = _check_v(job.V, "job.V")
        self._queues: dict[str, float] = {k: 0.0 for k in self._budgets}
        self._plan: Plan | None = None
        self._origin: Plan | None = None  # policy static: the plan chosen once
        self._version = 0
        self._slot = 0
        self._pending: _Pending | None = None
        self._short: set[str] = set()  # budgets currently below the cheapest candidate
        # the default V (job V = 0): its scale, fixed on the first slot that needs it
        self._auto: _Scale | None = None
        self._fresh: set[str] = set(self._budgets)  # queues the default V may warm-start
        self._carry: dict[str, float] = {}  # shadow prices to keep across a change of scale
        # the default V's learned multiplier: frontiers seen, shadow price in the queue
        self._frontiers: deque[Frontier] = deque(maxlen=max(self.config.learn_window, 1))
        # what each frontier's points really cost in their slot (known a slot later:
        # the decision saw the previous slot's prices), and the last one's devices
        self._paid: deque[np.ndarray] = deque(maxlen=max(self.config.learn_window, 1))
        self._front_devices: list[tuple[str, ...]] = []
        self._learned: dict[str, float] = {}
        self._debt: dict[str, float] = {}  # spending over (+) or under (-) the budget, settled
        self._mixing = 0.0  # this slot's time-sharing share (Decision.mix)
        self._mix_pair: list[float] | None = None  # the schedule's two plans (costs, times)
        self._mix_err = 0.0  # its running total of cost over the target (cost rate x slots)
        self._tie_dear = False  # this slot's ties go to the dearer plan (tie_share 1)
        self._horizon = float(self.config.repay_slots)  # slots this slot's debt is spread over
        from .carried_descent import CarriedDescent

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
        new_budgets = None if budgets is None else _check_budgets(budgets, "budgets", rates=True)
        new_v = None if V is None else _check_v(V, "V")
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
                self._frontiers.clear()
                self._paid.clear()
                self._front_devices = []
                self._learned = {}
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
        keeps = self.config.policy in ("static", "static-replan") and running is not None
        found = [] if keeps else self._candidates(observed, job)  # nothing to choose
        pool = [c for c in found if running is None or c.plan != running.plan]
        if running is None and not pool:
            raise InfeasibleError("no plan fits the observed cluster's memory")
        everyone = pool + ([running] if running else [])
        warnings = self._budget_warnings(everyone)
        scale = self._scale_for(everyone, queues)
        self._learn(everyone, queues, scale)
        self._mixing = 0.0
        chosen, switch = self._choose(observed, running, pool, queues, scale)
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
            V=scale.contract_V(list(self._budgets)),
            mix=self._mixing,
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
            "auto": None if self._auto is None else {
                "a": self._auto.a, "w": dict(self._auto.w), "t_ref": self._auto.t_ref},
            "fresh": sorted(self._fresh),
            "carry": dict(self._carry),
            "learned": dict(self._learned),
            "debt": dict(self._debt),
            "mix": None if self._mix_pair is None else {"pair": list(self._mix_pair),
                                                        "err": self._mix_err},
            "frontiers": _frontier_runs(self._frontiers, self._paid),
            "front_devices": [list(d) for d in self._front_devices],
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
        queues = _check_budgets(_capped(_mapping(state, "queues")), "state.queues")
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
                MappingProxyType(_check_budgets(_capped(_mapping(raw_pending, "queues_before",
                                                                 "state.pending")),
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
        raw_auto = state.get("auto")  # absent in states written before the default V
        if raw_auto is not None:
            if not isinstance(raw_auto, Mapping):
                raise ValidationError("state.auto", "must be an object or null")
            a = _check_v(raw_auto.get("a"), "state.auto.a")
            w = _check_budgets(_mapping(raw_auto, "w", "state.auto"), "state.auto.w")
            t_ref = _check_v(raw_auto.get("t_ref", 0.0), "state.auto.t_ref")
            ctl._auto = _Scale(a, MappingProxyType(w), t_ref) if a > 0 else None
        fresh = state.get("fresh", [])
        if not isinstance(fresh, list) or any(k not in COST_KINDS for k in fresh):
            raise ValidationError("state.fresh", f"must be a list of cost kinds, got {fresh!r}")
        ctl._fresh = set(fresh) & set(ctl._budgets)
        raw_carry = state.get("carry", {})
        if not isinstance(raw_carry, Mapping):
            raise ValidationError("state.carry", "must be an object")
        ctl._carry = _check_budgets(_capped(raw_carry), "state.carry")
        raw_learned = state.get("learned", {})
        if not isinstance(raw_learned, Mapping):
            raise ValidationError("state.learned", "must be an object")
        ctl._learned = _check_budgets(raw_learned, "state.learned")
        raw_debt = state.get("debt", {})
        if not isinstance(raw_debt, Mapping) or any(
                k not in COST_KINDS or isinstance(v, bool) or not isinstance(v, (int, float))
                or not math.isfinite(v) for k, v in raw_debt.items()):
            raise ValidationError("state.debt", "must map cost kinds to finite numbers")
        ctl._debt = {k: float(v) for k, v in raw_debt.items()}
        raw_mix = state.get("mix")
        if raw_mix is not None:
            pair = raw_mix.get("pair") if isinstance(raw_mix, Mapping) else None
            err = raw_mix.get("err") if isinstance(raw_mix, Mapping) else None
            if (not isinstance(pair, list) or len(pair) != 4 or not isinstance(err, (int, float))
                    or not all(isinstance(v, (int, float)) for v in pair)):
                raise ValidationError("state.mix", "must be null or {pair: 4 numbers, err: number}")
            ctl._mix_pair, ctl._mix_err = [float(v) for v in pair], float(err)
        ctl._frontiers.clear()
        ctl._paid.clear()
        raw_frontiers = state.get("frontiers", [])
        if not isinstance(raw_frontiers, list):
            raise ValidationError("state.frontiers", "must be a list")
        for i, run in enumerate(raw_frontiers):
            try:
                count, c, t, *rest = run[0], *(np.array(x, dtype=float) for x in run[1:])
            except (TypeError, ValueError, IndexError) as exc:
                raise ValidationError(f"state.frontiers[{i}]", "must be [count, costs, times]") from exc
            paid = rest[0] if rest else c
            if (isinstance(count, bool) or not isinstance(count, int) or count < 1
                    or len(run) not in (3, 4) or c.shape != t.shape or c.ndim != 1
                    or paid.shape != c.shape
                    or not (np.isfinite(c).all() and np.isfinite(t).all() and np.isfinite(paid).all())):
                raise ValidationError(f"state.frontiers[{i}]", "must be [count >= 1, costs, times] "
                                      "or [count, costs, times, paid] with lists of numbers of one length")
            n = min(count, ctl._frontiers.maxlen or count)
            ctl._frontiers.extend((c, t) for _ in range(n))
            ctl._paid.extend(paid for _ in range(n))
        raw_devices = state.get("front_devices", [])
        if not isinstance(raw_devices, list) or any(
                not isinstance(d, list) or not all(isinstance(x, str) for x in d) for d in raw_devices):
            raise ValidationError("state.front_devices", "must be a list of lists of device ids")
        ctl._front_devices = [tuple(d) for d in raw_devices]
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
        return {k: min(max(queues.get(k, 0.0) + costs.get(k, 0.0) - b, 0.0), _MAX_QUEUE)
                for k, b in budgets.items()}

    def _settled_queues(self, observed: Cluster) -> dict[str, float]:
        """Q(t): the last update redone with the cost rates the last plan really had."""
        queues = dict(self._queues)
        pending, plan = self._pending, self._plan
        real: Mapping[str, float] | None = None
        if pending is not None and plan is not None and all(d in observed.by_id for d in plan.devices):
            real = plan_costs(observed, plan)
            redone = self._updated(pending.queues_before, pending.budgets, real)
            queues.update({k: v for k, v in redone.items() if k in queues})
        self._settle_frontier(observed)
        if pending is not None:
            paid = real if real is not None else pending.costs
            for k, b in pending.budgets.items():
                if k in self._budgets:
                    self._debt[k] = self._debt.get(k, 0.0) + paid.get(k, 0.0) - b
        return {k: queues.get(k, 0.0) for k in self._budgets}

    def _candidates(self, observed: Cluster, job: Job) -> list[Candidate]:
        found: list[Candidate] = []
        if not observed.devices:
            return found
        subsets: list[Cluster] = [observed]
        if self.config.cost_subsets and self._budgets and self.config.policy != "fastest":
            subsets.extend(_cost_subsets(observed, self._budgets))
        from .search import structure_pairs
        from .structures import BIG_CLUSTER

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

    def _job_now(self) -> Job:
        """The job as the search sees it: current budgets and V (the search does not read V)."""
        return replace(self.job, budgets=dict(self._budgets), V=self._V)

    def _scale_now(self) -> _Scale | None:
        """The weights of the slot objective, where known without candidates."""
        if self._V > 0:
            return _Scale(self._V, MappingProxyType(dict.fromkeys(self._budgets, 1.0)))
        return self._auto

    def _scale_for(self, cands: Sequence[Candidate], queues: dict[str, float]) -> _Scale:
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
            weights[k] = 1.0 / max(unit, _MIN_UNIT) ** 2  # 1e-200 ** 2 would be 0
        scale = _Scale(self.config.default_v / max(t_ref, 1e-12), MappingProxyType(weights), t_ref)
        self._auto = scale
        if self._carry:
            queues.update({k: scale.queue(k, lam) for k, lam in self._carry.items() if k in queues})
            self._carry = {}
        if self.config.warm_start and self.config.policy == "lyapunov" and not self._learning():
            for k in sorted(self._fresh & set(queues)):
                if queues[k] > 0.0:
                    continue
                slope = budget_multiplier([_frontier(cands, k)], budgets[k])
                if slope is not None:
                    queues[k] = scale.queue(k, slope)
        self._fresh.clear()
        return scale

    def _settle_frontier(self, observed: Cluster) -> None:
        """What the last slot's frontier plans really cost, now that ``observed``
        shows that slot's prices (a plan on a device gone keeps the cost it was
        chosen at)."""
        if not (self._learning() and self._paid and self._front_devices
                and len(self._front_devices) == len(self._paid[-1])):
            return
        (kind, _), = self._budgets.items()
        by_id = observed.by_id
        self._paid[-1] = np.array([
            sum(by_id[d].cost(kind) for d in devs) if all(d in by_id for d in devs) else seen
            for devs, seen in zip(self._front_devices, self._paid[-1], strict=True)])

    def _learning(self) -> bool:
        return (self.config.policy == "lyapunov" and self._V == 0.0 and len(self._budgets) == 1
                and self.config.learn_window > 0)

    def _learn(self, cands: Sequence[Candidate], queues: dict[str, float], scale: _Scale) -> None:
        """The default V with one budget: the exchange rate that would have held
        ``budget - debt / repay_slots`` over the frontiers of the last slots,
        carried in the queue (``Q = V * rate``)."""
        if not self._learning():
            return
        (kind, budget), = self._budgets.items()
        hull = lower_hull(cands, lambda c: (c.costs.get(kind, 0.0), c.iteration_s))
        front = (np.array([c.costs.get(kind, 0.0) for c in hull], dtype=float),
                 np.array([c.iteration_s for c in hull], dtype=float))
        self._frontiers.append(front)
        self._paid.append(front[0].copy())  # until the next slot shows what they cost
        self._front_devices = [tuple(c.plan.devices) for c in hull]
        horizon = self.config.repay_slots
        debt = max(self._debt.get(kind, 0.0), -self.config.max_credit * budget * horizon)
        self._debt[kind] = debt
        paid = self._paid
        self._horizon = float(horizon)
        smooth = self.config.learn_smoothing
        lam = budget_multiplier(self._frontiers, self._target(), paid=paid, smooth=smooth)
        rho = self.config.repay_rate
        if rho > 0 and debt > 0.0 and lam is not None:
            base = budget_multiplier(self._frontiers, budget, paid=paid, smooth=smooth)
            if base:  # repay no faster than at (1 + rho) times the rate at the budget itself
                lo_rate, hi_rate = base / (1 + rho), base * (1 + rho)
                while (lam is None or not lo_rate <= lam <= hi_rate) and \
                        self._horizon < self.config.repay_max_slots:
                    self._horizon = min(2 * self._horizon, float(self.config.repay_max_slots))
                    lam = budget_multiplier(self._frontiers, self._target(), paid=paid,
                                            smooth=smooth)
        if lam is None:  # below the cheapest plans: weigh cost as heavily as they ever do
            lam = max((float(np.max(-np.diff(t) / np.diff(c))) for c, t in self._frontiers
                       if len(c) > 1), default=self._learned.get(kind, 0.0))
        queues[kind] = scale.queue(kind, lam)
        self._learned = {kind: lam}

    def _target(self) -> float:
        """The budget less the debt spread over ``repay_slots`` (bounded)."""
        (kind, budget), = self._budgets.items()
        return budget - self._debt.get(kind, 0.0) / self._horizon

    def _choose(
        self,
        observed: Cluster,
        running: Candidate | None,
        pool: list[Candidate],
        queues: Mapping[str, float],
        scale: _Scale,
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
        if policy == "lyapunov" and self.config.mix and self._learning():
            mixed = self._mix(observed, running, pool)
            if mixed is not None:
                return mixed
            self._mix_pair = None
        scored_q: Mapping[str, float] = queues if policy == "lyapunov" else {}
        V = scale.a

        def score(c: Candidate) -> float:
            return scale.objective(c, scored_q)

        if policy == "lyapunov" and self._learning():
            # equal scores (a learned rate on the kink between two plans): the cheaper first
            sign = -1.0 if self._tie_dear else 1.0
            pool.sort(key=lambda c: (float(f"{score(c):.10g}"),
                                     sign * sum(c.costs.get(k, 0.0) for k in self._budgets)))
        else:
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

    def _mix(self, observed: Cluster, running: Candidate | None,
             pool: Sequence[Candidate]) -> tuple[Candidate, SwitchCost] | None:
        """Time-sharing of two plans as a schedule of whole slots.

        Where the learned rate sits on a kink of this slot's frontier, between
        two neighbouring plans ``lo`` (cheaper) and ``hi`` (dearer), both are
        equally good and the linear programme the rate comes from mixes them:
        of the slots where the rate ties two plans, a share ``x`` takes the
        dearer (:func:`~hetpilot.planner.candidates.tie_share`: the share that
        makes the window spend the target, the budget less the debt spread
        over ``repay_slots``, or longer: ``repay_rate``). The controller
        time-shares only where the prices have not moved over the learning
        window (every frontier in it is this slot's); then every slot ties and
        ``x = (b_t - c_lo) / (c_hi - c_lo)``. (When prices move, the rate
        already shares across slots, banking under-spending for cheap slots;
        a schedule made on moving prices lost speed on the trace library.)

        A plan runs whole slots (the trainer takes a plan per slot), so the
        mix is a cycle of ``n`` slots with two switches, each paid for
        (:func:`~hetpilot.planner.switching.switch_cost`: parameters moved
        while the trainer pauses). ``n`` is the shortest cycle whose two
        switches cost at most ``mix_overhead`` of the gain,

            (s_up + s_down) / (n * I) <= mix_overhead * x * (T_lo - T_hi)

        (``I`` iterations per slot), and at least long enough to hold one slot
        of each; beyond ``mix_max_cycle`` slots it does not mix. The schedule
        keeps ``E``, its running total of cost over ``c_x = c_lo + x (c_hi -
        c_lo)`` since it began, and runs ``hi`` until ``E >= +band``, then
        ``lo`` until ``E <= -band``, with ``band = n / (2 (1 / (c_hi - c_x) +
        1 / (c_x - c_lo)))``: one cycle lasts ``n`` slots and averages ``c_x``.
        """
        (kind, _), = self._budgets.items()
        self._tie_dear = False
        lam = self._learned.get(kind)
        if not lam:
            return None
        now_c, now_t = self._frontiers[-1]
        if len(self._frontiers) < self.config.mix_after:
            return None  # too few slots to call the frontier still: the smoothed rate shares
        if any(len(c) != len(now_c) or not (np.array_equal(c, now_c) and np.array_equal(t, now_t))
               for c, t in self._frontiers):
            return None  # prices moved within the window: the rate banks across them instead
        # a smoothed rate (learn_smoothing) lies near the kink, not on it: a tie is a rate
        # at which the softmin still gives both plans over 0.7% (|gap| <= 5 temperatures)
        tol_s = 5.0 * self.config.learn_smoothing * float(np.min(now_t)) if len(now_t) else 0.0
        lo, hi = _kink(([running] if running is not None else []) + list(pool), kind, lam, tol_s)
        if lo is None or hi is None:
            return None
        slope = (lo.iteration_s - hi.iteration_s) / (hi.costs.get(kind, 0.0) - lo.costs.get(kind, 0.0))
        x = tie_share(self._frontiers, slope, self._target(), paid=self._paid)
        if x >= 1 - 1e-9:
            self._tie_dear = True  # every tie to the dearer plan: no schedule needed
            return None
        if x <= 1e-9:
            return None
        c_lo, c_hi = lo.costs.get(kind, 0.0), hi.costs.get(kind, 0.0)
        c_x = c_lo + x * (c_hi - c_lo)
        up = switch_cost(observed, self.model, lo.plan, hi.plan).seconds
        down = switch_cost(observed, self.model, hi.plan, lo.plan).seconds
        gain = x * (lo.iteration_s - hi.iteration_s) * self._iterations(lo.iteration_s)
        need = (up + down) / (self.config.mix_overhead * gain) if up + down > 0 else 0.0
        if need > self.config.mix_max_cycle:
            return None
        n = max(math.ceil(need - 1e-3), math.ceil(1 / x - 1e-3), math.ceil(1 / (1 - x) - 1e-3), 2)
        if n > self.config.mix_max_cycle:
            return None
        band = n / (2 * (1 / (c_hi - c_x) + 1 / (c_x - c_lo)))
        pair = [float(f"{v:.9g}") for v in (c_lo, c_hi, lo.iteration_s, hi.iteration_s)]
        if pair != self._mix_pair:  # a new schedule: its own running total
            self._mix_pair, self._mix_err = pair, 0.0
        err = self._mix_err
        on = None if running is None else running.plan
        slack = 1e-4 * band  # E lands on the band edges in whole steps: compare loosely
        if on == hi.plan:
            pick = lo if err >= band - slack else hi
        elif on == lo.plan:
            pick = hi if err <= -band + slack else lo
        else:
            pick = hi if err < 0 else lo
        self._mix_err = err + pick.costs.get(kind, 0.0) - c_x
        if running is not None and pick.plan == running.plan:
            self._mixing = x
            return running, SwitchCost(0.0, 0.0)
        sw = switch_cost(observed, self.model, self._plan, pick.plan)
        if running is not None and self._gate is not None and not self._gate.admit(
                running_s=running.iteration_s + lam * running.costs.get(kind, 0.0),
                candidate_s=pick.iteration_s + lam * pick.costs.get(kind, 0.0),
                switch_s=sw.seconds, iterations_left=self._iterations(pick.iteration_s)):
            return None
        self._mixing = x
        return pick, sw

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


def _frontier_runs(frontiers: Sequence[Frontier], paid: Sequence[np.ndarray]) -> list[list[Any]]:
    """Frontiers as runs ``[count, costs, times]`` of equal ones (``[count,
    costs, times, paid]`` where the points cost other than seen): while prices
    hold still the window is one frontier repeated, and the daemon writes the
    state every slot."""
    runs: list[list[Any]] = []
    keys: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for (c, t), p in zip(frontiers, paid, strict=True):
        if keys and all(np.array_equal(a, b) for a, b in zip(keys[-1], (c, t, p), strict=True)):
            runs[-1][0] += 1
        else:
            keys.append((c, t, p))
            runs.append([1, c.tolist(), t.tolist()] + ([] if np.array_equal(p, c) else [p.tolist()]))
    return runs


def _frontier(cands: Sequence[Candidate], kind: str) -> Frontier:
    return frontier([(c.costs.get(kind, 0.0), c.iteration_s) for c in cands])


def _kink(cands: Sequence[Candidate], kind: str, lam: float,
          tol_s: float = 0.0) -> tuple[Candidate | None, Candidate | None]:
    """The two neighbouring plans of the lower convex (cost, time) frontier of
    ``cands`` whose segment has slope ``-lam`` (they tie under ``T + lam * c``),
    or whose scores under ``lam`` differ by at most ``tol_s`` seconds (the
    nearest such segment), cheaper first; (None, None) when ``lam`` picks one
    plan. The first of equal points wins, so list the running plan first."""
    def cost(c: Candidate) -> float:
        return float(f"{c.costs.get(kind, 0.0):.9g}")

    def time(c: Candidate) -> float:
        return float(f"{c.iteration_s:.9g}")  # plans equal to 9 digits are one point

    hull = lower_hull(cands, lambda c: (cost(c), time(c)))
    best: tuple[float, Candidate | None, Candidate | None] = (math.inf, None, None)
    for a, b in itertools.pairwise(hull):
        slope = (time(a) - time(b)) / (cost(b) - cost(a))
        gap = abs(slope - lam) * (cost(b) - cost(a))  # |score(b) - score(a)| under lam
        if (abs(slope - lam) <= 1e-6 * max(slope, lam) or gap <= tol_s) and gap < best[0]:
            best = (gap, a, b)
    return best[1], best[2]


def _capped(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """Queues (or shadow prices) of a stored state, an infinite one as :data:`_MAX_QUEUE`:
    a daemon before that bound stored ``Infinity`` and could not read it back."""
    return {k: _MAX_QUEUE if v == math.inf else v for k, v in values.items()}


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
