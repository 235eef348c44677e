"""The controller's configuration and the hooks a caller may plug into it.

:class:`ControllerConfig` holds every knob of :class:`~.controller.Controller`
(which policy it runs, the slot length, the learned exchange rate's and the
time-sharing schedule's settings), validated on construction; :class:`Gate`,
:data:`SearchFn` and :data:`PredictFn` are the shapes of the optional hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .candidates import Candidate
from .errors import ValidationError
from .types import Cluster, Job, Model

__all__ = ["POLICIES", "ControllerConfig", "Gate", "PredictFn", "SearchFn"]


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
    the first slot (:attr:`~.controller.Controller.effective_V`). Read it as the backlog, in
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
    of whole slots whose switches are paid for (:class:`~.timeshare.TimeShare`)."""
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

    def slot_iterations(self, iteration_s: float) -> float:
        """Iterations one slot holds (``iterations_per_slot``, else slot_s / iteration time)."""
        n = self.iterations_per_slot
        if n is None:
            return max(self.slot_s / max(iteration_s, 1e-12), 1.0)
        return float(n)

    def per_iteration(self, switch_s: float, iteration_s: float) -> float:
        """Switching time spread over the slot's iterations (seconds per iteration)."""
        if switch_s == 0.0:
            return 0.0
        n = self.iterations_per_slot
        if n is None:
            n_f = max(self.slot_s / max(iteration_s, 1e-12), 1.0)
            return switch_s / n_f
        return switch_s / n
