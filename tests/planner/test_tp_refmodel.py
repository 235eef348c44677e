"""Tensor-parallel stages (spec 4, 5.6): parsing, validation, and times and memory by hand.

The numbers below are worked on paper in docs/spec.md, section 5.6 (the
worked example): a 2-device TP stage feeding a 1-device stage.
"""

from __future__ import annotations

import json

import pytest
from hetpilot.planner import serde
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.refmodel import evaluate, group_op_times, stage_memory_mb, sync_time

from .helpers import example, spec_cluster, spec_model


def _cluster(memory_gb: float = 16.0, extra: list[dict] | None = None,
             device_links: list[dict] | None = None) -> serde.Cluster:
    devices = [
        {"id": "h:0", "host": "h", "tflops": 10.0, "memory_gb": memory_gb, "price_per_hour": 1.0},
        {"id": "h:1", "host": "h", "tflops": 10.0, "memory_gb": memory_gb, "price_per_hour": 1.0},
        {"id": "g:0", "host": "g", "tflops": 20.0, "memory_gb": 8.0, "price_per_hour": 3.0},
        *(extra or []),
    ]
    return serde.cluster_from_dict({"devices": devices, "network": {
        "intra_host_gbps": 800.0, "inter_host_gbps": 100.0, "latency_us": 5.0,
        "device_links": device_links or []}})


MODEL = {
    "optimizer_factor": 3.0,
    "layers": [
        {"fwd_gflop": 20.0, "bwd_gflop": 40.0, "out_mb": 10.0, "act_mb": 100.0,
         "param_mb": 400.0, "tp_comm_mb": 10.0, "tp_allreduces": 2, "tp_efficiency": {"2": 0.8}},
        {"fwd_gflop": 10.0, "bwd_gflop": 20.0, "out_mb": 10.0, "act_mb": 50.0,
         "param_mb": 100.0},
    ],
}

TP_PLAN = {
    "microbatch_size": 2, "schedule": "gpipe",
    "groups": [{"samples": 4, "stages": [
        {"devices": ["h:0", "h:1"], "layers": [0, 1]},
        {"device": "g:0", "layers": [1, 2]},
    ]}],
}


def _plan(data: dict) -> serde.Plan:
    return serde.plan_from_dict(json.loads(json.dumps(data)))


def test_tp_stage_op_and_transfer_times_by_hand() -> None:
    model = serde.model_from_dict(MODEL)
    plan = _plan(TP_PLAN)
    times = group_op_times(_cluster(), model, plan.groups[0], 2)
    # split 2 ways at efficiency 0.8: 2 * 20 / (2 * 0.8) / 10000 = 0.0025 s of compute,
    # plus 2 all-reduces of 2 * 10 MB over h:0 -> h:1 -> h:0 (800 Gbit/s, 5 us):
    # 2 * (1/2 * 2 * 20 * 8 / 800000 + 2 * 5e-6) = 0.00042 s
    assert times.fwd[0] == pytest.approx(0.00292, rel=1e-12)
    assert times.bwd[0] == pytest.approx(0.005 + 0.00042, rel=1e-12)
    assert times.fwd[1] == pytest.approx(0.001, rel=1e-12)  # g:0 alone: 2 * 10 / 20000
    assert times.bwd[1] == pytest.approx(0.002, rel=1e-12)
    # k = min(2, 1) = 1 link carries all 20 MB (5 us + 20 * 8 / 100000 s), then the
    # wider stage all-gathers it over its ring: 1/2 * 20 * 8 / 800000 + 5e-6
    assert times.comm[0] == pytest.approx(0.001605 + 0.000105, rel=1e-12)


def test_tp_plan_iteration_and_memory_by_hand() -> None:
    model = serde.model_from_dict(MODEL)
    got = evaluate(_cluster(), model, _plan(TP_PLAN), 4)
    assert got.valid, got.error
    # gpipe, M = 2 (docs/spec.md 5.6): stage 0's B1 ends at 0.0231
    assert got.iteration_s == pytest.approx(0.0231, rel=1e-12)
    assert got.sync_s == 0.0
    assert got.price_per_hour == pytest.approx(5.0)  # both TP devices cost
    stage0 = _plan(TP_PLAN).groups[0].stages[0]
    # params 400 / 2 * (1 + 3) = 800 MB; activations 2 in flight * m 2 * 100 / 2 = 200 MB
    assert stage_memory_mb(model, stage0, 2, 2) == pytest.approx(1000.0)


def test_tp_stage_fits_where_one_device_does_not() -> None:
    model = serde.model_from_dict(MODEL)
    cluster = _cluster(memory_gb=1.5)  # 1500 MB: the TP stage needs 1000, one device 2000
    assert evaluate(cluster, model, _plan(TP_PLAN), 4).valid
    single = json.loads(json.dumps(TP_PLAN))
    single["groups"][0]["stages"][0] = {"device": "h:0", "layers": [0, 1]}
    got = evaluate(cluster, model, _plan(single), 4)
    assert not got.valid
    assert got.error is not None and "needs 2000.0 MB on 'h:0'" in got.error


def test_unsplittable_layer_runs_whole_on_every_device() -> None:
    model = serde.model_from_dict(MODEL)
    plan = _plan({"microbatch_size": 2, "schedule": "gpipe", "groups": [{"samples": 2, "stages": [
        {"devices": ["h:0", "h:1"], "layers": [1, 2]}, ]}]})
    stage = plan.groups[0].stages[0]
    times = group_op_times(_cluster(), model, plan.groups[0], 2)
    assert times.fwd[0] == pytest.approx(2 * 10 / 10000, rel=1e-12)  # no split, no all-reduce
    assert stage_memory_mb(model, stage, 2, 1) == pytest.approx(100 * 4 + 2 * 50)


def test_tp_max_limits_the_split() -> None:
    data = json.loads(json.dumps(MODEL))
    data["layers"][0]["tp_max"] = 1
    model = serde.model_from_dict(data)
    stage = _plan(TP_PLAN).groups[0].stages[0]
    assert stage_memory_mb(model, stage, 2, 2) == pytest.approx(400 * 4 + 2 * 2 * 100)


def test_sync_across_groups_that_split_a_layer_differently() -> None:
    model = serde.model_from_dict(MODEL)
    plan = _plan({"microbatch_size": 2, "schedule": "gpipe", "groups": [
        {"samples": 2, "stages": [{"devices": ["h:0", "h:1"], "layers": [0, 2]}]},
        {"samples": 2, "stages": [{"device": "g:0", "layers": [0, 2]}]},
    ]})
    # layer 0: split 2 ways in group 0, whole in group 1: s = 1 ring h:0 -> g:0 of 400 MB,
    # 400 * 8 / 100000 + 2 * 5e-6; layer 1 (never split) another bucket of 100 MB.
    assert sync_time(_cluster(), model, plan.groups) == pytest.approx(
        0.03201 + 0.00801, rel=1e-12)


def test_sync_of_two_tp_groups_runs_parallel_rings() -> None:
    extra = [{"id": f"k:{i}", "host": "k", "tflops": 10.0, "memory_gb": 16.0} for i in range(2)]
    cluster = _cluster(extra=extra, device_links=[{"a": "h:1", "b": "k:1", "gbps": 25.0}])
    model = serde.model_from_dict(MODEL)
    plan = _plan({"microbatch_size": 2, "schedule": "gpipe", "groups": [
        {"samples": 2, "stages": [{"devices": ["h:0", "h:1"], "layers": [0, 2]}]},
        {"samples": 2, "stages": [{"devices": ["k:0", "k:1"], "layers": [0, 2]}]},
    ]})
    # layer 0, split 2 ways in both: rings h:0-k:0 (100 Gbit/s) and h:1-k:1 (25) of 200 MB
    # each: 0.01601 and 0.06401 s; layer 1 (whole): one ring h:0-k:0 of 100 MB, 0.00801 s,
    # which every device waits for. h:1 and k:1 are the slowest: 0.06401 + 0.00801.
    assert sync_time(cluster, model, plan.groups) == pytest.approx(0.06401 + 0.00801, rel=1e-12)
    # the TP search's robust reading (shared uplinks): each ring carries all 400 MB of
    # layer 0, h:1-k:1 at 25 Gbit/s: 400 * 8 / 25000 + 2 * 5e-6 = 0.12801; layer 1 as before
    assert sync_time(cluster, model, plan.groups, shared_uplinks=True) == pytest.approx(
        0.12801 + 0.00801, rel=1e-12)


def test_tp_stage_must_lie_within_one_host() -> None:
    plan = _plan({"microbatch_size": 2, "schedule": "gpipe", "groups": [{"samples": 4, "stages": [
        {"devices": ["h:0", "g:0"], "layers": [0, 2]}]}]})
    got = evaluate(_cluster(), serde.model_from_dict(MODEL), plan, 4)
    assert not got.valid
    assert got.error is not None and got.error.startswith("plan.groups[0].stages[0].devices[1]:")
    assert "within one host" in got.error


def test_tp_device_used_twice_is_named() -> None:
    plan = _plan({"microbatch_size": 2, "schedule": "gpipe", "groups": [
        {"samples": 2, "stages": [{"devices": ["h:0", "h:1"], "layers": [0, 2]}]},
        {"samples": 2, "stages": [{"device": "h:1", "layers": [0, 2]}]}]})
    got = evaluate(_cluster(), serde.model_from_dict(MODEL), plan, 4)
    assert got.error == ("plan.groups[1].stages[0].device: 'h:1' is already used at "
                         "plan.groups[0].stages[0]")


def test_one_device_list_is_the_v1_stage() -> None:
    cluster, model = spec_cluster(), spec_model()
    v1 = example("plan.json")
    as_list = json.loads(json.dumps(v1))
    for g in as_list["groups"]:
        for s in g["stages"]:
            s["devices"] = [s.pop("device")]
    a = evaluate(cluster, model, serde.plan_from_dict(v1)).to_dict()
    b = evaluate(cluster, model, serde.plan_from_dict(as_list)).to_dict()
    assert a == b
    assert serde.plan_to_dict(serde.plan_from_dict(as_list)) == serde.plan_to_dict(
        serde.plan_from_dict(v1))  # written back as v1


def test_tp_plan_and_model_round_trip() -> None:
    plan = _plan(TP_PLAN)
    out = serde.plan_to_dict(plan)
    assert out["groups"][0]["stages"][0] == {"devices": ["h:0", "h:1"], "layers": [0, 1]}
    assert serde.plan_from_dict(out) == plan
    assert plan.devices == ("h:0", "h:1", "g:0") and plan.tensor_parallel
    model = serde.model_from_dict(MODEL)
    again = serde.model_to_dict(model)
    assert again["layers"][0]["tp_efficiency"] == {"2": 0.8}
    assert "tp_comm_mb" not in again["layers"][1]  # a v1 layer stays v1
    assert serde.model_from_dict(again) == model


@pytest.mark.parametrize(("stage", "field", "problem"), [
    ({"device": "h:0", "devices": ["h:0"], "layers": [0, 2]}, "stages[0].devices", "not both"),
    ({"devices": ["h:0", "h:0"], "layers": [0, 2]}, "stages[0].devices[1]", "already devices[0]"),
    ({"devices": [], "layers": [0, 2]}, "stages[0].devices", "must not be empty"),
    ({"devices": ["h:0", 3], "layers": [0, 2]}, "stages[0].devices[1]", "non-empty string"),
])
def test_bad_tp_stage_names_the_field(stage: dict, field: str, problem: str) -> None:
    with pytest.raises(ValidationError) as err:
        _plan({"microbatch_size": 2, "schedule": "gpipe",
               "groups": [{"samples": 2, "stages": [stage]}]})
    assert str(err.value).startswith(f"plan.groups[0].{field}:")
    assert problem in str(err.value)


@pytest.mark.parametrize(("key", "value", "field"), [
    ("tp_efficiency", {"1": 0.9}, "tp_efficiency.1"),
    ("tp_efficiency", {"2": 1.5}, "tp_efficiency.2"),
    ("tp_max", 0, "tp_max"),
    ("tp_comm_mb", -1, "tp_comm_mb"),
    ("tp_allreduces", 1.5, "tp_allreduces"),
])
def test_bad_tp_layer_key_names_the_field(key: str, value: object, field: str) -> None:
    data = json.loads(json.dumps(MODEL))
    data["layers"][0][key] = value
    with pytest.raises(ValidationError) as err:
        serde.model_from_dict(data)
    assert str(err.value).startswith(f"model.layers[0].{field}:")


def test_job_tensor_parallel_flag() -> None:
    assert not serde.job_from_dict({"global_batch": 8, "microbatch_size": 2}).tensor_parallel
    assert serde.job_from_dict({"global_batch": 8, "microbatch_size": 2,
                                "tensor_parallel": True}).tensor_parallel
    with pytest.raises(ValidationError, match=r"job\.tensor_parallel"):
        serde.job_from_dict({"global_batch": 8, "microbatch_size": 2, "tensor_parallel": "yes"})


def test_trainer_refuses_a_tp_plan_by_name() -> None:
    from hetpilot.planner.errors import InvalidPlanError
    from hetpilot.trainer.plans import check_plan

    with pytest.raises(InvalidPlanError) as err:
        check_plan(_plan(TP_PLAN), ["h:0", "h:1", "g:0"], 2, 4)
    assert str(err.value).startswith("plan.groups[0].stages[0].devices: a tensor-parallel stage")


def test_switching_into_a_tp_stage_moves_only_the_missing_slices() -> None:
    from hetpilot.planner.switching import switch_cost

    model = serde.model_from_dict(MODEL)
    one = _plan({"microbatch_size": 2, "schedule": "gpipe", "groups": [{"samples": 4, "stages": [
        {"device": "h:0", "layers": [0, 2]}]}]})
    two = _plan({"microbatch_size": 2, "schedule": "gpipe", "groups": [{"samples": 4, "stages": [
        {"devices": ["h:0", "h:1"], "layers": [0, 2]}]}]})
    cost = switch_cost(_cluster(), model, one, two)
    # h:0 held both layers whole; h:1 gets slice 1 of 2 of layer 0 (400 * 4 / 2 MB) and the
    # unsplit layer 1 whole (100 * 4 MB), from h:0 over the host's 800 Gbit/s, 5 us each
    assert dict(cost.received_mb) == {"h:1": pytest.approx(1200.0)}
    assert cost.seconds == pytest.approx(2 * 5e-6 + 1200 * 8 / 800000)
    back = switch_cost(_cluster(), model, two, one)  # h:0 lacks slice 1 of layer 0 only
    assert dict(back.received_mb) == {"h:0": pytest.approx(800.0)}
    assert back.seconds == pytest.approx(5e-6 + 800 * 8 / 800000)  # from h:1, not a checkpoint


def test_tp_example_files_evaluate_as_written() -> None:
    from .helpers import EXAMPLES

    folder = EXAMPLES / "tp"
    load = {n: json.loads((folder / f"{n}.json").read_text())
            for n in ("cluster", "model", "plan", "plan.evaluation")}
    got = evaluate(serde.cluster_from_dict(load["cluster"]), serde.model_from_dict(load["model"]),
                   serde.plan_from_dict(load["plan"]), 4).to_dict()
    want = load["plan.evaluation"]
    assert got["groups"] == want.pop("groups") == [{"makespan_s": pytest.approx(0.0231),
                                                     "microbatches": 2}]
    got.pop("groups")
    assert got == pytest.approx(want)
    assert got["iteration_s"] == pytest.approx(0.0231, rel=1e-12)  # docs/spec.md 5.6 by hand
