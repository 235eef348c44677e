"""Estimator benchmark: MAPE of predicted stage time on held-out recorded data.

    .venv/bin/python bench/adapt_estimator.py [--data adapt/data/bootstrap.csv]

Time split: the first 70% of rows (in recording order) train, the last 30%
are held out. Predicted stage time = the stage's quiet time x predicted
slowdown. Predictors, on the same held-out rows:

- ``rf (offline)``: the forest fitted on the training rows only;
- ``rf (online)``: the same, then learning each held-out row after predicting
  it (refit every 16 rows), as the daemon does;
- ``last value``: the previous row's slowdown (same device, any stage);
- ``moving average``: the mean slowdown of the previous 5 rows.

Rows are real measurements (real co-located processes, real torch stages,
:mod:`hetpilot.adapt.collect`); nothing is emulated.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from hetpilot.adapt.estimator import (
    SlowdownEstimator,
    last_value,
    load_recorded,
    mape,
    moving_average,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="adapt/data/bootstrap.csv")
    p.add_argument("--train", type=float, default=0.7)
    a = p.parse_args()
    d = load_recorded(a.data)
    cut = int(len(d) * a.train)
    tr, te = d.take(np.arange(cut)), d.take(np.arange(cut, len(d)))
    loaded = te.X[:, 1] > 0.3  # co-located load above 30%: "under interference"
    est = SlowdownEstimator(tr, background=False)
    est.fit()
    off = est.predict(te.X)
    online = SlowdownEstimator(tr, background=False, refit_every=16)
    online.fit()
    on = np.empty(len(te))
    for i in range(len(te)):
        on[i] = online.predict_one(te.X[i])
        online.observe(te.X[i], float(te.slowdown[i]))
    preds = {
        "rf (offline)": off,
        "rf (online)": on,
        "last value": last_value(d.slowdown)[cut:],
        "moving average (5)": moving_average(d.slowdown)[cut:],
    }
    out = {"rows": len(d), "train": cut, "held_out": len(te), "held_out_loaded": int(loaded.sum()),
           "slowdown_quartiles": np.percentile(te.slowdown, [25, 50, 75]).round(2).tolist(),
           "mape_pct": {}}
    for name, s in preds.items():
        t = s * te.quiet_s
        out["mape_pct"][name] = {"all": round(mape(t, te.measured_s), 1),
                                 "loaded": round(mape(t[loaded], te.measured_s[loaded]), 1)}
    out["online_self_reported"] = {k: round(v, 1) for k, v in online.error().items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
