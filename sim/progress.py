"""The progress bar of ``hetpilot sim`` on stderr, for runs long enough to wait on.

Shown only when a person is watching: stderr is a terminal, the output was not
asked for as ``--json``, stdout is not that terminal printing JSON lines as they
come (they would tear through the bar), and the run is long. A run's length is
counted in *slot-steps*: slots times policies (or times ``--sweep-V`` values),
a slot on a cluster of more than 64 devices counting once more per 64 devices,
since the planner's search grows with the cluster. The bar is transient: it
disappears when the run ends, leaving the terminal as it would be without it.
"""

from __future__ import annotations

import argparse
import math
from types import TracebackType
from typing import IO, Any

__all__ = ["MIN_STEPS", "SlotProgress", "progress_wanted", "slot_steps"]

MIN_STEPS = 250
"""Slot-steps from which the bar is shown (about 2 s of a 12-device scenario here)."""

_DEVICES_PER_STEP = 64


def slot_steps(slots: int, runs: int, devices: int) -> int:
    """Slot-steps of a run: ``slots * runs``, weighed by the cluster's size."""
    return slots * runs * max(1, math.ceil(devices / _DEVICES_PER_STEP))


def _isatty(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress_wanted(args: argparse.Namespace, steps: int, stdout: IO[str] | None,
                    stderr: IO[str] | None) -> bool:
    """Whether to draw the bar (see the module docstring)."""
    if getattr(args, "json", False) or steps < MIN_STEPS or not _isatty(stderr):
        return False
    table = bool(getattr(args, "table", False))
    return table or not _isatty(stdout)


class SlotProgress:
    """``with SlotProgress(total, enabled):`` ... ``begin(label)``, ``advance()``.

    Disabled, it does nothing and imports nothing. Enabled, it draws a
    ``rich.progress`` bar on stderr. stdout is left alone (it carries the JSON
    lines); lines written to stderr meanwhile (warnings) print above the bar.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> SlotProgress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("sim {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("slot-steps"),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
                redirect_stdout=False,
                redirect_stderr=True,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("", total=self.total)
        return self

    def begin(self, label: str) -> None:
        """Name what runs now (a policy, or a V of the sweep)."""
        if self._progress is not None:
            self._progress.update(self._task, description=label)

    def advance(self, steps: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, steps)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
            self._progress = None
