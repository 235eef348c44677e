"""The slowdown estimator on the recorded bootstrap set (adapt/data/bootstrap.csv)."""

from __future__ import annotations

import numpy as np
import pytest
from hetpilot.adapt.estimator import (
    Recorded,
    SlowdownEstimator,
    last_value,
    load_recorded,
    mape,
    moving_average,
    time_split,
)
from hetpilot.adapt.features import FEATURES, HISTORY


@pytest.fixture(scope="module")
def data() -> Recorded:
    return load_recorded()


def test_recorded_set_is_slots_of_real_measurements(data: Recorded) -> None:
    assert len(data) >= 500
    assert data.X.shape == (len(data), len(FEATURES))
    assert np.all(data.slowdown > 0) and np.allclose(data.slowdown,
                                                     data.measured_s / data.quiet_s, rtol=1e-3)
    assert np.all(np.diff(data.slot) >= 0) and np.all(np.diff(data.t) >= 0)  # time order
    # the history columns are the previous slot's measured slowdowns
    stage_last = data.X[:, FEATURES.index(HISTORY[0])]
    for i in np.flatnonzero(stage_last > 0)[:50]:
        prev = np.flatnonzero((data.slot == data.slot[i] - 1)
                              & (np.array(data.stage) == data.stage[i]))
        assert len(prev) == 1
        assert stage_last[i] == pytest.approx(data.slowdown[prev[0]], rel=1e-3)


def test_time_split_keeps_episodes_whole(data: Recorded) -> None:
    cut = time_split(data, 0.7)
    assert 0.6 * len(data) < cut < 0.8 * len(data)
    assert data.first[cut] and data.slot[cut] != data.slot[cut - 1]


def test_forest_beats_last_value_and_moving_average_on_held_out_rows(data: Recorded) -> None:
    cut = time_split(data, 0.7)
    tr, te = data.take(np.arange(cut)), data.take(np.arange(cut, len(data)))
    est = SlowdownEstimator(tr, n_estimators=30, background=False)
    forest = mape(est.predict(te.X), te.slowdown)
    assert forest < mape(last_value(te), te.slowdown)
    assert forest < mape(moving_average(data)[cut:], te.slowdown)
    # and on the rows whose stage has no last value of its own (re-cut, new stage)
    new = te.X[:, FEATURES.index(HISTORY[0])] <= 0
    assert new.sum() >= 20
    assert mape(est.predict(te.X[new]), te.slowdown[new]) < mape(last_value(te)[new],
                                                                  te.slowdown[new])


def test_error_reports_prequential_mape(data: Recorded) -> None:
    cut = time_split(data, 0.7)
    tr, te = data.take(np.arange(cut)), data.take(np.arange(cut, cut + 60))
    est = SlowdownEstimator(tr, n_estimators=20, refit_every=4, error_window=1000,
                            background=False)
    preds = np.empty(len(te))
    for slot in np.unique(te.slot):
        rows = np.flatnonzero(te.slot == slot)
        preds[rows] = est.predict(te.X[rows])  # before the slot is learnt
        est.observe_many((te.X[i], float(te.slowdown[i])) for i in rows)
    err = est.error()
    assert err["samples"] == len(te)
    assert err["mape"] == pytest.approx(mape(preds, te.slowdown), rel=1e-9)
    assert err["fits"] >= 1 + len(te) // 6  # refit once 4 samples are new: every 2 slots of 3
    assert err["trained_on"] == cut + len(te)


def test_baselines() -> None:
    # three slots; stage a runs in slots 0, 1 and 2, stage b only in slot 2
    X = np.zeros((4, len(FEATURES)))
    s_last, d_last = FEATURES.index(HISTORY[0]), FEATURES.index(HISTORY[1])
    X[1, [s_last, d_last]] = 2.0, 2.0
    X[2, [s_last, d_last]] = 3.0, 3.0
    X[3, d_last] = 3.0
    s = np.array([2.0, 3.0, 4.0, 5.0])
    d = Recorded(X, s, np.ones(4), s, ("a", "a", "a", "b"), np.arange(4.0),
                 np.array([0, 1, 2, 2]), np.array([True, False, False, False]), np.ones(4))
    assert last_value(d).tolist() == [1.0, 2.0, 3.0, 3.0]
    assert moving_average(d, k=5).tolist() == [1.0, 2.0, 2.5, 3.0]


def test_last_measurement_is_kept_only_where_the_forest_agrees_with_it(data: Recorded) -> None:
    cut = time_split(data, 0.7)
    tr, te = data.take(np.arange(cut)), data.take(np.arange(cut, len(data)))
    est = SlowdownEstimator(tr, n_estimators=20, background=False, trust_last=0.2)
    forest, blended = est.predict_forest(te.X), est.predict(te.X)
    last = te.X[:, FEATURES.index(HISTORY[0])]
    agree = (last > 0) & (np.abs(np.log(forest / np.where(last > 0, last, 1.0))) < 0.2)
    assert agree.any() and (~agree).any()
    np.testing.assert_array_equal(blended[agree], last[agree])
    np.testing.assert_array_equal(blended[~agree], forest[~agree])
    est.trust_last = 0.0
    np.testing.assert_array_equal(est.predict(te.X), forest)


def test_bootstrap_joins_every_packaged_recording_with_distinct_slots() -> None:
    from importlib import resources

    from hetpilot.adapt.estimator import load_bootstrap, packaged_recordings

    names = packaged_recordings()
    assert "bootstrap.csv" in names and len(names) >= 2
    folder = resources.files("hetpilot.adapt") / "data"
    parts = [load_recorded(str(folder / n)) for n in names]
    joined = load_bootstrap()
    assert len(joined) == sum(len(p) for p in parts)
    # slots of different recordings never merge (the online bench groups rows by slot)
    assert len(np.unique(joined.slot)) == sum(len(np.unique(p.slot)) for p in parts)
    assert np.array_equal(joined.slowdown[: len(parts[0])], parts[0].slowdown)
    less = load_bootstrap(exclude=[f"some/dir/{names[0]}"])
    assert len(less) == len(joined) - len(parts[0])
