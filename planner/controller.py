"""Lyapunov drift-plus-penalty controller (spec v1 section 6). CONTRACT ONLY.

This file fixes the interface the simulator (hetpilot.sim) and the daemon
(hetpilot.daemon) both drive; the implementation lands with issue 3.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .types import Cluster, Job, Model, Plan

__all__ = ["Controller", "ControllerConfig", "Decision"]


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    slot_s: float = 60.0
    """Wall-clock length of one slot (an epoch), used to weigh switching cost."""
    hysteresis: float = 0.02
    """Switch only when the predicted saving beats the switching cost by this fraction."""


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


class Controller:
    def __init__(self, model: Model, job: Job, config: ControllerConfig | None = None) -> None:
        raise NotImplementedError("issue 3")

    def step(self, observed: Cluster) -> Decision:
        raise NotImplementedError("issue 3")

    def set_budgets(self, budgets: Mapping[str, float] | None = None, V: float | None = None) -> None:
        raise NotImplementedError("issue 3")

    def to_state(self) -> dict[str, Any]:
        raise NotImplementedError("issue 3")

    @classmethod
    def from_state(cls, model: Model, job: Job, state: Mapping[str, Any],
                   config: ControllerConfig | None = None) -> Controller:
        raise NotImplementedError("issue 3")
