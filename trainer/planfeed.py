"""Rank 0's plan source as every rank sees it: polled once per iteration, one answer for all.

Before every iteration rank 0 polls its :class:`~hetpilot.trainer.plans.PlanSource` and
broadcasts two integers (the new version, 0 for none, and whether the slot's time is up);
only a new version is followed by the plan itself, broadcast once as the
:class:`~hetpilot.planner.types.Plan` dataclass the source parsed. So every rank takes the
same version at the same step, and a plan is parsed once, where it entered the process.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from .plans import PlanSource, PlanVersion

__all__ = ["PlanFeed"]

log = logging.getLogger("hetpilot.trainer")


class PlanFeed:
    """The plan versions rank 0's ``source`` yields, broadcast; and the ones refused."""

    def __init__(self, source: PlanSource | None, *, rank: int, device: torch.device) -> None:
        self.source = source
        self.rank = rank
        self.device = device
        self.refused: list[tuple[int, str]] = []
        """(version, error) of plans refused and skipped."""
        self.refused_version = 0

    def poll(self, after: int, *, epoch: int, step: int, slot_s: float = 0.0,
             slot_started: float = 0.0) -> tuple[PlanVersion | None, bool]:
        """Collective: the version above ``after`` (and above any refused one) that rank 0's
        source has, or None; and, with ``slot_s``, whether rank 0's clock says the slot that
        started at ``slot_started`` is over."""
        found: PlanVersion | None = None
        over = False
        if self.rank == 0:
            if self.source is not None:
                found = self.source.poll(max(after, self.refused_version), epoch=epoch,
                                         step=step)
            over = slot_s > 0 and time.perf_counter() - slot_started >= slot_s
        flags = torch.tensor([found.version if found is not None else 0, int(over)],
                             dtype=torch.int64, device=self.device)
        dist.broadcast(flags, src=0)
        version, over_flag = (int(v) for v in flags.tolist())
        if version <= 0:
            return None, bool(over_flag)
        box: list[Any] = [found]
        dist.broadcast_object_list(box, src=0)
        return box[0], bool(over_flag)

    def refuse(self, version: int, error: str, running: int) -> None:
        """Skip ``version`` from now on (every rank refuses it alike), ``running`` going on."""
        self.refused_version = max(self.refused_version, version)
        self.refused.append((version, error))
        if self.rank == 0:
            log.warning("plan version %d refused, keeping version %d: %s",
                        version, running, error)
