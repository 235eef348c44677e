"""The forms in which bench/sailor_compare.py hands a hetpilot plan to Sailor's simulator
(no Sailor checkout needed: the forms are plain dicts)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
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
