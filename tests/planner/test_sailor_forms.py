"""The forms in which bench/sailor_compare.py hands a hetpilot plan to Sailor's simulator
(no Sailor checkout needed: the forms are plain dicts)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from hetpilot.planner import serde
from hetpilot.planner.tpmodel import stage_op_s
from hetpilot.planner.types import Cluster, Device, Group, Network, Plan, Stage

BENCH = Path(__file__).resolve().parents[2] / "bench" / "sailor_compare.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sailor_compare", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan() -> tuple[Plan, Cluster]:
    """Three groups of a V100 2-way stage then an A100: two with cuts 0-3-6 taking 52 and
    50 samples, one with cuts 0-2-6 taking 50."""
    devices = [Device(id=f"{h}:{i}", host=h, tflops=10.0, memory_gb=16.0)
               for h in ("v0", "v1", "v2", "a0") for i in range(4)]
    cluster = Cluster(devices=tuple(devices),
                      network=Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=0.0))

    def group(v: str, a: str, cut: int, samples: int) -> Group:
        return Group(samples=samples, stages=(
            Stage(device=f"{v}:0", devices=(f"{v}:0", f"{v}:1"), layers=(0, cut)),
            Stage(device=a, layers=(cut, 6))))

    plan = Plan(microbatch_size=2, schedule="1f1b", groups=(
        group("v0", "a0:0", 3, 52), group("v1", "a0:1", 3, 50), group("v2", "a0:2", 2, 50)))
    return plan, cluster


@pytest.mark.parametrize(("merge", "dps", "micro"), [
    ("none", [1, 1, 1], [26, 25, 25]),
    ("samples", [1, 1, 1], [26, 25, 25]),  # equal cuts, but not equal samples
    ("cuts", [2, 1], [26, 25]),  # equal cuts whatever the samples: the larger count
])
def test_sailor_forms(merge: str, dps: list[int], micro: list[int]) -> None:
    bench = _bench()
    plan, cluster = _plan()
    form, counts = bench.sailor_plan(plan, cluster, merge=merge)
    assert [p["dp"][0] for p in form["pipeline_list"]] == dps
    assert counts == micro
    first = form["pipeline_list"][0]
    assert first["layers_per_stage"] == [[0, 1, 2], [3, 4, 5]]
    # each replica: (kind, degree); a V100 2-way group and a whole A100
    assert first["tmp_per_stage"][0][0] == [[("V100-16", 2, bench.ZONE)], 2]
    assert first["tmp_per_stage"][1][0] == [[("A100-40", 1, bench.ZONE)], 1]
    assert form["used_gpus"] == {"A100-40": 3, "V100-16": 6}


class _Sim:
    """Sailor's simulator where the test needs only its check and its iteration time
    (no Sailor checkout on CI): a plan fits, and takes 1 s per pipeline."""

    def check_config_fits(self, plan: dict) -> bool:
        return True

    def simulate_iteration_time(self, plan: dict) -> tuple[float, None, None]:
        return float(len(plan["pipeline_list"])), None, None


class _Planner:
    """Sailor's planner as the bench calls it, returning the plans it is given."""

    def __init__(self, plans: list[dict]) -> None:
        self.plans, self.calls = plans, 0

    def get_sorted_plans(self, cluster_config: dict, training_config: dict) -> list[dict]:
        self.calls += 1
        return self.plans


def _sailor(bench: ModuleType, tmp_path: Path) -> object:
    sailor = bench.Sailor.__new__(bench.Sailor)
    sailor.checkout, sailor.sim, sailor.training_config = tmp_path, _Sim(), {}
    return sailor


def test_sailor_plans_are_cached_by_cluster_and_replayed(tmp_path: Path) -> None:
    bench = _bench()
    sailor = _sailor(bench, tmp_path)
    row = {f"A100-40_{bench.ZONE}": 8, f"V100-16_{bench.ZONE}": 16}
    plan = {"pipeline_list": [{"dp": [2]}], "mbs": 1, "used_gpus": {"A100-40": 8}}
    planner = _Planner([plan])
    first = bench.Sailor.sailor_best(sailor, planner, row, tmp_path / "cache")
    assert first[0] == plan and first[1] == 1.0 and planner.calls == 1
    again = bench.Sailor.sailor_best(sailor, planner, row, tmp_path / "cache")
    assert again[0] == plan and again[1] == 1.0 and planner.calls == 1  # from the file
    other = {**row, f"V100-16_{bench.ZONE}": 32}  # another cluster: its own file
    bench.Sailor.sailor_best(sailor, planner, other, tmp_path / "cache")
    assert planner.calls == 2 and len(list((tmp_path / "cache").iterdir())) == 2


def test_a_sailor_plan_using_gpus_the_cluster_lacks_is_refused(tmp_path: Path) -> None:
    bench = _bench()
    sailor = _sailor(bench, tmp_path)
    row = {f"A100-40_{bench.ZONE}": 48, f"V100-16_{bench.ZONE}": 272}
    stale = {"pipeline_list": [{"dp": [2]}], "mbs": 1,
             "used_gpus": {"A100-40": 156, "V100-16": 96}}  # 160 + 96's plan
    with pytest.raises(SystemExit, match=r"A100-40.*156"):
        bench.Sailor.sailor_best(sailor, _Planner([stale]), row, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # nothing cached


def test_kind_scales_reproduce_the_profiled_layer_times() -> None:
    """The converter's ``kind_scale`` makes spec 5.1 / 5.6 time each layer, on each kind and
    degree, as the profile does (forward + backward), all-reduces included."""
    sc = _bench()
    a, v = sc.KINDS
    mbs, gbps = 2, 100.0
    prof = {a: {"2": {"1": {"0": [0.001, 0.002, 0], "1": [0.010, 0.020, 0], "2": [0.004, 0.008, 0]},
                      "2": {"0": [0.001, 0.001, 0], "1": [0.006, 0.012, 0], "2": [0.003, 0.006, 0]}}},
            v: {"2": {"1": {"0": [0.002, 0.004, 0], "1": [0.030, 0.060, 0], "2": [0.025, 0.050, 0]},
                      "2": {"0": [0.002, 0.002, 0], "1": [0.017, 0.034, 0], "2": [0.014, 0.028, 0]}}}}
    ref = prof[a]["2"]["1"]
    layers = [{"fwd_gflop": ref[str(i)][0] * 1000.0 * sc.REF_TFLOPS / mbs,
               "bwd_gflop": ref[str(i)][1] * 1000.0 * sc.REF_TFLOPS / mbs,
               "out_mb": 1.0, "act_mb": 1.0, "param_mb": 1.0, "tp_max": 4, "tp_comm_mb": 0.5,
               "tp_allreduces": (1, 2, 0)[i]} for i in range(3)]

    def total(kind: str) -> float:
        return sum(x[0] + x[1] for x in prof[kind]["2"]["1"].values())

    nominal = {k: total(k) / total(a) for k in (a, v)}
    model = serde.model_from_dict({"layers": sc._kind_scales(prof, layers, mbs, nominal, gbps, True)})
    cluster = serde.cluster_from_dict({"devices": [
        {"id": f"{k}:{i}", "host": k, "kind": k, "tflops": sc.REF_TFLOPS / nominal[k],
         "memory_gb": 16.0} for k in (a, v) for i in range(2)],
        "network": {"intra_host_gbps": gbps, "inter_host_gbps": gbps}})
    checked = 0
    for kind in (a, v):
        for t in (1, 2):
            for i in range(3):
                ids = tuple(f"{kind}:{j}" for j in range(t))
                f, b = stage_op_s(cluster, model, Stage(device=ids[0], devices=ids,
                                                        layers=(i, i + 1)), mbs)
                measured = sum(prof[kind]["2"][str(t)][str(i)][:2])
                # the embedding's all-reduce at TP 2 (2 x 0.5 x 2 MB / 100 Gbit/s x 2 = 0.16 ms)
                # leaves the profile's 2 ms of compute; none is floored here
                assert f + b == pytest.approx(measured, rel=1e-9), (kind, t, i)
                checked += 1
    assert checked == 12
    assert model.layers[2].scale(v, 1) == pytest.approx((0.075 / 0.012) / nominal[v])
