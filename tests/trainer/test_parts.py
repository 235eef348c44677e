"""The trainer's pure parts: its settings (``TrainerConfig``) and where a plan puts layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hetpilot.planner.serde import plan_from_dict
from hetpilot.planner.types import Layer, Model
from hetpilot.trainer.config import TrainerConfig
from hetpilot.trainer.placement import emulated_targets, layer_owners, owner_runs, tie_holders

PLAN = plan_from_dict({
    "microbatch_size": 2, "schedule": "1f1b",
    "groups": [
        {"samples": 4, "stages": [{"device": "h:0", "layers": [0, 2]},
                                  {"device": "h:1", "layers": [2, 5]}]},
        {"samples": 4, "stages": [{"device": "h:2", "layers": [0, 3]},
                                  {"device": "h:1", "layers": [3, 5]}]},
    ],
})
RANK_OF = {"h:0": 0, "h:1": 1, "h:2": 2}


def test_config_is_frozen_and_keeps_a_torch_device() -> None:
    cfg = TrainerConfig(global_batch=8, device_id="h:0", layer_gflop=[(1, 2), (3, 4)])
    assert cfg.device == torch.device("cpu")
    assert cfg.layer_gflop == ((1.0, 2.0), (3.0, 4.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainerConfig(8, "h:0")  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(("changes", "field"), [
    ({"global_batch": 0}, "global_batch"),
    ({"global_batch": True}, "global_batch"),
    ({"device_id": ""}, "device_id"),
    ({"dtype": "float32"}, "dtype"),
    ({"slowdown": 0.5}, "slowdown"),
    ({"emulate_tflops": 0.0}, "emulate_tflops"),
    ({"slowdown": 2.0, "emulate_tflops": 1.0}, "one emulation mode"),
    ({"slowdown": 2.0, "emulate_file": "emu.json"}, "one emulation mode"),
    ({"bucket_cap_mb": 0.0}, "bucket_cap_mb"),
])
def test_a_wrong_setting_is_refused_by_name(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TrainerConfig(**{"global_batch": 8, "device_id": "h:0", **changes})


def test_owners_buckets_and_tie_holders_follow_the_plan() -> None:
    owners = layer_owners(PLAN, RANK_OF, 5)
    assert owners == [[0, 2], [0, 2], [1, 2], [1, 1], [1, 1]]
    assert owner_runs(owners) == [(0, 2, (0, 2)), (2, 3, (1, 2)), (3, 5, (1, 1))]
    assert tie_holders([0, 4], owners) == [0, 1, 2]
    assert tie_holders([3], owners) == [1]
    assert owner_runs([[], []]) == [(0, 2, ())]


def test_emulated_targets_are_spec_5_1_op_times() -> None:
    gflop = [(1.0, 2.0), (3.0, 6.0), (5.0, 10.0)]
    assert emulated_targets(gflop, None, 4, (0, 3), False) == (0.0, 0.0)
    fwd, bwd = emulated_targets(gflop, 2.0, 4, (1, 3), False)
    assert fwd == pytest.approx(4 * 8.0 / 2000.0) and bwd == pytest.approx(4 * 16.0 / 2000.0)
    assert emulated_targets(gflop, 2.0, 4, (1, 3), True)[1] == pytest.approx(bwd + fwd)


def test_emulated_tensor_parallel_stage_runs_its_split_share_and_all_reduces() -> None:
    """A 2-way stage: the split layer runs 1 / (2 * 0.8) of its work plus 2 ring
    all-reduces of 4 x 1 MB each way; the unsplit one runs whole (spec 5.6)."""
    gflop = [(4.0, 8.0), (2.0, 4.0)]
    split = Model(name="m", layers=(
        Layer(name="a", fwd_gflop=4.0, bwd_gflop=8.0, out_mb=1.0, act_mb=1.0, param_mb=1.0,
              tp_comm_mb=1.0, tp_allreduces=2, tp_efficiency=((2, 0.8),)),
        Layer(name="b", fwd_gflop=2.0, bwd_gflop=4.0, out_mb=1.0, act_mb=1.0, param_mb=1.0)))
    link = (8.0, 1e-4)  # 8 Gbit/s: 1 MB per ms
    ring = 2 * (2 * 0.5 * 4.0 / 1000.0 + 2 * 1 * 1e-4)  # two ring all-reduces of 4 MB, 2 ranks
    fwd, bwd = emulated_targets(gflop, 2.0, 4, (0, 2), False, ("h:0", "h:1"), split, link)
    assert fwd == pytest.approx(4 * (4.0 / 1.6 + 2.0) / 2000.0 + ring)
    assert bwd == pytest.approx(4 * (8.0 / 1.6 + 4.0) / 2000.0 + ring)
    whole = emulated_targets(gflop, 2.0, 4, (0, 2), False)
    assert whole == pytest.approx((4 * 6.0 / 2000.0, 4 * 12.0 / 2000.0))
    # no link: the split work alone; recompute adds the forward to the backward
    f0, b0 = 4 * (4.0 / 1.6 + 2.0) / 2000.0, 4 * (8.0 / 1.6 + 4.0) / 2000.0
    assert emulated_targets(gflop, 2.0, 4, (0, 2), True, ("h:0", "h:1"), split) == \
        pytest.approx((f0, b0 + f0))
