"""Scenario validation, the truth timeline, the simulation loop and the CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hetpilot.planner.errors import ValidationError
from hetpilot.sim.engine import simulate, summarize
from hetpilot.sim.policies import CachedSearch
from hetpilot.sim.scenario import Timeline, scenario_from_dict

from hetpilot.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = json.loads((ROOT / "examples" / "scenario.json").read_text())


def _scenario(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(EXAMPLE)
    data.update(changes)
    return data


# -- validation ---------------------------------------------------------------------

@pytest.mark.parametrize(("event", "field"), [
    ({"slot": 3, "device": "zz:9", "down": True}, "scenario.events[0].device"),
    ({"slot": -1, "device": "a:0", "down": True}, "scenario.events[0].slot"),
    ({"slot": 999, "device": "a:0", "down": True}, "scenario.events[0].slot"),
    ({"slot": 1, "device": "a:0", "tflops_scale": 0}, "scenario.events[0].tflops_scale"),
    ({"slot": 1, "device": "a:0", "speed": 2}, "scenario.events[0].speed"),
    ({"slot": 1, "hosts": ["a", "nope"], "gbps": 1.0}, "scenario.events[0].hosts[1]"),
    ({"slot": 1, "hosts": ["a", [1, 2]], "gbps": 1.0}, "scenario.events[0].hosts[1]"),
    ({"slot": 1, "hosts": [{"a": 1}, "b"], "gbps": 1.0}, "scenario.events[0].hosts[0]"),
    ({"slot": 1, "hosts": ["a", "b"], "gbps": 1e-320}, "scenario.events[0].gbps"),
    ({"slot": 1, "device": "a:0", "tflops": 1e308}, "scenario.events[0].tflops"),
    ({"slot": 1, "hosts": ["a", "b"]}, "scenario.events[0].gbps"),
    ({"slot": 1, "budgets": {"euros": 1}}, "scenario.events[0].budgets.euros"),
    ({"slot": 1}, "scenario.events[0]"),
])
def test_bad_events_name_the_field(event: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        scenario_from_dict(_scenario(events=[event]))
    assert err.value.field == field


def test_bad_top_level_names_the_field() -> None:
    with pytest.raises(ValidationError, match=r"^scenario\.slots"):
        scenario_from_dict(_scenario(slots=0))
    with pytest.raises(ValidationError, match=r"^scenario\.slots: must be at most 1000000"):
        scenario_from_dict(_scenario(slots=2**40))  # would never end
    data = _scenario()
    del data["model"]
    with pytest.raises(ValidationError, match=r"^scenario\.model"):
        scenario_from_dict(data)
    with pytest.raises(ValidationError, match=r"^scenario\.job\.budgets\.price_per_hour"):
        scenario_from_dict(_scenario(job={**EXAMPLE["job"], "budgets": {"price_per_hour": -1}}))


def test_timeline_applies_events_from_their_slot() -> None:
    sc = scenario_from_dict(_scenario(slots=8, events=[
        {"slot": 2, "device": "c:0", "tflops_scale": 0.5},
        {"slot": 3, "device": "c:0", "price_per_hour": 9.0},
        {"slot": 4, "device": "c:0", "tflops_scale": 1.0},
        {"slot": 4, "hosts": ["a", "b"], "gbps": 3.0},
        {"slot": 5, "device": "a:1", "down": True},
        {"slot": 6, "device": "a:1", "down": False},
        {"slot": 6, "budgets": {"price_per_hour": 2.0}, "V": 50.0},
    ]))
    tl = Timeline(sc)
    assert tl.truth(1).by_id["c:0"].tflops == 400.0
    assert tl.truth(2).by_id["c:0"].tflops == 200.0
    assert tl.truth(3).by_id["c:0"].price_per_hour == 9.0
    assert tl.truth(4).by_id["c:0"].tflops == 400.0  # scale is on the nominal value
    assert tl.truth(4).link("a:0", "b:0")[0] == 3.0
    assert "a:1" not in tl.truth(5).by_id and "a:1" in tl.full(5).by_id
    assert "a:1" in tl.truth(6).by_id
    assert tl.budgets(5) == {"price_per_hour": 5.0} and tl.budgets(6) == {"price_per_hour": 2.0}
    assert tl.V(6) == 50.0
    assert tl.truth(0) is tl.truth(1)  # no event: the same object, so caches hit


# -- the loop -------------------------------------------------------------------------

FAIL = _scenario(slots=10, events=[
    {"slot": 3, "device": "c:0", "down": True},
    {"slot": 6, "device": "c:0", "down": False},
    {"slot": 4, "device": "a:0", "tflops_scale": 0.2},
])


@pytest.fixture(scope="module")
def search() -> CachedSearch:
    from hetpilot.planner.search import candidate_plans

    return CachedSearch(candidate_plans)


def test_down_device_never_in_a_plan_and_queues_follow_truth(search: CachedSearch) -> None:
    sc = scenario_from_dict(FAIL)
    tl = Timeline(sc)
    for policy in ("lyapunov", "static", "budget-greedy", "even-dp"):
        recs = list(simulate(sc, policy, timeline=tl, search=search))
        assert len(recs) == 10
        for r in recs:
            assert r.plan is not None
            if 3 <= r.slot < 6:
                assert "c:0" not in r.plan.devices
        q = 0.0
        for r in recs:
            q = max(q + r.costs["price_per_hour"] - 5.0, 0.0)
            assert r.queues["price_per_hour"] == pytest.approx(q)
    static = list(simulate(sc, "static", timeline=tl, search=search))
    assert sum(r.switched for r in static[1:]) <= 1 + int("c:0" in static[0].plan.devices)


def test_deterministic_given_a_seed(search: CachedSearch) -> None:
    sc = scenario_from_dict(FAIL)

    def run(seed: int) -> list[dict[str, Any]]:
        return [r.to_dict(True) for r in simulate(sc, "lyapunov", seed=seed, noise=0.1,
                                                  slots=6, search=search)]

    first = run(3)
    assert run(3) == first
    assert run(4) != first


def test_summary_averages() -> None:
    sc = scenario_from_dict(_scenario(slots=4, events=[]))
    recs = list(simulate(sc, "fastest"))
    s = summarize(recs)
    assert s["slots"] == 4 and s["stalled_slots"] == 0
    assert s["avg_iteration_s"] == pytest.approx(sum(r.iteration_s for r in recs) / 4, abs=1e-6)  # type: ignore[misc]
    assert s["avg_price_per_hour"] == pytest.approx(
        sum(r.costs["price_per_hour"] for r in recs) / 4, abs=1e-6)


def test_everything_down_stalls_instead_of_crashing() -> None:
    events = [{"slot": 1, "device": d["id"], "down": True} for d in EXAMPLE["cluster"]["devices"]]
    sc = scenario_from_dict(_scenario(slots=3, events=events))
    recs = list(simulate(sc, "lyapunov"))
    assert recs[0].iteration_s is not None
    assert recs[1].iteration_s is None and recs[2].plan is None
    assert any("stalled" in w for w in recs[1].warnings)


# -- command line ----------------------------------------------------------------------

def _write(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_cli_prints_json_lines_and_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, FAIL)
    assert main(["sim", "--scenario", path, "--slots", "5", "--emit-plans", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) == 6 and lines[-1]["summary"] is True
    for row in lines[:-1]:
        for key in ("slot", "iteration_s", "price_per_hour", "power_watts", "queues", "switched", "plan"):
            assert key in row
        assert row["plan"]["groups"]
    assert [row["slot"] for row in lines[:-1]] == list(range(5))


@pytest.mark.parametrize(("event", "field"), [
    ({"slot": 2, "device": "ghost:0", "down": True}, "scenario.events[0].device"),
    ({"slot": -3, "device": "a:0", "down": True}, "scenario.events[0].slot"),
])
def test_cli_bad_scenario_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 event: dict[str, Any], field: str) -> None:
    path = _write(tmp_path, _scenario(events=[event]))
    assert main(["sim", "--scenario", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "Traceback" not in err[0]


def test_cli_budget_below_cheapest_plan_is_a_warning(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data = _scenario(slots=3, events=[], job={**EXAMPLE["job"], "budgets": {"price_per_hour": 0.1}})
    path = _write(tmp_path, data)
    assert main(["sim", "--scenario", path]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and "job.budgets.price_per_hour" in captured.err
    summary = json.loads(captured.out.splitlines()[-1])
    assert summary["warnings"] and summary["stalled_slots"] == 0
    assert main(["sim", "--scenario", path, "--strict"]) == 2
    assert "job.budgets.price_per_hour" in capsys.readouterr().err


def test_cli_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, FAIL)
    assert main(["sim", "--scenario", path, "--policy", "magic"]) == 2
    assert "--policy" in capsys.readouterr().err
    assert main(["sim", "--scenario", path, "--sweep-V", "1,x"]) == 2
    assert "--sweep-V" in capsys.readouterr().err
    assert main(["sim", "--scenario", str(tmp_path / "missing.json")]) == 2


def test_cli_plot_and_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, FAIL)
    png = tmp_path / "out.png"
    assert main(["sim", "--scenario", path, "--slots", "4", "--policy", "lyapunov,static",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["sim", "--scenario", path, "--slots", "4", "--sweep-V", "1,1000"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["V"] for r in rows] == [1.0, 1000.0]
    assert main(["sim", "--scenario", path, "--slots", "3", "--table"]) == 0
    table = capsys.readouterr().out
    assert "summary" in table and "switch" in table
