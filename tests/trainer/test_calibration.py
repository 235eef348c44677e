"""Layer times corrected from stage timings (hetpilot.trainer.calibration): pure, no torch."""

from __future__ import annotations

from typing import Any

import pytest
from hetpilot.planner.types import Group, Plan, Stage
from hetpilot.trainer.calibration import StageCalibration, stage_ratio

# two ranks, a 2-stage pipeline of 4 layers, microbatch 4, 16 samples (4 microbatches)
PLAN = Plan(microbatch_size=4, schedule="1f1b", groups=(Group(samples=16, stages=(
    Stage(device="h:0", layers=(0, 2)), Stage(device="h:1", layers=(2, 4), recompute=True))),))
# measured at microbatch 8: layers 0-1 take 10 ms forward and 20 ms backward each
MEAS = {"microbatch": 8, "dtype": "float32", "links": {"h:1": (1e-4, 10.0)},
        "layers": {i: (0.010, 0.020) for i in range(4)}}


def _record(rank: int, fwd_s: float, bwd_s: float, **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "plan_version": 3, "group": 0, "stage": rank, "fwd_s": fwd_s,
            "bwd_s": bwd_s, **extra}


class Recorder:
    def __init__(self, measurements: list[Any], **kw: Any) -> None:
        self.sent: list[list[Any]] = []
        self.cal = StageCalibration(measurements, lambda v: PLAN if v == 3 else None,
                                    self.sent.append, **kw)


def test_the_ratio_is_over_the_stage_at_the_plans_mean_microbatch() -> None:
    # stage 0 at microbatch 4 is predicted (2 x 30 ms) x 4/8 = 30 ms
    assert stage_ratio(_record(0, 0.010, 0.020), PLAN, MEAS) == pytest.approx(1.0)
    # stage 1 recomputes: its backward counts the forward again, (20 + 60) x 4/8 = 40 ms
    assert stage_ratio(_record(1, 0.010, 0.050), PLAN, MEAS) == pytest.approx(1.5)
    # 10 samples in microbatches of 4: mean size 10/3, not 4
    uneven = Plan(microbatch_size=4, schedule="1f1b", groups=(Group(samples=10, stages=(
        Stage(device="h:0", layers=(0, 4)),)),))
    assert stage_ratio(_record(0, 0.060, 0.060), uneven, MEAS) == pytest.approx(
        0.120 / (0.120 * (10 / 3) / 8))
    # nothing to say: an idle rank, a layer nobody measured, no op time
    assert stage_ratio({"rank": 0, "group": None, "stage": None}, PLAN, MEAS) is None
    assert stage_ratio(_record(0, 0.01, 0.02), PLAN, {**MEAS, "layers": {0: (0.01, 0.02)}}) is None
    assert stage_ratio(_record(0, 0.0, 0.0), PLAN, MEAS) is None


def test_three_slots_off_on_the_same_side_send_the_measurement_scaled() -> None:
    r = Recorder([MEAS, MEAS])
    r.cal(_record(0, 0.005, 0.010))  # 0.5x
    r.cal(_record(0, 0.007, 0.014))  # 0.7x: two slots are not enough
    assert r.sent == []
    r.cal(_record(0, 0.006, 0.012))  # 0.6x: three in a row, scaled by their median
    assert len(r.sent) == 1 and r.sent[0][1] is None
    new = r.sent[0][0]
    # at the plan's microbatch (4), 0.6 x the measurement scaled to it, no links
    assert new["microbatch"] == 4 and new["dtype"] == "float32" and "links" not in new
    assert new["layers"][3] == pytest.approx((0.010 * 0.6 / 2, 0.020 * 0.6 / 2))
    assert r.cal.corrections == [(0, pytest.approx(0.6))]
    # the new measurement predicts what the stage now takes: no further correction
    assert stage_ratio(_record(0, 0.006, 0.012), PLAN, new) == pytest.approx(1.0)
    for _ in range(4):
        r.cal(_record(0, 0.006, 0.012))
    assert len(r.sent) == 1
    # slower than measured works the same way: stage 1 is predicted 40 ms (recompute)
    for total in (0.100, 0.080, 0.120):  # 2.5x, 2x, 3x
        r.cal(_record(1, 0.020, total - 0.020))
    assert len(r.sent) == 2 and r.sent[1][0] is None
    assert r.cal.corrections[-1] == (1, pytest.approx(2.5))


def test_slots_within_the_band_or_on_both_sides_change_nothing() -> None:
    r = Recorder([MEAS, MEAS])
    for f in (0.0105, 0.0095, 0.0108, 0.0092):  # within 10%
        r.cal(_record(0, f, 2 * f))
    for f in (0.005, 0.020, 0.005, 0.020, 0.005):  # alternating halves and doubles
        r.cal(_record(0, f, 2 * f))
    assert r.sent == [] and r.cal.corrections == []


def test_slots_that_say_nothing_are_not_counted() -> None:
    r = Recorder([MEAS, None])
    fast = _record(0, 0.005, 0.010)
    for rec in (
        {**fast, "switch_s": 0.2},  # opened by a plan switch: warm-up
        {**fast, "plan_version": 2},  # not the trainer's current plan
        {**fast, "emulated_tflops": 10.0},  # emulated: the measurement by construction
        {**fast, "rank": 1},  # a rank that sent no measurement
        {**fast, "rank": 7},  # no such rank
    ):
        r.cal(rec)
        r.cal(rec)
    assert r.sent == []
    # the ones counted need not be adjacent to those left out
    r.cal(fast)
    r.cal({**fast, "switch_s": 0.1})
    r.cal(fast)
    r.cal(fast)
    assert len(r.sent) == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="band"):
        StageCalibration([MEAS], lambda v: PLAN, print, band=0.0)
    with pytest.raises(ValueError, match="confirm"):
        StageCalibration([MEAS], lambda v: PLAN, print, confirm=0)
