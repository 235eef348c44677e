"""Estimator benchmark: MAPE of predicted stage time on held-out recorded data.

    .venv/bin/python bench/adapt_estimator.py [--data adapt/data/bootstrap.csv] [--no-pool]

Time split: the episodes that start in the first 70% of rows (in recording
order) train, the rest are held out. The estimators train on those rows plus,
as the daemon's bootstrap set does, every other recording packaged in
``adapt/data/`` (``--no-pool``: the training rows of ``--data`` alone). Predicted stage time = the stage's
quiet time x predicted slowdown. Predictors, on the same held-out rows:

- ``estimator (offline)``: :class:`SlowdownEstimator` as the daemon runs it
  (the forest, keeping the stage's last measured slowdown where the forest
  agrees with it within ``trust_last`` = 0.2 in log ratio), fitted on the
  training rows only;
- ``estimator (online)``: the same, then learning each held-out slot after
  predicting all its rows (refit every 16 rows), as the daemon does;
- ``forest alone (offline / online)``: the same without the last value;
- ``last value``: the stage's slowdown in the previous slot, or, when it did
  not run there, the device's (mean over the stages of the previous slot);
- ``moving average (5)``: the mean of the stage's last 5 slots.

Subsets: ``all``; ``under load`` (rows with our worker processes running;
the agent's co-located load is above 30% on nearly every row, quiet or not,
because of other work on this shared machine);
``first slot`` (an episode's first slot: configuration and stages just
changed); ``new stage`` (the stage did not run in the previous slot: no
last value of its own). ``noise floor`` is not a predictor: each row
predicted by the mean of the *other* slots of the same stage in the same
episode (same load, same stage; it looks ahead), i.e. how much a slot's time
varies when nothing we control changes.

Rows are real measurements (real co-located processes, real torch stages,
:mod:`hetpilot.adapt.collect`); nothing is emulated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from hetpilot.adapt.estimator import (
    Recorded,
    SlowdownEstimator,
    episode_starts,
    last_value,
    load_bootstrap,
    load_recorded,
    mape,
    moving_average,
    packaged_recordings,
    time_split,
)
from hetpilot.adapt.features import FEATURES


def noise_floor(d: Recorded, episode_of: np.ndarray) -> np.ndarray:
    """Mean slowdown of the other slots of the same stage and episode."""
    out = np.full(len(d), np.nan)
    stage = np.array(d.stage)
    for i in range(len(d)):
        same = (episode_of == episode_of[i]) & (stage == stage[i])
        same[i] = False
        if same.any():
            out[i] = d.slowdown[same].mean()
    return out


def online_predictions(tr: Recorded, te: Recorded, refit_every: int = 16, trust_last: float = 0.2,
                       ) -> tuple[np.ndarray, dict[str, float]]:
    est = SlowdownEstimator(tr, background=False, refit_every=refit_every,
                            error_window=len(te), trust_last=trust_last)
    est.fit()
    out = np.empty(len(te))
    for slot in np.unique(te.slot):
        rows = np.flatnonzero(te.slot == slot)
        out[rows] = est.predict(te.X[rows])
        est.observe_many((te.X[i], float(te.slowdown[i])) for i in rows)
    return out, dict(est.error())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="adapt/data/bootstrap.csv")
    p.add_argument("--train", type=float, default=0.7)
    p.add_argument("--no-pool", dest="pool", action="store_false",
                   help="train on --data's training rows alone")
    a = p.parse_args()
    d = load_recorded(a.data)
    cut = time_split(d, a.train)
    own, te = d.take(np.arange(cut)), d.take(np.arange(cut, len(d)))
    others = [n for n in packaged_recordings() if n != Path(a.data).name] if a.pool else []
    tr = Recorded.concat([load_bootstrap(exclude=[a.data]), own]) if others else own
    episode_of = np.cumsum(episode_starts(d))
    subsets = {
        "all": np.ones(len(te), dtype=bool),
        "under load": te.injected > 0,
        "first slot": te.first,
        "new stage": te.X[:, FEATURES.index("stage_last_slowdown")] <= 0,
    }
    est = SlowdownEstimator(tr, background=False)
    est.fit()
    online, online_err = online_predictions(tr, te)
    forest_online, _ = online_predictions(tr, te, trust_last=0.0)
    preds = {
        "estimator (offline)": est.predict(te.X),
        "estimator (online)": online,
        "forest alone (offline)": est.predict_forest(te.X),
        "forest alone (online)": forest_online,
        "last value": last_value(te),
        "moving average (5)": moving_average(d)[cut:],
        "noise floor (looks ahead)": noise_floor(d, episode_of)[cut:],
    }
    out: dict[str, object] = {
        "rows": len(d), "train": cut, "held_out": len(te),
        "also_trained_on": others,
        "held_out_rows": {k: int(m.sum()) for k, m in subsets.items()},
        "slowdown_quartiles": np.percentile(te.slowdown, [25, 50, 75]).round(2).tolist(),
    }
    table: dict[str, dict[str, float]] = {}
    for name, s in preds.items():
        t = s * te.quiet_s
        table[name] = {}
        for k, m in subsets.items():
            ok = m & np.isfinite(t)
            table[name][k] = round(mape(t[ok], te.measured_s[ok]), 1)
    out["mape_pct"] = table
    bands: dict[str, dict[str, float]] = {}
    for lo, hi in ((1.0, 1.2), (1.2, 1.5), (1.5, np.inf), (1.3, np.inf)):
        m = (te.injected > 0) & (te.slowdown >= lo) & (te.slowdown < hi)
        if m.any():
            bands[f"slowdown {lo:g}-{hi:g}"] = {"rows": int(m.sum()), **{
                name: round(mape(preds[name][m] * te.quiet_s[m], te.measured_s[m]), 1)
                for name in ("estimator (online)", "last value")}}
    out["under_load_by_slowdown"] = bands
    out["online_self_reported"] = {k: round(v, 1) for k, v in online_err.items()}
    out["importance"] = dict(sorted(
        ((f, round(v, 3)) for f, v in est.importances().items()), key=lambda kv: -kv[1])[:8])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
