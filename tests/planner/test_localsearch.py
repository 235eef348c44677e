"""Local search over device mappings: the neighbourhood and the descent."""

from __future__ import annotations

from hetpilot.planner.candidates import Candidate
from hetpilot.planner.localsearch import DeviceMapping, descend, neighbours
from hetpilot.planner.types import Device, Group, Plan, Stage


def _devs(n: int) -> list[Device]:
    return [Device(id=f"d{i}", host="h", tflops=10.0, memory_gb=10.0) for i in range(n)]


def _ids(groups: DeviceMapping) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(d.id for d in g) for g in groups)


def test_neighbours_are_one_move_away_each_once_and_never_empty() -> None:
    d = _devs(5)
    start = ((d[0], d[1], d[2]), (d[3],))
    found = [_ids(g) for g in neighbours(start, [d[4]])]
    assert len(found) == len(set(found))
    assert _ids(start) not in found
    assert all(found_g and all(found_g) for found_g in found)
    expected = {
        (("d2", "d1", "d0"), ("d3",)),            # reversed
        (("d1", "d0", "d2"), ("d3",)),            # swapped in a group
        (("d3", "d1", "d2"), ("d0",)),            # swapped across groups
        (("d0", "d1"), ("d3",), ("d2",)),         # moved to a group of its own
        (("d0", "d1", "d2", "d3"),),              # moved into another group
        (("d0", "d2"), ("d3",)),                  # dropped
        (("d0", "d4", "d2"), ("d3",)),            # replaced by an unused device
        (("d0", "d1", "d2"), ("d4", "d3")),       # an unused device joins
        (("d0", "d1", "d2"), ("d3",), ("d4",)),   # an unused device as a group
    }
    assert expected <= set(found)
    # every device appears once at most, and only the cluster's
    for groups in found:
        flat = [x for g in groups for x in g]
        assert len(flat) == len(set(flat)) and set(flat) <= {x.id for x in d}


def _cand(groups: DeviceMapping, t: float) -> Candidate:
    plan = Plan(microbatch_size=1, schedule="1f1b", groups=tuple(
        Group(samples=1, stages=tuple(Stage(device=x.id, layers=(i, i + 1))
                                      for i, x in enumerate(g))) for g in groups))
    return Candidate(plan, t)


def test_descent_follows_improvements_to_a_local_optimum_within_its_budget() -> None:
    """Toy objective: a pipeline is faster the closer its devices are to d3, d2, d1, d0
    in that order (one group), so the descent must reorder, drop nothing and stop."""
    d = _devs(4)
    target = ("d3", "d2", "d1", "d0")
    calls = []

    def plan(groups: DeviceMapping) -> Candidate | None:
        calls.append(groups)
        ids = _ids(groups)
        if len(ids) != 1:
            return None
        wrong = sum(a != b for a, b in zip(ids[0], target, strict=False)) + abs(len(ids[0]) - 4)
        return _cand(groups, 1.0 + wrong)

    start = _cand(((d[0], d[1], d[2], d[3]),), 5.0)
    steps = descend(start, d, plan, budget=10_000)
    assert steps
    assert steps[-1].plan.groups[0].devices == target
    assert [s.iteration_s for s in steps] == sorted((s.iteration_s for s in steps), reverse=True)
    calls.clear()
    descend(start, d, plan, budget=7)
    assert len(calls) == 7
