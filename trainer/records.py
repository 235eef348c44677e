"""What a rank measured, as the records the trainer reports: one per slot of iterations.

A slot (:class:`Slot`) sums a rank's stage statistics until it closes (a number of
iterations or seconds, an epoch's end, a plan switch); :func:`slot_record` turns it into
the record a reporter gets (per-microbatch forward/backward seconds, exposed sync time,
throughput), and :func:`deliver` hands the records to the reporter, on every rank or, for a
reporter that talks to the daemon, all on rank 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .pipeline import StageStats

__all__ = ["JsonlReporter", "Reporter", "Slot", "deliver", "slot_record"]

Reporter = Callable[[dict[str, Any]], None]


class JsonlReporter:
    """Appends each report as one JSON line (offline measurement)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __call__(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


class Slot:
    """What one rank measured since the last record."""

    def __init__(self) -> None:
        self.total = StageStats()
        self.steps = 0
        self.started = time.perf_counter()
        self.switch_s: float | None = None
        """Seconds of the plan switch that opened this slot (None: it opened without one)."""

    def add(self, stats: StageStats | None) -> None:
        self.steps += 1
        if stats is not None:
            self.total.add(stats)


def slot_record(total: StageStats, steps: int, wall: float, *, global_batch: int,
                role: tuple[int, int] | None, group_samples: int | None,
                slowdown: float = 1.0, emulated_tflops: float | None = None) -> dict[str, Any]:
    """The measured part of a slot's record: this rank's stage ``role`` ((group, stage), None
    when the plan leaves it idle) and its times, per microbatch or per iteration; and the
    EMULATION in force, if any."""
    per_mb = max(total.microbatches, 1)
    record: dict[str, Any] = {
        "group": None if role is None else role[0],
        "group_samples": group_samples,
        "stage": None if role is None else role[1],
        "fwd_s": total.fwd_s / per_mb,
        "bwd_s": total.bwd_s / per_mb,
        "transfer_wait_s": total.wait_s / max(steps, 1),
        "sync_s": total.sync_s / max(steps, 1),
        "sync_overlap": total.sync_early_bytes / total.sync_bytes if total.sync_bytes
        else None,
        "iteration_s": wall / max(steps, 1),
        "samples_per_s": global_batch * steps / wall if wall > 0 else 0.0,
    }
    if slowdown != 1.0:
        record["emulated_slowdown"] = slowdown
    if emulated_tflops is not None:
        record["emulated_tflops"] = emulated_tflops
    return record


def deliver(record: dict[str, Any], reporter: Reporter | None, *, from_rank0: bool,
            rank: int, world: int) -> None:
    """Hand ``record`` to ``reporter``: here, or (``from_rank0``, collective) every rank's
    record to rank 0's reporter, in rank order."""
    if from_rank0:
        records: list[Any] = [None] * world
        dist.all_gather_object(records, record)
        if rank == 0 and reporter is not None:
            for rec in records:
                reporter(rec)
    elif reporter is not None:
        reporter(record)
