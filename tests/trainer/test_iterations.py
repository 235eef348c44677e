"""Plans switch at iteration boundaries, mid-epoch, on the same data position; slots of N
iterations or T seconds; mixed precision on real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.testing.ranks import SWITCH_AT, _midepoch_run, midepoch_reference


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float16"])
def test_plan_switches_mid_epoch_without_skipping_or_repeating_samples(
        tmp_path: Path, dtype: str) -> None:
    spawn(_midepoch_run, 3, (str(tmp_path), dtype), timeout_s=120)
    got = json.loads((tmp_path / "records0.json").read_text())
    assert got["switch"]["step"] == SWITCH_AT  # taken before step 3, mid-epoch 0
    closed = [(r["epoch"], r["iterations"], r["closed_by"], r["plan_version"])
              for r in got["records"]]
    # epochs of 4 iterations, slots of 2: the switch closes the slot after 1 iteration
    assert closed == [(0, 2, "iterations", 1), (0, 1, "switch", 1), (0, 1, "epoch", 2),
                      (1, 2, "iterations", 2), (1, 2, "epoch", 2)]
    if dtype == "float16":
        assert got["scale"] == 2.0**16  # no step skipped: the reference steps every time
    # equal to one process taking PLAN_A for 3 steps then PLAN_B: same samples, in order
    expected = midepoch_reference(dtype)
    tolerance = 1e-12 if dtype == "float64" else 1e-6
    compared = 0
    for rank in range(3):
        for layer, state in torch.load(tmp_path / f"state{rank}.pt").items():
            for key, value in state.items():
                diff = float((value.double() - expected[layer][key].double()).abs().max())
                assert diff <= tolerance, (dtype, rank, layer, key, diff)
                compared += 1
    assert compared >= 12  # every layer (PLAN_B holds all 6 on ranks 0 and 1), weight + bias
