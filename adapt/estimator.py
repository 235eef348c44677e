"""Random-forest slowdown estimator (non-intrusive: runtime statistics only).

:class:`SlowdownEstimator` predicts a stage's slowdown for the next slot
from the feature vector of :mod:`hetpilot.adapt.features`, with
scikit-learn's ``RandomForestRegressor`` fitted on ``log(slowdown)`` (errors
are relative, and a forest averages logs into a geometric mean, which keeps
a few very slow windows from dragging every prediction up).

- It starts from the bootstrap set recorded on this machine: every
  recording packaged in ``adapt/data/`` (:func:`load_bootstrap`; made by
  :mod:`hetpilot.adapt.collect` with 0.8 s, 2 s and longer slots). Pooling
  them beats any one alone on the others' held-out rows
  (``bench/RESULTS-adapt.md``): the slowdown a load causes does not depend on
  how long the trainer's slot is, and more stages and loads are covered.
- :meth:`SlowdownEstimator.observe` adds what the running system measured
  (:meth:`SlowdownEstimator.observe_many`: the samples of one slot at once).
  Before adding, it scores its current prediction for those samples, so
  :meth:`SlowdownEstimator.error` is an honest running (prequential) error:
  every sample was predicted before it (or any sample of its slot) was
  learnt from.
- Every ``refit_every`` new samples it refits in a background thread on the
  bootstrap plus the newest ``window`` samples; predictions use the last
  finished fit meanwhile (swapped under a lock).

:func:`last_value` and :func:`moving_average` are the baselines the
benchmark compares against (``bench/adapt_estimator.py``): the stage's own
last slot (falling back to the device's last slot, on any stage, when the
stage did not run there), and the mean of the stage's last 5 slots.

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

from .features import FEATURES, HISTORY, from_mapping

__all__ = [
    "EstimatorError",
    "Recorded",
    "SlowdownEstimator",
    "episode_starts",
    "last_value",
    "load_bootstrap",
    "load_recorded",
    "mape",
    "moving_average",
    "time_split",
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
    slot: np.ndarray
    """Slot index over the whole recording (rows of one slot share it)."""
    first: np.ndarray
    """True for an episode's first slot (configuration and stages just set)."""
    injected: np.ndarray
    """Co-located worker processes the recording ran (0: none of ours)."""

    def __len__(self) -> int:
        return len(self.slowdown)

    @staticmethod
    def concat(parts: Sequence[Recorded]) -> Recorded:
        """Recordings one after another; slot numbers stay distinct."""
        if not parts:
            raise ValueError("no recordings to join")
        offsets = np.cumsum([0] + [int(p.slot.max()) + 1 if len(p) else 0 for p in parts[:-1]])
        return Recorded(
            np.vstack([p.X for p in parts]), np.concatenate([p.slowdown for p in parts]),
            np.concatenate([p.quiet_s for p in parts]), np.concatenate([p.measured_s for p in parts]),
            tuple(s for p in parts for s in p.stage), np.concatenate([p.t for p in parts]),
            np.concatenate([p.slot + off for p, off in zip(parts, offsets, strict=True)]),
            np.concatenate([p.first for p in parts]), np.concatenate([p.injected for p in parts]))

    def take(self, idx: Sequence[int] | np.ndarray) -> Recorded:
        i = np.asarray(idx)
        return Recorded(self.X[i], self.slowdown[i], self.quiet_s[i], self.measured_s[i],
                        tuple(self.stage[j] for j in i), self.t[i], self.slot[i],
                        self.first[i], self.injected[i])


def load_recorded(path: str | Path | None = None) -> Recorded:
    """The CSV written by :mod:`hetpilot.adapt.collect` (default: the packaged
    ``bootstrap.csv``), in time order."""
    if path is None:
        ref = resources.files("hetpilot.adapt") / "data" / "bootstrap.csv"
        return _parse(ref.read_text(), "bootstrap.csv")
    return _parse(Path(path).read_text(), str(path))


def packaged_recordings() -> list[str]:
    """Names of the recordings packaged in ``hetpilot.adapt/data``, sorted."""
    folder = resources.files("hetpilot.adapt") / "data"
    return sorted(f.name for f in folder.iterdir() if f.name.endswith(".csv"))


def load_bootstrap(exclude: Iterable[str] = ()) -> Recorded:
    """Every packaged recording but those named in ``exclude``, joined (the
    estimator's bootstrap set)."""
    skip = {Path(e).name for e in exclude}
    folder = resources.files("hetpilot.adapt") / "data"
    parts = [_parse((folder / name).read_text(), name)
             for name in packaged_recordings() if name not in skip]
    return Recorded.concat(parts)


def _parse(text: str, name: str) -> Recorded:
    rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ValueError(f"{name}: no rows")
    return Recorded(
        X=np.array([from_mapping(r) for r in rows], dtype=float),
        slowdown=np.array([float(r["slowdown"]) for r in rows]),
        quiet_s=np.array([float(r["quiet_s"]) for r in rows]),
        measured_s=np.array([float(r["measured_s"]) for r in rows]),
        stage=tuple(r["stage"] for r in rows),
        t=np.array([float(r["t"]) for r in rows]),
        slot=np.array([int(r["gslot"]) for r in rows]),
        first=np.array([r["slot"] == "0" for r in rows]),
        injected=np.array([int(r["n_matmul"]) + int(r["n_memory"]) for r in rows]),
    )


def episode_starts(d: Recorded) -> np.ndarray:
    """True for the first row of each episode."""
    return d.first & np.concatenate([[True], d.slot[1:] != d.slot[:-1]])


def time_split(d: Recorded, train: float = 0.7) -> int:
    """Index of the first held-out row of a time split: the first episode
    start at or after ``train`` of the rows (an episode is never split)."""
    starts = np.flatnonzero(episode_starts(d))
    later = starts[starts >= int(len(d) * train)]
    return int(later[0]) if len(later) else len(d)


def mape(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(np.mean(np.abs(pred - true) / np.abs(true)) * 100.0)


_STAGE_LAST = FEATURES.index(HISTORY[0])
_DEVICE_LAST = FEATURES.index(HISTORY[1])


def _reference(X: np.ndarray) -> np.ndarray:
    stage, dev = X[:, _STAGE_LAST], X[:, _DEVICE_LAST]
    return np.where(stage > 0, stage, np.where(dev > 0, dev, 1.0))


def last_value(d: Recorded) -> np.ndarray:
    """Predict each row's slowdown as its stage's in the previous slot, else
    (the stage did not run there) the device's in the previous slot, else 1."""
    return _reference(d.X)


def moving_average(d: Recorded, k: int = 5) -> np.ndarray:
    """Predict each row's slowdown as the mean of its stage's last ``k``
    slots (earlier slots only, in recording order); a stage never seen
    before falls back to :func:`last_value`."""
    fallback = last_value(d)
    seen: dict[str, list[float]] = {}
    out = np.empty(len(d))
    order = np.argsort(d.slot, kind="stable")
    for slot in np.unique(d.slot):
        rows = order[d.slot[order] == slot]
        for i in rows:
            prev = seen.get(d.stage[i], [])[-k:]
            out[i] = float(np.mean(prev)) if prev else fallback[i]
        for i in rows:
            seen.setdefault(d.stage[i], []).append(float(d.slowdown[i]))
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
        min_samples_leaf: int = 10,
        max_features: float = 0.33,
        refit_every: int = 32,
        window: int = 2000,
        error_window: int = 200,
        seed: int = 0,
        background: bool = True,
        trust_last: float = 0.2,
    ) -> None:
        self.trust_last = trust_last
        """Keep the stage's last measured slowdown when the forest predicts within
        this log-ratio of it (0: the forest alone); see :meth:`predict`."""
        self._base_X = np.empty((0, len(FEATURES))) if bootstrap is None else bootstrap.X
        self._base_y = np.empty(0) if bootstrap is None else np.log(bootstrap.slowdown)
        self._new_X: deque[list[float]] = deque(maxlen=window)
        self._new_y: deque[float] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=error_window)
        self._params = {"n_estimators": n_estimators, "min_samples_leaf": min_samples_leaf,
                        "random_state": seed, "n_jobs": 1, "max_features": max_features}
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
        """Predicted slowdowns, one per row of ``X`` (:data:`FEATURES` order).

        The forest's prediction, except where the stage has a measured slowdown
        from the previous slot and the forest lands within ``trust_last`` (in
        log ratio) of it: then nothing the agents report suggests a change, and
        the measurement, which averages a whole slot of the stage's own steps,
        is the better estimate. Chosen on inner time splits of the training rows
        of both recordings (``bench/RESULTS-adapt.md``)."""
        arr = np.asarray(X, dtype=float).reshape(-1, len(FEATURES))
        forest = self.predict_forest(arr)
        if self.trust_last <= 0:
            return forest
        last = arr[:, _STAGE_LAST]
        agree = (last > 0) & (np.abs(np.log(forest / np.maximum(last, 1e-12))) < self.trust_last)
        return np.where(agree, last, forest)

    def predict_forest(self, X: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
        """The forest's predictions alone."""
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
        self.observe_many([(x, slowdown)])

    def observe_many(self, rows: Iterable[tuple[Sequence[float], float]]) -> None:
        """Learn the samples of one slot: all are scored with the current fit
        before any is learnt."""
        good = [([float(v) for v in x], float(s)) for x, s in rows
                if math.isfinite(s) and s > 0]
        if not good:
            return
        if self.ready:
            pred = self.predict([x for x, _ in good])
            self._errors.extend(abs(p - s) / s for p, (_, s) in zip(pred, good, strict=True))
        with self._lock:
            for x, s in good:
                self._new_X.append(x)
                self._new_y.append(math.log(s))
            self._since_fit += len(good)
            due = self._since_fit >= self._refit_every
            if due:
                self._since_fit = 0
        if due:
            self._refit_soon()

    def importances(self) -> dict[str, float]:
        """The current fit's feature importances (impurity based), by name."""
        if self._model is None:
            self.fit()
        with self._lock:
            model = self._model
        return {f: float(v) for f, v in zip(FEATURES, model.feature_importances_, strict=True)}

    def error(self) -> Mapping[str, float]:
        """Running error over the last samples, each predicted before it was learnt:
        ``mape`` (percent) and ``samples``."""
        errs = list(self._errors)
        return {"mape": float(np.mean(errs) * 100.0) if errs else math.nan,
                "samples": float(len(errs)), "fits": float(self.fits),
                "trained_on": float(len(self._base_y) + len(self._new_y))}
