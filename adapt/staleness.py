"""Staleness-aware objective for asynchronous pipelines.

In PipeDream-style 1F1B without a flush, stage j of S runs with staleness
``S - j - 1``; the mean over stages is ``(S - 1) / 2``. Stale gradients need
more iterations to reach a target accuracy. :class:`StalenessModel` is
``iterations(s) = I0 * (1 + alpha * s)`` in the mean staleness s, fitted by
least squares (:func:`fit`) to iterations-to-target measured in real runs.

:func:`time_to_accuracy` is the planner's objective for a pipeline of S
stages: ``iterations(mean staleness) x iteration time``; :func:`choose`
picks among candidates, so fewer, larger stages win when the staleness of
a deep pipeline would cost more than its throughput saves. A synchronous
candidate has staleness 0.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from hetpilot.planner.asyncplan import mean_staleness

__all__ = ["StalenessModel", "choose", "fit", "mean_staleness", "time_to_accuracy"]


@dataclass(frozen=True)
class StalenessModel:
    I0: float
    """Iterations to target without staleness."""
    alpha: float
    """Relative extra iterations per unit of mean staleness."""

    def iterations(self, staleness: float) -> float:
        return self.I0 * (1.0 + self.alpha * staleness)


def fit(staleness: Sequence[float], iterations: Sequence[float]) -> StalenessModel:
    """Least-squares fit of ``iterations = I0 + I0*alpha*s`` (alpha >= 0)."""
    s = np.asarray(staleness, dtype=float)
    it = np.asarray(iterations, dtype=float)
    A = np.stack([np.ones_like(s), s], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, it, rcond=None)
    a = max(float(a), 1e-9)
    return StalenessModel(I0=a, alpha=max(float(b) / a, 0.0))


def time_to_accuracy(model: StalenessModel, stages: int, iteration_s: float,
                     asynchronous: bool = True) -> float:
    s = mean_staleness(stages) if asynchronous else 0.0
    return model.iterations(s) * iteration_s


def choose(model: StalenessModel,
           candidates: Sequence[tuple[int, float, bool]]) -> int:
    """Index of the candidate ``(stages, iteration_s, asynchronous)`` with the
    least estimated time to accuracy."""
    scores = [time_to_accuracy(model, S, t, a) for S, t, a in candidates]
    return int(np.argmin(scores))
