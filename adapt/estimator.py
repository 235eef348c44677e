"""Random-forest slowdown estimator (non-intrusive: runtime statistics only).

:class:`SlowdownEstimator` predicts a stage's slowdown for the next slot
from the feature vector of :mod:`hetpilot.adapt.features`, with
scikit-learn's ``RandomForestRegressor`` fitted on ``log(slowdown)`` (errors
are relative, and a forest averages logs into a geometric mean, which keeps
a few very slow windows from dragging every prediction up).

- It starts from the bootstrap set recorded on this machine
  (``adapt/data/bootstrap.csv``, :mod:`hetpilot.adapt.collect`).
- :meth:`SlowdownEstimator.observe` adds what the running system measured.
  Before adding, it scores its current prediction for that sample, so
  :meth:`SlowdownEstimator.error` is an honest running (prequential) error:
  every sample was predicted before it was learnt from.
- Every ``refit_every`` new samples it refits in a background thread on the
  bootstrap plus the newest ``window`` samples; predictions use the last
  finished fit meanwhile (swapped under a lock).

:func:`last_value` and :func:`moving_average` are the baselines the
benchmark compares against (``bench/adapt_estimator.py``).

scikit-learn is imported when the first fit runs, never at import time.
"""

from __future__ import annotations

import csv
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .features import FEATURES, from_mapping

__all__ = [
    "EstimatorError",
    "Recorded",
    "SlowdownEstimator",
    "last_value",
    "load_recorded",
    "mape",
    "moving_average",
]


@dataclass(frozen=True)
class Recorded:
    """A recorded data set: features, slowdown, and what the benchmark needs."""

    X: np.ndarray
    slowdown: np.ndarray
    quiet_s: np.ndarray
    measured_s: np.ndarray
    stage: tuple[str, ...]
    t: np.ndarray

    def __len__(self) -> int:
        return len(self.slowdown)

    def take(self, idx: Sequence[int] | np.ndarray) -> Recorded:
        i = np.asarray(idx)
        return Recorded(self.X[i], self.slowdown[i], self.quiet_s[i], self.measured_s[i],
                        tuple(self.stage[j] for j in i), self.t[i])


def load_recorded(path: str | Path | None = None) -> Recorded:
    """The CSV written by :mod:`hetpilot.adapt.collect` (default: the packaged
    bootstrap set), in time order."""
    if path is None:
        ref = resources.files("hetpilot.adapt") / "data" / "bootstrap.csv"
        text = ref.read_text()
    else:
        text = Path(path).read_text()
    rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ValueError(f"{path or 'bootstrap.csv'}: no rows")
    return Recorded(
        X=np.array([from_mapping(r) for r in rows], dtype=float),
        slowdown=np.array([float(r["slowdown"]) for r in rows]),
        quiet_s=np.array([float(r["quiet_s"]) for r in rows]),
        measured_s=np.array([float(r["measured_s"]) for r in rows]),
        stage=tuple(r["stage"] for r in rows),
        t=np.array([float(r["t"]) for r in rows]),
    )


def mape(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(np.mean(np.abs(pred - true) / np.abs(true)) * 100.0)


def last_value(slowdown: np.ndarray, first: float = 1.0) -> np.ndarray:
    """Predict each sample's slowdown as the previous sample's (time order)."""
    return np.concatenate([[first], slowdown[:-1]])


def moving_average(slowdown: np.ndarray, k: int = 5, first: float = 1.0) -> np.ndarray:
    """Predict each sample's slowdown as the mean of the previous ``k``."""
    out = np.empty_like(slowdown)
    for i in range(len(slowdown)):
        prev = slowdown[max(0, i - k):i]
        out[i] = prev.mean() if len(prev) else first
    return out


class EstimatorError(RuntimeError):
    """The estimator cannot predict (no data to fit)."""


class SlowdownEstimator:
    """Online random-forest slowdown predictor; thread-safe."""

    def __init__(
        self,
        bootstrap: Recorded | None = None,
        *,
        n_estimators: int = 60,
        min_samples_leaf: int = 5,
        refit_every: int = 32,
        window: int = 2000,
        error_window: int = 200,
        seed: int = 0,
        background: bool = True,
    ) -> None:
        self._base_X = np.empty((0, len(FEATURES))) if bootstrap is None else bootstrap.X
        self._base_y = np.empty(0) if bootstrap is None else np.log(bootstrap.slowdown)
        self._new_X: deque[list[float]] = deque(maxlen=window)
        self._new_y: deque[float] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=error_window)
        self._params = {"n_estimators": n_estimators, "min_samples_leaf": min_samples_leaf,
                        "random_state": seed, "n_jobs": 1, "max_features": 0.6}
        self._refit_every = refit_every
        self._background = background
        self._since_fit = 0
        self._lock = threading.Lock()
        self._model: Any = None
        self._fitting: threading.Thread | None = None
        self.fits = 0

    # -- fitting ---------------------------------------------------------

    def _data(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            new_X = np.array(self._new_X, dtype=float).reshape(-1, len(FEATURES))
            new_y = np.array(self._new_y, dtype=float)
        return np.vstack([self._base_X, new_X]), np.concatenate([self._base_y, new_y])

    def fit(self) -> None:
        """Fit now, in the calling thread, on the bootstrap plus the new samples."""
        from sklearn.ensemble import RandomForestRegressor

        X, y = self._data()
        if len(y) < 2:
            raise EstimatorError("fewer than 2 samples to fit on")
        model = RandomForestRegressor(**self._params).fit(X, y)
        with self._lock:
            self._model = model
            self.fits += 1

    def _refit_soon(self) -> None:
        if not self._background:
            self.fit()
            return
        if self._fitting is not None and self._fitting.is_alive():
            return  # the running refit will be followed by the next trigger
        self._fitting = threading.Thread(target=self.fit, name="rf-refit", daemon=True)
        self._fitting.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a background refit to finish (tests, shutdown)."""
        t = self._fitting
        if t is not None:
            t.join(timeout)

    @property
    def ready(self) -> bool:
        return self._model is not None or len(self._base_y) + len(self._new_y) >= 2

    # -- use -------------------------------------------------------------

    def predict(self, X: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
        """Predicted slowdowns, one per row of ``X`` (:data:`FEATURES` order)."""
        if self._model is None:
            self.fit()
        arr = np.asarray(X, dtype=float).reshape(-1, len(FEATURES))
        with self._lock:
            model = self._model
        return np.exp(model.predict(arr))

    def predict_one(self, x: Sequence[float]) -> float:
        return float(self.predict([x])[0])

    def observe(self, x: Sequence[float], slowdown: float) -> None:
        """Learn one measured sample (scored first: see :meth:`error`)."""
        if not (math.isfinite(slowdown) and slowdown > 0):
            return
        if self.ready:
            pred = self.predict_one(x)
            self._errors.append(abs(pred - slowdown) / slowdown)
        with self._lock:
            self._new_X.append([float(v) for v in x])
            self._new_y.append(math.log(slowdown))
            self._since_fit += 1
            due = self._since_fit >= self._refit_every
            if due:
                self._since_fit = 0
        if due:
            self._refit_soon()

    def observe_many(self, rows: Iterable[tuple[Sequence[float], float]]) -> None:
        for x, s in rows:
            self.observe(x, s)

    def error(self) -> Mapping[str, float]:
        """Running error over the last samples, each predicted before it was learnt:
        ``mape`` (percent) and ``samples``."""
        errs = list(self._errors)
        return {"mape": float(np.mean(errs) * 100.0) if errs else math.nan,
                "samples": float(len(errs)), "fits": float(self.fits),
                "trained_on": float(len(self._base_y) + len(self._new_y))}
