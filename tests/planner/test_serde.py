"""Input validation names the field and the problem (spec sections 1-4)."""

from __future__ import annotations

import copy
import math

import pytest
from hetpilot.planner import serde
from hetpilot.planner.errors import ValidationError

from .helpers import example


def _cluster_error(mutate) -> str:  # type: ignore[no-untyped-def]
    data = copy.deepcopy(example("cluster.json"))
    mutate(data)
    with pytest.raises(ValidationError) as info:
        serde.cluster_from_dict(data)
    return str(info.value)


def _model_error(mutate) -> str:  # type: ignore[no-untyped-def]
    data = copy.deepcopy(example("model.json"))
    mutate(data)
    with pytest.raises(ValidationError) as info:
        serde.model_from_dict(data)
    return str(info.value)


def test_negative_flops_named() -> None:
    msg = _model_error(lambda d: d["layers"][3].__setitem__("fwd_gflop", -1))
    assert msg == "model.layers[3].fwd_gflop: must be >= 0, got -1"


def test_nan_rejected() -> None:
    msg = _cluster_error(lambda d: d["devices"][1].__setitem__("tflops", math.nan))
    assert msg.startswith("cluster.devices[1].tflops: must be finite")


def test_missing_field_named() -> None:
    msg = _cluster_error(lambda d: d["devices"][0].pop("memory_gb"))
    assert msg == "cluster.devices[0].memory_gb: is required"


def test_duplicate_device_id() -> None:
    msg = _cluster_error(lambda d: d["devices"][2].__setitem__("id", "a:0"))
    assert msg == "cluster.devices[2].id: duplicate device id 'a:0'"


def test_zero_speed_rejected() -> None:
    msg = _cluster_error(lambda d: d["devices"][0].__setitem__("tflops", 0))
    assert msg == "cluster.devices[0].tflops: must be > 0, got 0"


def test_link_to_unknown_host() -> None:
    msg = _cluster_error(lambda d: d["network"]["host_links"][0].__setitem__("b", "zz"))
    assert msg == "cluster.network.host_links[0].b: unknown host 'zz'"


def test_wrong_type() -> None:
    msg = _model_error(lambda d: d["layers"][0].__setitem__("param_mb", "big"))
    assert msg == "model.layers[0].param_mb: must be a number, got a string"


def test_bwd_defaults_to_twice_fwd() -> None:
    data = copy.deepcopy(example("model.json"))
    del data["layers"][1]["bwd_gflop"]
    model = serde.model_from_dict(data)
    assert model.layers[1].bwd_gflop == 2 * model.layers[1].fwd_gflop


def test_batch_not_divisible() -> None:
    with pytest.raises(ValidationError, match=r"job.global_batch: must be a multiple of microbatch_size 8, got 100"):
        serde.job_from_dict({"global_batch": 100, "microbatch_size": 8})


def test_unknown_schedule() -> None:
    with pytest.raises(ValidationError, match=r"job.schedule\[0\]"):
        serde.job_from_dict({"global_batch": 8, "microbatch_size": 8, "schedule": ["zigzag"]})


def test_plan_op_names_checked() -> None:
    data = copy.deepcopy(example("plan.json"))
    data["schedule"] = "custom"
    for g in data["groups"]:
        for s in g["stages"]:
            s["order"] = ["F0", "X1"]
    with pytest.raises(ValidationError, match=r"plan.groups\[0\].stages\[0\].order\[1\]"):
        serde.plan_from_dict(data)


def test_round_trips() -> None:
    cluster = serde.cluster_from_dict(example("cluster.json"))
    assert serde.cluster_from_dict(serde.cluster_to_dict(cluster)) == cluster
    model = serde.model_from_dict(example("model.json"))
    assert serde.model_from_dict(serde.model_to_dict(model)) == model
    plan = serde.plan_from_dict(example("plan.json"))
    assert serde.plan_from_dict(serde.plan_to_dict(plan)) == plan


def test_later_link_entries_win() -> None:
    data = copy.deepcopy(example("cluster.json"))
    data["network"]["host_links"].append({"a": "c", "b": "a", "gbps": 3.0})
    cluster = serde.cluster_from_dict(data)
    gbps, lat = cluster.link("a:0", "c:0")
    assert gbps == 3.0 and lat == pytest.approx(5e-6)  # latency falls back to the network's
    assert cluster.link("a:0", "a:1") == (2400.0, pytest.approx(5e-6))
    assert cluster.link("a:0", "b:0")[0] == 25.0


def test_job_without_v_gets_the_default_and_a_given_v_must_be_positive() -> None:
    base = {"global_batch": 64, "microbatch_size": 4}
    assert serde.job_from_dict(base).V == 0.0  # DEFAULT_V: the controller learns its rate
    assert serde.job_from_dict({**base, "V": 20000}).V == 20000.0
    for bad in (0, -1.0, "auto"):
        with pytest.raises(ValidationError, match=r"job\.V"):
            serde.job_from_dict({**base, "V": bad})


def test_numbers_beyond_the_contracts_range_are_refused() -> None:
    """A 1e308 GFLOP layer or a 1e-320 Gbit/s link made spec 5's times infinite, and
    `hetpilot evaluate` printed them as `Infinity`, which is not JSON."""
    msg = _model_error(lambda d: d["layers"][6].__setitem__("bwd_gflop", 1e308))
    assert msg == "model.layers[6].bwd_gflop: must be at most 1e+12, got 1e+308"
    msg = _cluster_error(lambda d: d["network"]["host_links"][0].__setitem__("gbps", 1e-320))
    assert msg == "cluster.network.host_links[0].gbps: must be at least 1e-09, got 9.99989e-321"
    ok = copy.deepcopy(example("cluster.json"))
    ok["devices"][0]["tflops"] = 0.001  # an emulated CPU's speed stays in range
    serde.cluster_from_dict(ok)


def test_integers_and_microbatch_counts_are_bounded() -> None:
    with pytest.raises(ValidationError, match=r"job.global_batch: makes 1099511627776 microbatches of 1; at most 1048576"):
        serde.job_from_dict({"global_batch": 2**40, "microbatch_size": 1})
    with pytest.raises(ValidationError, match=r"job.global_batch: must be at most 2\*\*53"):
        serde.job_from_dict({"global_batch": 2**70, "microbatch_size": 2**70})
    plan = copy.deepcopy(example("plan.json"))
    plan["groups"][0]["samples"] = 1e308
    with pytest.raises(ValidationError, match=r"plan.groups\[0\].samples: must be at most"):
        serde.plan_from_dict(plan)
    serde.job_from_dict({"global_batch": 2**20, "microbatch_size": 1})  # the most allowed


def test_a_non_finite_prediction_is_left_out() -> None:
    plan = copy.deepcopy(example("plan.json"))
    plan["predicted"] = {"iteration_s": math.nan}
    assert serde.plan_from_dict(plan).predicted_iteration_s is None
