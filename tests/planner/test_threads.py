"""The planner from several threads at once, as the daemon's job loops run it
(issue 13.1): shared compiled LPs and memo tables must give every thread the
answer it would get alone. A tiny switch interval makes the interpreter swap
threads between almost any two bytecodes, so an unguarded set-then-solve
shows up within a few solves."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hetpilot.planner import assign
from hetpilot.planner.controller import Controller, ControllerConfig
from hetpilot.planner.memos import clear_memos
from hetpilot.planner.serde import job_from_dict, plan_to_dict
from hetpilot.planner.types import Cluster, Device, Network

from .helpers import random_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def switch_often() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _in_threads(n: int, work: Callable[[int], object]) -> list[object]:
    results: list[object] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def _lp_inputs(seed: int) -> tuple[list[float], list[float], list[float], int]:
    r = random.Random(seed)
    return ([r.random() for _ in range(3)], [0.1 + r.random() for _ in range(3)],
            [100.0] * 3, 50)


def test_one_compiled_lp_solved_from_eight_threads(switch_often: None) -> None:
    problem = assign.lp_problem(3)
    got = _in_threads(8, lambda i: [problem._solve(*_lp_inputs(100 * i + n)) for n in range(40)])
    alone = assign.AssignmentLP(3)
    wrong = [(i, n) for i in range(8) for n in range(40)
             if not np.allclose(got[i][n], alone._solve(*_lp_inputs(100 * i + n)), atol=1e-6)]
    assert not wrong, f"{len(wrong)} of 320 solves answered another thread's inputs"


def _cluster() -> Cluster:
    """Three hosts of two devices at three speeds: each job's plans take two data-parallel
    groups. (Four hosts, 1.6x as long, add nothing a race needs.)"""
    devices = tuple(Device(id=f"h{h}:{d}", host=f"h{h}", tflops=(20.0, 50.0, 80.0)[h],
                           memory_gb=40.0, price_per_hour=0.5 + h)
                    for h in range(3) for d in range(2))
    return Cluster(devices=devices, network=Network(intra_host_gbps=800.0, inter_host_gbps=25.0,
                                                    latency_us=5.0))


def _decisions(i: int) -> list[dict]:
    job = job_from_dict({"global_batch": 128 + 32 * i, "microbatch_size": 4, "schedule": "any",
                         "budgets": {"price_per_hour": 10.0 + 4 * i}, "V": 10.0})
    ctrl = Controller(random_model(12, seed=i % 4), job, ControllerConfig(slot_s=60.0))
    return [plan_to_dict(ctrl.step(_cluster()).plan) for _ in range(2)]


def test_controllers_stepping_in_threads_match_alone(switch_often: None) -> None:
    together = _in_threads(4, _decisions)
    sys.setswitchinterval(0.005)
    clear_memos()
    assert together == [_decisions(i) for i in range(4)]
