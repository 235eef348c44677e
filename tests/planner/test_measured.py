"""The fit of measured layer times (hetpilot.planner.measured) on hand-computed cases."""

from __future__ import annotations

import math

import pytest
from hetpilot.planner.measured import MIN_TIME_S, DeviceTimes, effective_model, fit_speeds
from hetpilot.planner.types import Layer, Model

# profiled per-sample GFLOP of three layers (forward total 6)
PROFILED_FWD = [1.0, 2.0, 3.0]
PROFILED_BWD = [2.0, 4.0, 6.0]
# what the layers really cost, in the same units (forward total 6 as well): the middle
# layer is slower and the last faster than the FLOP count says; backward not 2x forward
TRUE_FWD = [1.0, 3.0, 2.0]
TRUE_BWD = [3.0, 5.0, 1.0]


def _times(tflops: float, microbatch: int, skip: tuple[int, ...] = ()) -> DeviceTimes:
    s = 1000.0 * tflops
    return DeviceTimes(microbatch, {
        layer: (microbatch * TRUE_FWD[layer] / s, microbatch * TRUE_BWD[layer] / s)
        for layer in range(3) if layer not in skip})


def test_exact_rank_one_data_is_recovered() -> None:
    # device A: 40 TFLOP/s measured at microbatch 4; B: 10 TFLOP/s at microbatch 8
    # (times scale linearly in the microbatch size); e.g. A's layer 1 forward:
    # 4 * 3.0 / (1000 * 40) = 0.3 ms
    measured = {"A": _times(40.0, 4), "B": _times(10.0, 8)}
    assert measured["A"].layers[1][0] == pytest.approx(3e-4)
    fit = fit_speeds(measured, PROFILED_FWD, PROFILED_BWD)
    assert fit.tflops == pytest.approx({"A": 40.0, "B": 10.0}, rel=1e-9)
    assert fit.fwd_gflop == pytest.approx(TRUE_FWD, rel=1e-9)
    assert fit.bwd_gflop == pytest.approx(TRUE_BWD, rel=1e-9)
    assert fit.rms_log_error < 1e-9 and fit.measured_layers == {0, 1, 2}
    # the fit reproduces every measurement, at the measured microbatch sizes
    for dev, times in measured.items():
        for layer, (f, b) in times.layers.items():
            assert fit.predict(dev, layer, times.microbatch) == pytest.approx((f, b), rel=1e-9)


def test_a_device_with_a_layer_missing_still_gets_its_speed() -> None:
    measured = {"A": _times(40.0, 4), "B": _times(10.0, 4, skip=(1,)),
                "C": _times(25.0, 2, skip=(0, 2))}
    fit = fit_speeds(measured, PROFILED_FWD, PROFILED_BWD)
    assert fit.tflops == pytest.approx({"A": 40.0, "B": 10.0, "C": 25.0}, rel=1e-6)
    assert fit.fwd_gflop == pytest.approx(TRUE_FWD, rel=1e-6)
    assert fit.bwd_gflop == pytest.approx(TRUE_BWD, rel=1e-6)


def test_scale_is_the_profiled_forward_total_and_noise_is_averaged() -> None:
    # scaled times (every layer 2x slower on both devices) give the same GFLOP and
    # half the speeds: the effective forward total stays the profile's 6 GFLOP
    slow = {d: DeviceTimes(t.microbatch, {k: (2 * f, 2 * b) for k, (f, b) in t.layers.items()})
            for d, t in {"A": _times(40.0, 4), "B": _times(10.0, 4)}.items()}
    fit = fit_speeds(slow, PROFILED_FWD, PROFILED_BWD)
    assert sum(fit.fwd_gflop) == pytest.approx(6.0)
    assert fit.tflops == pytest.approx({"A": 20.0, "B": 5.0})
    # A +10% on layer 0's forward, -10% on layer 1's forward: the log least-squares
    # fit spreads it; the reported error is its root mean square in log units
    a = _times(40.0, 4)
    noisy = dict(a.layers)
    noisy[0] = (noisy[0][0] * 1.1, noisy[0][1])
    noisy[1] = (noisy[1][0] / 1.1, noisy[1][1])
    fit = fit_speeds({"A": DeviceTimes(4, noisy), "B": _times(10.0, 4)}, PROFILED_FWD,
                     PROFILED_BWD)
    assert 0 < fit.rms_log_error < math.log(1.1)
    assert fit.tflops["A"] / fit.tflops["B"] == pytest.approx(4.0, rel=0.05)


def test_zero_times_unmeasured_layers_and_disconnected_devices() -> None:
    # layer 2 has no backward (0 s): floored, so a tiny positive GFLOP, never 0 or NaN
    a = _times(40.0, 4)
    layers = dict(a.layers)
    layers[2] = (layers[2][0], 0.0)
    fit = fit_speeds({"A": DeviceTimes(4, layers)}, PROFILED_FWD, PROFILED_BWD)
    assert fit.bwd_gflop[2] == pytest.approx(MIN_TIME_S * 1000 * fit.tflops["A"] / 4)
    assert fit.tflops["A"] == pytest.approx(40.0)
    # a layer no device measured keeps its profile; devices that share no layer each
    # get the scale of their own layers' profile
    fit = fit_speeds({"A": _times(40.0, 4, skip=(1, 2)), "B": _times(10.0, 4, skip=(0, 1))},
                     PROFILED_FWD, PROFILED_BWD)
    assert fit.fwd_gflop[1] == PROFILED_FWD[1] and fit.bwd_gflop[1] == PROFILED_BWD[1]
    assert fit.fwd_gflop[0] == pytest.approx(PROFILED_FWD[0])
    assert fit.fwd_gflop[2] == pytest.approx(PROFILED_FWD[2])
    assert fit.tflops["A"] == pytest.approx(40.0 * PROFILED_FWD[0] / TRUE_FWD[0])
    assert fit.tflops["B"] == pytest.approx(10.0 * PROFILED_FWD[2] / TRUE_FWD[2])
    # a device that measured nothing (or nothing above the timer's floor) gets no speed
    fit = fit_speeds({"A": a, "C": DeviceTimes(4, {}), "D": DeviceTimes(4, {0: (0.0, 0.0)})},
                     PROFILED_FWD, PROFILED_BWD)
    assert set(fit.tflops) == {"A"} and fit.tflops["A"] == pytest.approx(40.0)
    with pytest.raises(ValueError, match="layer 3 outside"):
        fit_speeds({"A": DeviceTimes(1, {3: (1.0, 1.0)})}, PROFILED_FWD, PROFILED_BWD)
    with pytest.raises(ValueError, match="microbatch must be >= 1"):
        fit_speeds({"A": DeviceTimes(0, {0: (1.0, 1.0)})}, PROFILED_FWD, PROFILED_BWD)


def test_effective_model_keeps_bytes_and_names() -> None:
    model = Model(name="m", layers=tuple(
        Layer(name=f"l{i}", fwd_gflop=f, bwd_gflop=b, out_mb=1.0 + i, act_mb=2.0, param_mb=3.0)
        for i, (f, b) in enumerate(zip(PROFILED_FWD, PROFILED_BWD, strict=True))))
    fit = fit_speeds({"A": _times(40.0, 4)}, PROFILED_FWD, PROFILED_BWD)
    eff = effective_model(model, fit)
    assert [x.fwd_gflop for x in eff.layers] == pytest.approx(TRUE_FWD)
    assert [(x.name, x.out_mb, x.act_mb, x.param_mb) for x in eff.layers] == [
        (x.name, x.out_mb, x.act_mb, x.param_mb) for x in model.layers]
