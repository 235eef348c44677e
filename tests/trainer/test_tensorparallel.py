"""Tensor-parallel stages: plans refused without a tp_plan, layers that cannot run split
refused by the preflight, and real gloo ranks splitting layers exactly as one process."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hetpilot.planner.errors import InvalidPlanError
from hetpilot.planner.serde import plan_from_dict
from hetpilot.trainer import examples
from hetpilot.trainer.plans import check_plan, random_plan
from hetpilot.trainer.preflight import split_degrees

DEVICES = ["local:0", "local:1", "local:2", "local:3"]
TP = {
    "microbatch_size": 2, "schedule": "1f1b",
    "groups": [
        {"samples": 10, "stages": [{"devices": ["local:0", "local:1"], "layers": [0, 3]},
                                   {"device": "local:2", "layers": [3, 6]}]},
        {"samples": 6, "stages": [{"device": "local:3", "layers": [0, 6]}]},
    ],
}


def test_a_tensor_parallel_stage_is_refused_by_name_without_a_tp_plan() -> None:
    with pytest.raises(InvalidPlanError) as info:
        check_plan(plan_from_dict(TP), DEVICES, 6, 16)
    assert info.value.field == "plan.groups[0].stages[0].devices"
    assert "tp_plan" in str(info.value)
    orders = check_plan(plan_from_dict(TP), DEVICES, 6, 16, tensor_parallel=True)
    assert [len(g) for g in orders] == [2, 1]


def test_a_tensor_parallel_stage_naming_an_unknown_device_is_refused() -> None:
    data = {**TP, "groups": [dict(TP["groups"][0]), TP["groups"][1]]}
    data["groups"][0]["stages"] = [{"devices": ["local:0", "gpu9:0"], "layers": [0, 3]},
                                   {"device": "local:2", "layers": [3, 6]}]
    with pytest.raises(InvalidPlanError) as info:
        check_plan(plan_from_dict(data), DEVICES, 6, 16, tensor_parallel=True)
    assert info.value.field == "plan.groups[0].stages[0].devices"
    assert "gpu9:0" in str(info.value)


@pytest.mark.parametrize("degrees", [(2,), (4,), (2, 4)])
def test_random_plans_with_tensor_parallel_stages_are_valid(degrees: tuple[int, ...]) -> None:
    rng = random.Random(5)
    for _ in range(40):
        plan = random_plan(rng, DEVICES, 6, 16, 2, rng.choice(["gpipe", "1f1b", "custom"]),
                           tp_degrees=degrees)
        check_plan(plan, DEVICES, 6, 16, tensor_parallel=True)
        tps = {s.tp for g in plan.groups for s in g.stages}
        assert tps <= {1, *degrees}, plan
        if max(len(g.devices) for g in plan.groups) >= min(degrees):  # room for a split
            assert max(tps) > 1, plan
        assert sorted(d for g in plan.groups for d in g.devices) == DEVICES


def test_the_sync_goes_per_shard_where_the_groups_split_a_layer_the_same_way() -> None:
    from hetpilot.trainer.rankpart import shard_ranks
    from hetpilot.trainer.testing.tp_ranks import EQUAL_PLAN

    rank_of = {d: i for i, d in enumerate(DEVICES)}
    equal = plan_from_dict(EQUAL_PLAN)  # local:1+local:0 and local:2+local:3, all layers
    assert [shard_ranks(equal, rank_of, layer) for layer in range(5)] == [[(0, 2), (1, 3)]] * 5
    mixed = plan_from_dict(TP)  # group 0: layers 0-2 split 2 ways, 3-5 whole; group 1 whole
    assert shard_ranks(mixed, rank_of, 0) is None  # split differently: full tensors
    assert shard_ranks(mixed, rank_of, 3) == [(2, 3)]  # whole in both: one shard


def _degrees(job: dict, degrees: tuple[int, ...] = (2,)) -> tuple[list[int], list[str]]:
    ok, why, split = split_degrees(job, "--job: j()", 4, 0, torch.float64, degrees)
    assert split == [1, 2]  # the two blocks
    return ok, why


def test_a_block_whose_reshape_fixes_the_head_count_cannot_run_split() -> None:
    job = examples.gpt()  # its Block: a fused qkv, then view(b, s, self.heads, ...)
    job["tp_plan"] = {"qkv": "colwise", "proj": "rowwise"}
    ok, why = _degrees(job)
    assert ok == [] and len(why) == 1
    assert why[0].startswith("degree 2: item 1 (Block)") and "split 2 ways" in why[0]


def test_splits_that_do_not_divide_or_are_not_paired_cannot_run() -> None:
    job = examples.gpt_tp()  # 32 outputs do not split 3 ways
    ok, why = _degrees(job, (2, 3))
    assert ok == [2] and "not divisible by 3" in why[0]
    job["tp_plan"] = {"mlp.up": "colwise"}  # no rowwise after it: mlp.down gets half
    ok, why = _degrees(job)
    assert ok == [] and "cannot run split 2 ways" in why[0] and "item 1 (TPBlock)" in why[0]


class _SdpaDropAttention(examples.Attention):
    """:class:`~hetpilot.trainer.examples.Attention` with functional dropout on its
    probabilities (``dropout_p``), which no module can draw whole."""

    def __init__(self, d_model: int, heads: int, p: float) -> None:
        super().__init__(d_model, heads)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        b, s, _ = x.shape
        q, k, v = (m(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.p if self.training else 0.0)
        return self.out(att.transpose(1, 2).reshape(b, s, -1))


def _with_sdpa_dropout(p: float) -> dict:
    job = examples.gpt_tp()
    for block in job["layers"][1:3]:
        old = block.attn
        block.attn = _SdpaDropAttention(32, 4, p)
        block.attn.load_state_dict(old.state_dict())
    return job


def test_functional_dropout_on_a_split_activation_is_refused_only_when_it_drops() -> None:
    ok, why = _degrees(_with_sdpa_dropout(0.1))
    assert ok == [] and len(why) == 1, why
    assert why[0].startswith("degree 2: item 1 (TPBlock)"), why
    assert "dropout inside a split region" in why[0] and "aten.bernoulli" in why[0], why
    assert _degrees(_with_sdpa_dropout(0.0)) == ([2], [])


def test_dropout_modules_on_split_and_whole_activations_are_not_refused() -> None:
    from hetpilot.trainer.testing.tp_jobs import gpt_tp_dropout

    assert _degrees(gpt_tp_dropout(), (2, 4)) == ([2, 4], [])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_dropout_between_colwise_and_rowwise_trains_as_one_process() -> None:
    """2 ranks: a stage split 2 ways whose blocks drop out attention probabilities (split
    by heads) and the MLP's hidden activation (split by columns) draws each mask whole, as
    one process does (a mask of the shard's shape drawn on each rank was off by ~0.1)."""
    from hetpilot.trainer.traincheck import run_check

    lines: list[str] = []
    worst = run_check(2, job="hetpilot.trainer.testing.tp_jobs:gpt_tp_dropout", seed=0,
                      timeout_s=150, log=lines.append)
    text = "\n".join(lines)
    assert "tensor-parallel stages checked: 1" in text, text
    assert worst["float64"].value <= 1e-9, text


def test_the_shipped_tensor_parallel_gpt_runs_split_two_and_four_ways() -> None:
    assert _degrees(examples.gpt_tp(), (2, 4)) == ([2, 4], [])


def test_train_check_refuses_a_tp_plan_that_splits_nothing_it_can_run() -> None:
    """Before any rank starts, naming the key (the CLI's exit 2)."""
    from hetpilot.planner.errors import ValidationError
    from hetpilot.trainer.traincheck import run_check

    job = "hetpilot.trainer.testing.tp_ranks:fixed_heads"
    with pytest.raises(ValidationError) as info:
        run_check(2, job=job, log=lambda _: None)
    assert info.value.field == f"--job: {job}()['tp_plan']"
    assert info.value.problem.startswith("degree 2: item 1 (Block)")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_live_switch_between_degrees_and_checkpoint_match_one_process(tmp_path: Path) -> None:
    """2 gloo ranks: degree 2 -> 1 -> 2 at iteration boundaries, a checkpoint saved split
    (full tensors, plan-independent) and reloaded split; every replica against one process
    in float64."""
    from hetpilot.trainer import checkpoint as ckpt
    from hetpilot.trainer.launch import spawn
    from hetpilot.trainer.reference import ReferenceRun, build_layers
    from hetpilot.trainer.testing.tp_ranks import STEPS, TP_PLAN, tp_switch_rank

    spawn(tp_switch_rank, 2, (str(tmp_path),), timeout_s=150)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    def reference() -> ReferenceRun:
        job = examples.gpt_tp()
        return ReferenceRun(build_layers(list(job["layers"]), 0, torch.float64), job["loss"],
                            job["optimizer"], job["dataset"], job["global_batch"], seed=0)

    def close(held: dict[int, dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]],
              what: str) -> None:
        assert held, what
        for layer, state in held.items():
            for name, value in state.items():
                diff = float((value - want[layer][name]).abs().max())
                assert diff <= 1e-9, f"{what}: layer {layer} {name!r} differs by {diff:.3e}"

    ref = reference()
    for i, (plan, iterations) in enumerate(STEPS):
        for _ in range(iterations):
            ref.step(plan_from_dict(plan))
        want = ref.states()
        for r in range(2):
            held = got[r]["states"][i]
            if plan is TP_PLAN:  # every layer on both ranks (the blocks split)
                assert sorted(held) == list(range(5))
            close(held, want, f"rank {r} after plan {i + 1}")
        if i == 0:  # the checkpoint holds full tensors, the one process's: no shard
            where = ckpt.resolve(tmp_path / "ckpt")
            assert where is not None
            for layer in range(5):
                saved = ckpt.read_file(where, ckpt.layer_file(layer))["module"]
                close({layer: saved}, want, "checkpoint")
            for r in range(2):
                close(got[r]["reloaded"], want, f"rank {r} reloaded")
    resumed = reference()
    for _ in range(3):  # two steps before the checkpoint, one after the reload
        resumed.step(plan_from_dict(TP_PLAN))
    for r in range(2):
        assert got[r]["split"] == [1, 2], "the blocks are split again after the reload"
        close(got[r]["after"], resumed.states(), f"rank {r} after the reload and a step")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_check_draws_tensor_parallel_plans_and_matches_one_process() -> None:
    """4 ranks: degree 2 within a pipeline, degree 4, and two uneven groups splitting layers
    differently (one 2 ways, one whole), each between plans without tensor parallelism."""
    import re

    from hetpilot.trainer.traincheck import run_check

    lines: list[str] = []
    worst = run_check(4, job="hetpilot.trainer.examples:gpt_tp", seed=4, timeout_s=200,
                      log=lines.append)
    text = "\n".join(lines)
    assert worst["float64"].value <= 1e-9, text
    assert "tensor-parallel stages checked: 3" in text, text
    summaries = [line for line in lines if line.startswith("plan v")]
    split = [bool(re.search(r"local:\d\+local:\d", s)) for s in summaries]
    assert any(split[i] and not split[i + 1] for i in range(len(split) - 1)), text  # t -> 1
    assert any(re.search(r"(local:\d\+){3}local:\d", s) for s in summaries), text  # degree 4
    assert any(";" in s and "+" in s for s in summaries), text  # groups split differently


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_groups_splitting_the_same_layers_sync_per_shard_and_match_one_process(
        tmp_path: Path) -> None:
    """4 gloo ranks in float64: two groups each splitting every layer 2 ways (per-shard
    sync, half the full path's bytes), then one split and one whole (full tensors)."""
    from hetpilot.trainer.launch import spawn
    from hetpilot.trainer.reference import ReferenceRun, build_layers
    from hetpilot.trainer.testing.tp_ranks import SYNC_STEPS, shard_sync_rank

    spawn(shard_sync_rank, 4, (str(tmp_path),), timeout_s=150)
    got = [torch.load(tmp_path / f"sync{r}.pt", weights_only=True) for r in range(4)]
    job = examples.gpt_tp()
    ref = ReferenceRun(build_layers(list(job["layers"]), 0, torch.float64), job["loss"],
                       job["optimizer"], job["dataset"], job["global_batch"], seed=0)
    for i, (plan, iterations) in enumerate(SYNC_STEPS):
        for _ in range(iterations):
            ref.step(plan_from_dict(plan))
        want = ref.states()
        for r in range(4):
            held = got[r][i]["states"]
            assert held, f"rank {r} holds nothing under plan {i + 1}"
            for layer, state in held.items():
                for name, value in state.items():
                    diff = float((value - want[layer][name]).abs().max())
                    assert diff <= 1e-9, f"rank {r} plan {i + 1}: {layer} {name!r}: {diff:.3e}"
    assert all(got[r][0]["paths"] == ["shard"] for r in range(4))
    for a, b in ((0, 1), (2, 3)):  # a stage's replicated parameters stay bitwise the same
        mine, theirs = got[a][0]["states"], got[b][0]["states"]
        assert all(torch.equal(mine[la][n], theirs[la][n]) for la in mine for n in mine[la])
    full_paths = [["full", "full"], ["full", "full"], ["full"], ["full"]]  # layers 0-1, 2-4
    assert [got[r][1]["paths"] for r in range(4)] == full_paths
    # the same layers, the same group sizes: a shard's bytes are half the full tensors'
    # (the blocks' split weights halve; the replicated ones do not)
    per_shard, full = got[0][0]["bytes"][0], got[0][1]["bytes"][0]
    assert 0 < per_shard < full


def test_profile_measures_the_all_reduces_of_the_layers_the_tp_plan_splits() -> None:
    from hetpilot.planner.serde import model_from_dict
    from hetpilot.trainer.profile import profile_model

    job = examples.gpt_tp()
    model = profile_model(job["layers"], job["sample"], tp_plan=job["tp_plan"])
    blocks = model["layers"][1:3]
    for layer in blocks:  # attn.out and mlp.down: two (b, s, d) outputs all-reduced
        assert layer["tp_allreduces"] == 2
        assert layer["tp_comm_mb"] == pytest.approx(16 * 32 * 4 / 1e6)  # float32 (s, d)
    for layer in (model["layers"][0], *model["layers"][3:]):  # no pattern matches: whole
        assert "tp_comm_mb" not in layer and "tp_allreduces" not in layer
    assert model_from_dict(model).layers[1].tp_comm_mb == blocks[0]["tp_comm_mb"]
    plain = profile_model(job["layers"], job["sample"])
    assert all("tp_comm_mb" not in layer for layer in plain["layers"])


def test_hf_job_takes_the_models_own_tp_plan_and_its_head_count_limits_the_degree() -> None:
    pytest.importorskip("transformers")
    from hetpilot.trainer.testing import hf_jobs

    job = hf_jobs.llama()  # 4 heads, 2 key/value heads
    assert job["tp_plan"]["block.self_attn.q_proj"] == "colwise"
    assert job["tp_plan"]["block.mlp.down_proj"] == "rowwise"
    ok, why, split = split_degrees(job, "--job: j()", 2, 0, torch.float64, (2, 4))
    assert ok == [2] and split == [1, 2]
    assert why[0].startswith("degree 4: item 1 (DecoderBlock): its forward cannot run split")
    assert "tp_plan" not in hf_jobs.gpt2()  # GPT-2 has no plan of its own


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_float16_loss_scaler_reads_split_gradients_slice_by_slice(tmp_path: Path) -> None:
    from hetpilot.trainer.launch import spawn
    from hetpilot.trainer.testing.tp_ranks import scaler_rank

    spawn(scaler_rank, 2, (str(tmp_path),), timeout_s=100)
    for r in range(2):
        got = torch.load(tmp_path / f"scaler{r}.pt", weights_only=True)
        assert got["stepped"] and got["unscaled"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0],
                                                      [6.0, 7.0]]
        assert got["skipped"] and got["scale"] == 2.0  # one rank's overflow: all skip
