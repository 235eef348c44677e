"""Wrong plans are refused with a message naming the problem; random plans are valid."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hetpilot.planner.errors import InvalidPlanError
from hetpilot.planner.serde import plan_from_dict
from hetpilot.trainer.plans import FilePlanSource, StaticPlanSource, check_plan, random_plan

DEVICES = ["local:0", "local:1", "local:2"]


def _plan(**changes: object) -> dict:
    plan = {
        "microbatch_size": 2,
        "schedule": "1f1b",
        "groups": [
            {"samples": 10, "stages": [{"device": "local:0", "layers": [0, 3]},
                                       {"device": "local:1", "layers": [3, 6]}]},
            {"samples": 6, "stages": [{"device": "local:2", "layers": [0, 6]}]},
        ],
    }
    plan.update(changes)
    return plan


def test_good_plan_passes() -> None:
    orders = check_plan(plan_from_dict(_plan()), DEVICES, 6, 16)
    assert len(orders) == 2 and len(orders[0]) == 2


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (lambda p: p["groups"][0]["stages"][1].update(layers=[3, 9]),
         "plan.groups[0].stages[1].layers", "past the model's 6 layers"),
        (lambda p: p["groups"][1]["stages"][0].update(device="gpu9:0"),
         "plan.groups[1].stages[0].device", "no rank has device 'gpu9:0'"),
        (lambda p: p["groups"][1].update(samples=8),
         "plan.groups", "samples sum to 18, but the global batch is 16"),
        (lambda p: p["groups"][1].update(samples=5),
         "plan.groups[1].samples", "multiple of microbatch_size"),
        (lambda p: p["groups"][0]["stages"][1].update(layers=[4, 6]),
         "plan.groups[0].stages[1].layers", "must start at layer 3"),
    ],
)
def test_wrong_plans_are_refused(mutate, field: str, words: str) -> None:
    data = _plan()
    mutate(data)
    with pytest.raises(InvalidPlanError) as info:
        check_plan(plan_from_dict(data), DEVICES, 6, 16)
    assert info.value.field == field
    assert words in str(info.value)


def test_deadlocking_custom_order_is_refused() -> None:
    data = _plan(schedule="custom")
    # stage 0 waits for B0 before it sends F1; stage 1 wants F1 before it runs F0
    rest = [x for k in range(2, 5) for x in (f"F{k}", f"B{k}")]
    data["groups"][0]["stages"][0]["order"] = ["F0", "B0", "F1", "B1", *rest]
    data["groups"][0]["stages"][1]["order"] = ["F1", "B1", "F0", "B0", *rest]
    data["groups"][1]["stages"][0]["order"] = [x for k in range(3) for x in (f"F{k}", f"B{k}")]
    with pytest.raises(InvalidPlanError) as info:
        check_plan(plan_from_dict(data), DEVICES, 6, 16)
    assert "deadlock" in str(info.value)
    assert info.value.field.startswith("plan.groups[0].stages[")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "custom"])
def test_random_plans_are_valid(schedule: str) -> None:
    rng = random.Random(7)
    for _ in range(50):
        plan = random_plan(rng, [*DEVICES, "local:3"], 6, 16, 2, schedule,
                           leave_idle=rng.random() < 0.5)
        check_plan(plan, [*DEVICES, "local:3"], 6, 16)
        assert plan.schedule == schedule


def test_sources(tmp_path) -> None:
    plans = [plan_from_dict(_plan()), plan_from_dict(_plan(schedule="gpipe"))]
    src = StaticPlanSource(plans, at_epoch=[0, 2])
    first = src.poll(0)
    assert first is not None and first.version == 1
    assert src.poll(1) is None
    assert src.poll(1, epoch=1) is None
    second = src.poll(1, epoch=2)
    assert second is not None and second.version == 2
    path = tmp_path / "plan.json"
    import json

    path.write_text(json.dumps({**_plan(), "version": 3}))
    fsrc = FilePlanSource(path)
    got = fsrc.poll(0)
    assert got is not None and got.version == 3
    assert fsrc.poll(3) is None


@pytest.mark.parametrize("version", [{}, "F0", 0, 2**70, None])
def test_a_plan_files_bad_version_is_named(tmp_path: Path, version: object) -> None:
    """`hetpilot train --plan` had raised a bare TypeError/ValueError (a traceback, exit 1)
    for a version that is not a positive integer."""
    import json

    from hetpilot.planner.errors import ValidationError

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**_plan(), "version": version}))
    with pytest.raises(ValidationError, match=r"^plan\.version: must be"):
        FilePlanSource(path).poll(0)
