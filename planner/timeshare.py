"""Time-sharing two plans on a schedule of whole slots (the learned rate on a kink).

Where the learned exchange rate (:mod:`.exchange_rate`) ties two neighbouring
plans of the cost/time frontier and no plan sits at the budget, the linear
programme the rate comes from mixes them; :class:`TimeShare` runs that mix as a
cycle of whole slots whose switches are paid for.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .candidates import Candidate, lower_hull, tie_share
from .controller_config import ControllerConfig
from .errors import ValidationError
from .exchange_rate import LearnedRate
from .slot import Slot
from .switching import SwitchCost, switch_cost

__all__ = ["TimeShare", "kink"]


class TimeShare:
    """The schedule of the two plans being time-shared, and its running total."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.pair: list[float] | None = None
        """The schedule's two plans as (cost, cost, time, time) to 9 digits; None: no schedule."""
        self.err = 0.0
        """Its running total of cost over the target (cost rate x slots)."""
        self.mixing = 0.0
        """This slot's time-sharing share (:attr:`~.controller.Decision.mix`)."""
        self.tie_dear = False
        """This slot's ties go to the dearer plan (tie_share 1)."""

    def choose(self, slot: Slot, rate: LearnedRate, kind: str,
               budget: float) -> tuple[Candidate, SwitchCost] | None:
        """Time-sharing of two plans as a schedule of whole slots.

        Where the learned rate sits on a kink of this slot's frontier, between
        two neighbouring plans ``lo`` (cheaper) and ``hi`` (dearer), both are
        equally good and the linear programme the rate comes from mixes them:
        of the slots where the rate ties two plans, a share ``x`` takes the
        dearer (:func:`~.candidates.tie_share`: the share that
        makes the window spend the target, the budget less the debt spread
        over ``repay_slots``, or longer: ``repay_rate``). The controller
        time-shares only where the prices have not moved over the learning
        window (every frontier in it is this slot's); then every slot ties and
        ``x = (b_t - c_lo) / (c_hi - c_lo)``. (When prices move, the rate
        already shares across slots, banking under-spending for cheap slots;
        a schedule made on moving prices lost speed on the trace library.)

        A plan runs whole slots (the trainer takes a plan per slot), so the
        mix is a cycle of ``n`` slots with two switches, each paid for
        (:func:`~.switching.switch_cost`: parameters moved
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
        config = self.config
        running = slot.running
        self.tie_dear = False
        lam = rate.learned.get(kind)
        if not lam:
            return None
        now_c, now_t = rate.frontiers[-1]
        if len(rate.frontiers) < config.mix_after:
            return None  # too few slots to call the frontier still: the smoothed rate shares
        if any(len(c) != len(now_c) or not (np.array_equal(c, now_c) and np.array_equal(t, now_t))
               for c, t in rate.frontiers):
            return None  # prices moved within the window: the rate banks across them instead
        # a smoothed rate (learn_smoothing) lies near the kink, not on it: a tie is a rate
        # at which the softmin still gives both plans over 0.7% (|gap| <= 5 temperatures)
        tol_s = 5.0 * config.learn_smoothing * float(np.min(now_t)) if len(now_t) else 0.0
        lo, hi = kink(([running] if running is not None else []) + list(slot.pool), kind, lam, tol_s)
        if lo is None or hi is None:
            return None
        slope = (lo.iteration_s - hi.iteration_s) / (hi.costs.get(kind, 0.0) - lo.costs.get(kind, 0.0))
        x = tie_share(rate.frontiers, slope, rate.target(kind, budget), paid=rate.paid)
        if x >= 1 - 1e-9:
            self.tie_dear = True  # every tie to the dearer plan: no schedule needed
            return None
        if x <= 1e-9:
            return None
        c_lo, c_hi = lo.costs.get(kind, 0.0), hi.costs.get(kind, 0.0)
        c_x = c_lo + x * (c_hi - c_lo)
        up = switch_cost(slot.observed, slot.model, lo.plan, hi.plan).seconds
        down = switch_cost(slot.observed, slot.model, hi.plan, lo.plan).seconds
        gain = x * (lo.iteration_s - hi.iteration_s) * config.slot_iterations(lo.iteration_s)
        need = (up + down) / (config.mix_overhead * gain) if up + down > 0 else 0.0
        if need > config.mix_max_cycle:
            return None
        n = max(math.ceil(need - 1e-3), math.ceil(1 / x - 1e-3), math.ceil(1 / (1 - x) - 1e-3), 2)
        if n > config.mix_max_cycle:
            return None
        band = n / (2 * (1 / (c_hi - c_x) + 1 / (c_x - c_lo)))
        pair = [float(f"{v:.9g}") for v in (c_lo, c_hi, lo.iteration_s, hi.iteration_s)]
        if pair != self.pair:  # a new schedule: its own running total
            self.pair, self.err = pair, 0.0
        err = self.err
        on = None if running is None else running.plan
        slack = 1e-4 * band  # E lands on the band edges in whole steps: compare loosely
        if on == hi.plan:
            pick = lo if err >= band - slack else hi
        elif on == lo.plan:
            pick = hi if err <= -band + slack else lo
        else:
            pick = hi if err < 0 else lo
        self.err = err + pick.costs.get(kind, 0.0) - c_x
        if running is not None and pick.plan == running.plan:
            self.mixing = x
            return running, SwitchCost(0.0, 0.0)
        sw = slot.switch(pick.plan)
        if running is not None and slot.gate is not None and not slot.gate.admit(
                running_s=running.iteration_s + lam * running.costs.get(kind, 0.0),
                candidate_s=pick.iteration_s + lam * pick.costs.get(kind, 0.0),
                switch_s=sw.seconds, iterations_left=config.slot_iterations(pick.iteration_s)):
            return None
        self.mixing = x
        return pick, sw

    def to_state(self) -> dict[str, Any] | None:
        return None if self.pair is None else {"pair": list(self.pair), "err": self.err}

    def load_state(self, raw_mix: Any) -> None:
        """Read a controller state's ``mix``; ValidationError names the field."""
        if raw_mix is None:
            return
        pair = raw_mix.get("pair") if isinstance(raw_mix, Mapping) else None
        err = raw_mix.get("err") if isinstance(raw_mix, Mapping) else None
        if (not isinstance(pair, list) or len(pair) != 4 or not isinstance(err, (int, float))
                or not all(isinstance(v, (int, float)) for v in pair)):
            raise ValidationError("state.mix", "must be null or {pair: 4 numbers, err: number}")
        self.pair, self.err = [float(v) for v in pair], float(err)


def kink(cands: Sequence[Candidate], kind: str, lam: float,
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
