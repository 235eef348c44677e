"""The replica rule for buffers (hetpilot.trainer.replicas): what is merged how, on plain
tensors and over two gloo ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.replicas import merge_buffer
from hetpilot.trainer.testing.ranks import REPLICA_CASES, _replica_run

WEIGHTS = (0.25, 0.75)


def _merged(name: str) -> list:
    b0, *after = REPLICA_CASES[name]
    return merge_buffer(torch.tensor(b0), [torch.tensor(a) for a in after], WEIGHTS).tolist()


def test_running_statistics_take_the_sample_weighted_mean() -> None:
    assert _merged("mask")[0] == 0.25 * 0.5 + 0.75 * 1.5


def test_non_finite_elements_no_group_changed_stay_and_others_take_the_mean() -> None:
    assert _merged("mask")[1] == -math.inf  # was NaN: -inf - (-inf)
    assert _merged("observer_min") == [0.25 * 2.0 + 0.75 * 4.0]  # was NaN: 2 - inf + inf


def test_integer_counters_add_up_and_integer_values_take_the_rounded_mean() -> None:
    assert _merged("count") == [10 + 2 + 3]  # every microbatch seen is counted
    assert _merged("zero_point") == [round(0.25 * 62 + 0.75 * 70)]  # was 144 - 82 - 74 = -12


def test_two_ranks_reconcile_as_the_rule_says(tmp_path: Path) -> None:
    spawn(_replica_run, 2, (str(tmp_path),), timeout_s=60)
    got = [json.loads((tmp_path / f"replica{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1]
    assert got[0] == {name: _merged(name) for name in REPLICA_CASES}
