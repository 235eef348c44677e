"""Re-planning gate: no flapping on a spike shorter than a slot, a real change
is followed (one slot later), the gain must beat the switching cost; the
controller keeps its state and contract with the gate and predict hooks."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hetpilot.adapt.gate import GateConfig, ReplanGate
from hetpilot.planner.controller import Controller, ControllerConfig
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.types import Cluster
from hetpilot.sim.engine import Observer
from hetpilot.sim.policies import CachedSearch
from hetpilot.sim.scenario import Timeline, scenario_from_dict

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = json.loads((ROOT / "examples" / "scenario.json").read_text())
_SEARCH: dict[str, CachedSearch] = {}


def _scenario(events: list[dict[str, Any]], slots: int = 10) -> Any:
    data = copy.deepcopy(EXAMPLE)
    data["job"]["budgets"] = {}
    data.update(slots=slots, events=events)
    return scenario_from_dict(data)


def _run(events: list[dict[str, Any]], gate: ReplanGate | None) -> list[bool]:
    """Drive a controller through the scenario the way the simulator does
    (slot t observes slot t-1's truth); the switched flag per slot."""
    sc = _scenario(events)
    if "s" not in _SEARCH:
        from hetpilot.planner.search import candidate_plans

        _SEARCH["s"] = CachedSearch(candidate_plans)
    ctl = Controller(sc.model, sc.job, ControllerConfig(iterations_per_slot=sc.iterations_per_slot),
                     search=_SEARCH["s"], gate=gate)
    obs = Observer(Timeline(sc))
    return [ctl.step(obs.observe(t)).switched for t in range(sc.slots)]


SPIKE = [{"slot": 4, "device": "c:0", "tflops_scale": 0.2},
         {"slot": 5, "device": "c:0", "tflops_scale": 1.0}]


def test_without_gate_a_one_slot_spike_flaps() -> None:
    """The premise: the plain controller re-cuts for the spike and back."""
    switched = _run(SPIKE, None)
    assert switched[0] and sum(switched[1:]) >= 2


def test_gate_no_switch_for_a_spike_shorter_than_a_slot() -> None:
    switched = _run(SPIKE, ReplanGate())
    assert switched[0] and not any(switched[1:])


def test_gate_follows_a_lasting_change_one_slot_later() -> None:
    switched = _run([{"slot": 4, "device": "c:0", "tflops_scale": 0.2}], ReplanGate())
    # slot 5 first sees the change (slot 4's truth), slot 6 confirms it
    assert [t for t, s in enumerate(switched) if s] == [0, 6]


def test_confirm_one_reacts_at_once() -> None:
    switched = _run([{"slot": 4, "device": "c:0", "tflops_scale": 0.2}],
                    ReplanGate(GateConfig(confirm_slots=1)))
    assert [t for t, s in enumerate(switched) if s] == [0, 5]


def test_gain_must_beat_switching_cost() -> None:
    gate = ReplanGate(GateConfig(confirm_slots=1, margin=1.0))
    gate.observe(_scenario([]).cluster)
    assert gate.admit(running_s=1.0, candidate_s=0.9, switch_s=5.0, iterations_left=100)
    assert not gate.admit(running_s=1.0, candidate_s=0.9, switch_s=20.0, iterations_left=100)
    assert "switch" in gate.held[-1]


def test_tolerance_ignores_noise_and_new_devices_count_as_change() -> None:
    cl: Cluster = _scenario([]).cluster
    gate = ReplanGate(GateConfig(tolerance=0.1))
    gate.observe(cl)
    noisy = replace(cl, devices=tuple(replace(d, tflops=d.tflops * 1.05) for d in cl.devices))
    gate.observe(noisy)
    assert gate.stable_for == 2
    gate.observe(cl.without({"a:0"}))
    assert gate.stable_for == 1


def test_state_round_trip_keeps_the_gate() -> None:
    sc = _scenario([])
    ctl = Controller(sc.model, sc.job, gate=ReplanGate())
    ctl.step(sc.cluster)
    state = json.loads(json.dumps(ctl.to_state()))
    gate = ReplanGate()
    Controller.from_state(sc.model, sc.job, state, gate=gate)
    assert gate.stable_for == 1
    old = {k: v for k, v in state.items() if k != "gate"}  # a state from before the gate
    Controller.from_state(sc.model, sc.job, old, gate=ReplanGate())
    with pytest.raises(ValidationError, match=r"state\.gate"):
        Controller.from_state(sc.model, sc.job, {**state, "gate": 3}, gate=ReplanGate())


def test_predict_hook_plans_on_predicted_speeds() -> None:
    sc = _scenario([])
    slow_c = lambda c: replace(c, devices=tuple(  # noqa: E731
        replace(d, tflops=d.tflops * (0.05 if d.id == "c:0" else 1.0)) for d in c.devices))
    plain = Controller(sc.model, sc.job).step(sc.cluster)
    predicted = Controller(sc.model, sc.job, predict=slow_c).step(sc.cluster)
    assert predicted.iteration_s > plain.iteration_s
    with pytest.raises(ValidationError, match=r"gate\.confirm_slots"):
        GateConfig(confirm_slots=0)


def test_staleness_model_fit_and_choice() -> None:
    from hetpilot.adapt.staleness import choose, fit

    m = fit([0, 0.5, 1.5], [100, 110, 130])
    assert abs(m.I0 - 100) < 1e-6 and abs(m.alpha - 0.2) < 1e-6
    # 4 stages async is 1.6x faster per iteration, but staleness 1.5 costs 1.3x: it wins;
    # with a steep alpha staleness costs more than it saves:
    assert choose(m, [(4, 1 / 1.6, True), (2, 1 / 1.2, True), (4, 1.0, False)]) == 0
    steep = fit([0, 1], [100, 200])
    assert choose(steep, [(4, 1 / 1.6, True), (2, 1 / 1.2, True), (4, 1.0, False)]) == 2  # sync wins
