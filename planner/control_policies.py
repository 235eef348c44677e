"""The controller's policies, one class each: how a slot's plan is chosen.

Every policy shares the controller's bookkeeping (the running plan, the switching
cost, the queues, devices that go down); what differs is here:

* :class:`Lyapunov` (``lyapunov``, the product): minimises ``V * T + sum_k Q_k * c_k``
  plus the switch spread over the slot, with hysteresis and the gate; with the
  default V and one budget it weighs cost by the learned rate
  (:mod:`.exchange_rate`) and time-shares two plans on a kink (:mod:`.timeshare`);
* :class:`Fastest` (``fastest``): the fastest plan, budgets ignored;
* :class:`BudgetGreedy` (``budget-greedy``): the fastest plan whose cost rates fit
  the budgets this slot;
* :class:`StaticReplan` (``static-replan``): plans once like budget-greedy and keeps
  that plan; re-plans from scratch on the devices that are up when one of its
  devices goes down, and keeps the new plan after the device returns;
* :class:`Static` (``static``): plans once and keeps that plan; while devices of it
  are down, the groups that lost one stop and the others take their samples
  (:mod:`.elastic`), and they rejoin when the devices return; only when no group
  survives does it re-plan (and keep that plan).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from . import serde
from .candidates import Candidate, plan_costs
from .elastic import surviving_plan
from .exchange_rate import LearnedRate
from .refmodel import evaluate
from .slot import Slot
from .switching import SwitchCost
from .timeshare import TimeShare
from .types import Cluster, Job, Model, Plan

__all__ = ["POLICY_CLASSES", "BudgetGreedy", "Fastest", "Lyapunov", "Policy", "Static",
           "StaticReplan", "make_policy"]

_NO_SWITCH = SwitchCost(0.0, 0.0)


class Policy:
    """How one slot's plan is chosen among the candidates (:meth:`choose`)."""

    name: ClassVar[str]
    keeps_working_plan: ClassVar[bool] = False
    """A running plan that still works is kept without searching."""
    cost_subsets: ClassVar[bool] = True
    """Under budgets, also search without the least cost-efficient devices."""
    weighs_queues: ClassVar[bool] = False
    """The objective weighs cost by the virtual queues (drift-plus-penalty); with the
    default V the queues then start warm, or carry the learned rate."""

    @classmethod
    def build(cls, rate: LearnedRate, share: TimeShare) -> Policy:
        """The policy of a controller whose learned rate and time-sharing are these."""
        return cls()

    def running(self, observed: Cluster, model: Model, job: Job, plan: Plan,
                version: int) -> tuple[Candidate | None, str | None]:
        """The last slot's ``plan`` re-scored on ``observed`` (None, and why, when it
        cannot run there)."""
        missing = [d for d in plan.devices if d not in observed.by_id]
        if missing:
            return None, f"plan v{version} uses devices no longer present ({', '.join(missing[:4])}); re-planned"
        ev = evaluate(observed, model, plan, job.global_batch)
        if not ev.valid or ev.iteration_s is None:
            return None, f"plan v{version} is no longer valid ({ev.error}); re-planned"
        return Candidate(plan, ev.iteration_s, plan_costs(observed, plan), "running"), None

    def choose(self, slot: Slot) -> tuple[Candidate, SwitchCost]:
        """The plan for the slot and the cost of switching to it."""
        raise NotImplementedError

    def chose(self, plan: Plan, running: Candidate | None) -> None:
        """Told the slot's choice (``running``: the running plan re-scored, if any)."""

    def to_state(self) -> dict[str, Any]:
        """The policy's own part of the controller's state."""
        return {"origin": None}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Read back what :meth:`to_state` wrote; ValidationError names the field."""


def pick(slot: Slot, running: Candidate | None, pool: list[Candidate],
         queues: Mapping[str, float], tie_sign: float | None = None) -> tuple[Candidate, SwitchCost]:
    """The candidate of ``pool`` with the least objective plus its switch spread over
    the slot; the running plan unless that beats it by ``hysteresis * V * T_running``
    and the gate admits the switch. ``tie_sign``: equal scores (to 10 digits) go to
    the cheaper (1) or the dearer (-1) first. ``pool`` is sorted in place."""
    scale = slot.scale
    V = scale.a

    def score(c: Candidate) -> float:
        return scale.objective(c, queues)

    if tie_sign is not None:
        pool.sort(key=lambda c: (float(f"{score(c):.10g}"),
                                 tie_sign * sum(c.costs.get(k, 0.0) for k in slot.budgets)))
    else:
        pool.sort(key=score)
    best: Candidate | None = None
    best_eff, best_switch = math.inf, _NO_SWITCH
    for cand in pool:
        raw = score(cand)
        if raw >= best_eff:
            break  # penalties are >= 0: nothing later can win
        sw = slot.switch(cand.plan)
        eff = raw + V * slot.config.per_iteration(sw.seconds, cand.iteration_s)
        if eff < best_eff:
            best, best_eff, best_switch = cand, eff, sw
    if running is None:
        assert best is not None
        return best, best_switch
    keep = score(running)
    better = best is not None and best_eff < keep - slot.config.hysteresis * V * running.iteration_s
    if better and best is not None and (slot.gate is None or slot.gate.admit(
        running_s=keep / V, candidate_s=score(best) / V, switch_s=best_switch.seconds,
        iterations_left=slot.config.slot_iterations(best.iteration_s),
    )):
        return best, best_switch
    return running, _NO_SWITCH


class Lyapunov(Policy):
    """Drift-plus-penalty: ``V * T + sum_k Q_k * c_k``."""

    name = "lyapunov"
    weighs_queues = True

    def __init__(self, rate: LearnedRate, share: TimeShare) -> None:
        self.rate = rate
        self.share = share

    @classmethod
    def build(cls, rate: LearnedRate, share: TimeShare) -> Policy:
        return cls(rate, share)

    def choose(self, slot: Slot) -> tuple[Candidate, SwitchCost]:
        if slot.config.mix and slot.learning:
            (kind, budget), = slot.budgets.items()
            mixed = self.share.choose(slot, self.rate, kind, budget)
            if mixed is not None:
                return mixed
            self.share.pair = None
        if slot.learning:
            # equal scores (a learned rate on the kink between two plans): the cheaper first
            sign = -1.0 if self.share.tie_dear else 1.0
            return pick(slot, slot.running, slot.pool, slot.queues, sign)
        return pick(slot, slot.running, slot.pool, slot.queues)


class Fastest(Policy):
    """The fastest plan (with switching cost and hysteresis), budgets ignored."""

    name = "fastest"
    cost_subsets = False

    def choose(self, slot: Slot) -> tuple[Candidate, SwitchCost]:
        return pick(slot, slot.running, slot.pool, {})


class BudgetGreedy(Policy):
    """The fastest plan whose cost rates fit the budgets this slot (where none fits,
    the least over budget, relative to each budget)."""

    name = "budget-greedy"

    def choose(self, slot: Slot) -> tuple[Candidate, SwitchCost]:
        running, pool = slot.running, slot.pool
        if slot.budgets:
            everyone = pool + ([running] if running else [])
            fitting = [c for c in everyone if slot.fits(c)]
            if not fitting:  # nothing fits: the least over budget, relative to each budget
                def excess(c: Candidate) -> float:
                    return sum(max(c.costs.get(k, 0.0) - b, 0.0) / max(b, 1e-9)
                               for k, b in slot.budgets.items())
                least = min(excess(c) for c in everyone)
                fitting = [c for c in everyone if excess(c) <= least * (1 + 1e-9)]
            if running is not None and running not in fitting:
                running = None  # must move: the running plan breaks the budget
            pool = [c for c in fitting if c is not running]
            if not pool:
                assert running is not None
                return running, _NO_SWITCH
        return pick(slot, running, pool, {})


class StaticReplan(BudgetGreedy):
    """Budget-greedy once, then the same plan; from scratch when one of its devices is down."""

    name = "static-replan"
    keeps_working_plan = True

    def choose(self, slot: Slot) -> tuple[Candidate, SwitchCost]:
        if slot.running is not None:
            return slot.running, _NO_SWITCH
        return super().choose(slot)


class Static(StaticReplan):
    """Budget-greedy once, then the plan chosen once, less the groups that lost a device."""

    name = "static"

    def __init__(self) -> None:
        self.origin: Plan | None = None
        """The plan chosen once (or again, when no group of it could run)."""

    def running(self, observed: Cluster, model: Model, job: Job, plan: Plan,
                version: int) -> tuple[Candidate | None, str | None]:
        origin = self.origin
        if origin is None:
            return super().running(observed, model, job, plan, version)
        survivor = surviving_plan(origin, observed, model, job.global_batch)
        if survivor is None:
            return None, (f"static: no group of the plan chosen once can run on the devices "
                          f"that are up; re-planned (plan v{version + 1} is kept from now on)")
        ev = evaluate(observed, model, survivor, job.global_batch)
        if not ev.valid or ev.iteration_s is None:
            return None, f"static: the plan chosen once is no longer valid ({ev.error}); re-planned"
        why = None
        if survivor != plan:
            kept = len(survivor.groups)
            why = (f"static: {len(origin.groups) - kept} group(s) of the plan chosen once "
                   f"wait for down devices; the other {kept} take their samples"
                   if survivor is not origin else
                   "static: every device of the plan chosen once is up; its groups rejoin")
        return Candidate(survivor, ev.iteration_s, plan_costs(observed, survivor), "running"), why

    def chose(self, plan: Plan, running: Candidate | None) -> None:
        if self.origin is None or running is None:
            self.origin = plan

    def to_state(self) -> dict[str, Any]:
        return {"origin": None if self.origin is None else serde.plan_to_dict(self.origin)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        raw = state.get("origin")
        self.origin = None if raw is None else serde.plan_from_dict(raw, "state.origin")


POLICY_CLASSES: Mapping[str, type[Policy]] = {
    cls.name: cls for cls in (Lyapunov, Fastest, BudgetGreedy, Static, StaticReplan)}
"""Each policy by its :attr:`~.controller_config.ControllerConfig.policy` name."""


def make_policy(name: str, rate: LearnedRate, share: TimeShare) -> Policy:
    """The policy called ``name`` (one of :data:`~.controller_config.POLICIES`)."""
    return POLICY_CLASSES[name].build(rate, share)
