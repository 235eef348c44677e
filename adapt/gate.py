"""The re-planning gate: is an environment change worth a new plan?

Two tests, both needed before the controller may leave a running plan that
still works (a plan whose device went down is always replaced):

1. **Not transient.** The gate keeps the cluster as last observed and counts
   how many consecutive observations agree with it (every device's TFLOP/s
   and every host link's Gbit/s within ``tolerance``, the same devices up).
   A change seen for fewer than ``confirm_slots`` observations is a spike:
   the running plan is kept. A spike shorter than a slot is seen by at most
   one observation (reports arrive after the fact), so with
   ``confirm_slots = 2`` it never causes a switch, and neither does its end.
2. **Worth it.** The predicted gain over the rest of the slot,
   ``(T_running - T_new) * iterations_left``, must beat ``margin`` times the
   switching time (:func:`hetpilot.planner.switching.switch_cost`).

The price of test 1 is reacting one slot later to a real change; with
``confirm_slots = 1`` the gate only applies test 2.

Pure: numbers in, decisions out (it satisfies the controller's ``Gate``
protocol, :class:`hetpilot.planner.controller.Gate`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hetpilot.planner.errors import ValidationError
from hetpilot.planner.types import Cluster

__all__ = ["GateConfig", "ReplanGate", "fingerprint"]


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    confirm_slots: int = 2
    """Consecutive observations a change must persist for before a re-cut."""
    tolerance: float = 0.1
    """Relative difference in a speed or bandwidth that counts as a change."""
    margin: float = 1.0
    """The gain over the rest of the slot must exceed margin x switching time."""

    def __post_init__(self) -> None:
        if self.confirm_slots < 1:
            raise ValidationError("gate.confirm_slots", f"must be >= 1, got {self.confirm_slots}")
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValidationError("gate.tolerance", f"must be >= 0, got {self.tolerance}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValidationError("gate.margin", f"must be >= 0, got {self.margin}")


def fingerprint(cluster: Cluster) -> dict[str, float]:
    """What the gate compares: device TFLOP/s and host-link Gbit/s by name."""
    out = {f"d/{d.id}": d.tflops for d in cluster.devices}
    for link in cluster.network.host_links:
        out[f"h/{min(link.a, link.b)}|{max(link.a, link.b)}"] = link.gbps
    for link in cluster.network.device_links:
        out[f"l/{min(link.a, link.b)}|{max(link.a, link.b)}"] = link.gbps
    return out


def _same(a: Mapping[str, float], b: Mapping[str, float], tol: float) -> bool:
    if a.keys() != b.keys():
        return False
    return all(abs(a[k] - b[k]) <= tol * max(abs(a[k]), abs(b[k]), 1e-12) for k in a)


class ReplanGate:
    """Stateful gate; one per controller. ``to_state``/``load_state`` persist it."""

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config or GateConfig()
        self._last: dict[str, float] | None = None
        self._stable = 0
        self.held: list[str] = []
        """Why the last :meth:`admit` refused, for logs and tests ("" when admitted)."""

    @property
    def stable_for(self) -> int:
        """Consecutive observations (this one included) that agree."""
        return self._stable

    def observe(self, cluster: Cluster) -> None:
        fp = fingerprint(cluster)
        if self._last is not None and _same(fp, self._last, self.config.tolerance):
            self._stable += 1
        else:
            self._stable = 1
        self._last = fp

    def admit(self, *, running_s: float, candidate_s: float, switch_s: float,
              iterations_left: float) -> bool:
        if self._stable < self.config.confirm_slots:
            self.held.append(f"transient: environment seen {self._stable} of "
                             f"{self.config.confirm_slots} observations")
            return False
        gain = (running_s - candidate_s) * iterations_left
        if gain <= self.config.margin * switch_s:
            self.held.append(f"gain {gain:.3g} s over the slot <= {self.config.margin:g} x "
                             f"switch {switch_s:.3g} s")
            return False
        return True

    def to_state(self) -> dict[str, Any]:
        return {"last": self._last, "stable": self._stable}

    def load_state(self, state: Mapping[str, Any]) -> None:
        last = state.get("last")
        self._last = None if last is None else {str(k): float(v) for k, v in last.items()}
        self._stable = int(state.get("stable", 0))
