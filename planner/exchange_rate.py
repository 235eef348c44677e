"""The learned exchange rate between iteration time and cost (the default V, one budget).

A job that gives no V (``V = 0``) should not have to know V's units (seconds
against ($/h)^2). With one budget the controller instead weighs cost by the
exchange rate, in seconds per unit of cost rate, that would have held the
budget over the cost/time frontiers of the last ``learn_window`` slots: the
offline oracle's linear programme solved on the past
(:func:`~.candidates.budget_multiplier`), at the budget less the debt so far
spread over ``repay_slots`` (:meth:`LearnedRate.target`). The rate is carried
in the queue (``Q = V_eff * rate``).

[Note: paid, not seen] A slot decides on the prices of the slot before (reports
arrive after the fact), so what the frontier's plans really cost in their slot is
known one slot later: :meth:`LearnedRate.settle` rewrites the last frontier's
costs then, and the debt is charged with what the running plan really cost.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .candidates import Candidate, Frontier, budget_multiplier, lower_hull
from .controller_config import ControllerConfig
from .errors import ValidationError
from .slot import check_budgets
from .types import COST_KINDS, Cluster

__all__ = ["LearnedRate"]


class LearnedRate:
    """The frontiers of the last slots, what they were paid, the debt, and the rate."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.frontiers: deque[Frontier] = deque(maxlen=max(config.learn_window, 1))
        self.paid: deque[np.ndarray] = deque(maxlen=max(config.learn_window, 1))
        """What each frontier's points really cost in their slot ([Note: paid, not seen])."""
        self.front_devices: list[tuple[str, ...]] = []
        """The devices of the last frontier's plans (to price them a slot later)."""
        self.learned: dict[str, float] = {}
        self.debt: dict[str, float] = {}
        """Spending over (+) or under (-) the budget so far, settled."""
        self.horizon = float(config.repay_slots)
        """Slots this slot's debt is spread over."""

    def forget(self) -> None:
        """Drop the frontiers and the rate (the budgets changed kind: another frontier)."""
        self.frontiers.clear()
        self.paid.clear()
        self.front_devices = []
        self.learned = {}

    def charge(self, budgets_then: Mapping[str, float], paid: Mapping[str, float],
               budgets_now: Mapping[str, float]) -> None:
        """Add the last slot's spending over its budgets to the debt (kinds still budgeted)."""
        for k, b in budgets_then.items():
            if k in budgets_now:
                self.debt[k] = self.debt.get(k, 0.0) + paid.get(k, 0.0) - b

    def settle(self, observed: Cluster, kind: str) -> None:
        """What the last slot's frontier plans really cost, now that ``observed``
        shows that slot's prices (a plan on a device gone keeps the cost it was
        chosen at)."""
        if not (self.paid and self.front_devices and len(self.front_devices) == len(self.paid[-1])):
            return
        by_id = observed.by_id
        self.paid[-1] = np.array([
            sum(by_id[d].cost(kind) for d in devs) if all(d in by_id for d in devs) else seen
            for devs, seen in zip(self.front_devices, self.paid[-1], strict=True)])

    def learn(self, cands: Sequence[Candidate], kind: str, budget: float) -> float:
        """The exchange rate that would have held ``budget - debt / repay_slots`` over the
        frontiers of the last slots, this slot's (``cands``') included."""
        config = self.config
        hull = lower_hull(cands, lambda c: (c.costs.get(kind, 0.0), c.iteration_s))
        front = (np.array([c.costs.get(kind, 0.0) for c in hull], dtype=float),
                 np.array([c.iteration_s for c in hull], dtype=float))
        self.frontiers.append(front)
        self.paid.append(front[0].copy())  # until the next slot shows what they cost
        self.front_devices = [tuple(c.plan.devices) for c in hull]
        horizon = config.repay_slots
        debt = max(self.debt.get(kind, 0.0), -config.max_credit * budget * horizon)
        self.debt[kind] = debt
        paid = self.paid
        self.horizon = float(horizon)
        smooth = config.learn_smoothing
        lam = budget_multiplier(self.frontiers, self.target(kind, budget), paid=paid, smooth=smooth)
        rho = config.repay_rate
        if rho > 0 and debt > 0.0 and lam is not None:
            base = budget_multiplier(self.frontiers, budget, paid=paid, smooth=smooth)
            if base:  # repay no faster than at (1 + rho) times the rate at the budget itself
                lo_rate, hi_rate = base / (1 + rho), base * (1 + rho)
                while (lam is None or not lo_rate <= lam <= hi_rate) and \
                        self.horizon < config.repay_max_slots:
                    self.horizon = min(2 * self.horizon, float(config.repay_max_slots))
                    lam = budget_multiplier(self.frontiers, self.target(kind, budget), paid=paid,
                                            smooth=smooth)
        if lam is None:  # below the cheapest plans: weigh cost as heavily as they ever do
            lam = max((float(np.max(-np.diff(t) / np.diff(c))) for c, t in self.frontiers
                       if len(c) > 1), default=self.learned.get(kind, 0.0))
        self.learned = {kind: lam}
        return lam

    def target(self, kind: str, budget: float) -> float:
        """The budget less the debt spread over the horizon (bounded)."""
        return budget - self.debt.get(kind, 0.0) / self.horizon

    # -- state ---------------------------------------------------------------

    def frontier_runs(self) -> list[list[Any]]:
        """Frontiers as runs ``[count, costs, times]`` of equal ones (``[count,
        costs, times, paid]`` where the points cost other than seen): while prices
        hold still the window is one frontier repeated, and the daemon writes the
        state every slot."""
        runs: list[list[Any]] = []
        keys: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for (c, t), p in zip(self.frontiers, self.paid, strict=True):
            if keys and all(np.array_equal(a, b) for a, b in zip(keys[-1], (c, t, p), strict=True)):
                runs[-1][0] += 1
            else:
                keys.append((c, t, p))
                runs.append([1, c.tolist(), t.tolist()] + ([] if np.array_equal(p, c) else [p.tolist()]))
        return runs

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Read ``learned``, ``debt``, ``frontiers`` and ``front_devices`` of a
        controller's state; ValidationError names the field."""
        raw_learned = state.get("learned", {})
        if not isinstance(raw_learned, Mapping):
            raise ValidationError("state.learned", "must be an object")
        self.learned = check_budgets(raw_learned, "state.learned")
        raw_debt = state.get("debt", {})
        if not isinstance(raw_debt, Mapping) or any(
                k not in COST_KINDS or isinstance(v, bool) or not isinstance(v, (int, float))
                or not math.isfinite(v) for k, v in raw_debt.items()):
            raise ValidationError("state.debt", "must map cost kinds to finite numbers")
        self.debt = {k: float(v) for k, v in raw_debt.items()}
        self.frontiers.clear()
        self.paid.clear()
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
            n = min(count, self.frontiers.maxlen or count)
            self.frontiers.extend((c, t) for _ in range(n))
            self.paid.extend(paid for _ in range(n))
        raw_devices = state.get("front_devices", [])
        if not isinstance(raw_devices, list) or any(
                not isinstance(d, list) or not all(isinstance(x, str) for x in d) for d in raw_devices):
            raise ValidationError("state.front_devices", "must be a list of lists of device ids")
        self.front_devices = [tuple(d) for d in raw_devices]
