"""Checkpoint/resume under another plan and world size, live refusal, measurements."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hetpilot.planner.serde import plan_from_dict, plan_to_dict
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.testing.ranks import (
    PLAN_1F1B_2,
    PLAN_A,
    PLAN_CROSSED,
    _bad_device_run,
    _first_run,
    _nccl_like_run,
    _resumed_run,
    _untagged_run,
    one_process_reference,
    reference_states,
)


def _assert_held_match(out: Path, ranks: int, reference: Any) -> None:
    """Every layer each rank saved (``held{rank}.pt``) equals the one-process reference's."""
    for rank in range(ranks):
        held = torch.load(out / f"held{rank}.pt", weights_only=True)
        assert held, f"rank {rank} holds no layer"
        for layer, state in held.items():
            for key, value in state.items():
                assert float((value - reference[layer][key]).abs().max()) <= 1e-9, (layer, key)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_under_other_plan_and_world_size(tmp_path: Path) -> None:
    spawn(_first_run, 3, (str(tmp_path),), timeout_s=90)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000002"
    assert (tmp_path / "ckpt" / "step-00000002" / "meta.json").exists()
    spawn(_resumed_run, 2, (str(tmp_path),), timeout_s=90)
    _assert_held_match(tmp_path, 2, reference_states())
    # measurements: one record per rank per epoch with per-stage times
    records = [json.loads(line) for line in (tmp_path / "report0.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    assert {"fwd_s", "bwd_s", "transfer_wait_s", "samples_per_s", "plan_version"} <= set(records[0])
    assert records[0]["samples_per_s"] > 0


@pytest.mark.timeout(120)
def test_messages_matched_in_send_order_as_nccl_matches_them(tmp_path: Path) -> None:
    """NCCL has no tags: messages between two ranks match in the order they were sent. With
    every tag 0, gloo does the same; a 3-stage custom plan whose neighbours run the
    microbatches in other orders still trains as one process does, since each stage
    receives in its neighbour's send order and keeps what comes early
    (before, stage 1 took microbatch 1's activation for microbatch 0's)."""
    spawn(_untagged_run, 3, (str(tmp_path),), timeout_s=90)
    _assert_held_match(tmp_path, 3, one_process_reference(PLAN_CROSSED))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("plan", "ranks"), [(PLAN_1F1B_2, 2), (PLAN_CROSSED, 3)])
def test_pipelines_train_under_nccl_like_point_to_point(tmp_path: Path, plan: dict[str, Any],
                                                        ranks: int) -> None:
    """EMULATED NCCL (``testing.ranks.NcclLikeP2P``: per rank pair and group one stream running
    its messages in posting order, no tags, a send done only when the peer's stream reaches
    the receive): with the gradients in a group of their own, a 1F1B pipeline and the
    crossed custom plan train as one process does."""
    spawn(_nccl_like_run, ranks, (str(tmp_path), plan, True), timeout_s=90)
    _assert_held_match(tmp_path, ranks, one_process_reference(plan))


@pytest.mark.timeout(120)
def test_gradients_sharing_the_activations_group_deadlock_under_nccl_like_point_to_point(
        tmp_path: Path) -> None:
    """The negative control: with activations and gradients in one group (as on gloo), the
    same emulation deadlocks a 2-stage 1F1B pipeline, as NCCL would once messages outgrow
    its buffers (stage 0 sends activation 1 before it receives gradient 0; stage 1 sends
    gradient 0 before it receives activation 1; each stream's send waits on the other)."""
    with pytest.raises(TimeoutError):
        spawn(_nccl_like_run, 2, (str(tmp_path), PLAN_1F1B_2, False), timeout_s=15)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_unknown_device_is_refused_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"no rank has device 'local:9'"):
        spawn(_bad_device_run, 2, (str(tmp_path),), timeout_s=45)
    assert not (tmp_path / "report0.jsonl").exists()  # nothing ran


def test_plan_dicts_round_trip() -> None:
    assert plan_to_dict(plan_from_dict(PLAN_A))["groups"][0]["samples"] == 10


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_epoch_record_has_loss_and_the_eval_hook_metric(tmp_path: Path) -> None:
    """The held-out metric equals the trained model evaluated in one process (eval mode:
    BatchNorm uses its running statistics), over 4 microbatches of 2, 2, 2, 1 samples."""
    from hetpilot.trainer.testing.jobs import bn_tiny
    from hetpilot.trainer.testing.ranks import _eval_hook_run
    from torch import nn

    spawn(_eval_hook_run, 2, (str(tmp_path),), timeout_s=45)
    saved = torch.load(tmp_path / "eval.pt", weights_only=False)
    record = saved["record"]
    assert record["loss"] > 0 and record["epoch"] == 0
    layers = bn_tiny()["layers"]
    for i, layer in enumerate(layers):
        layer.load_state_dict(saved["states"][i])
    model = nn.Sequential(*layers).eval()
    x, y = saved["held_out"].tensors
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(model(x), y))
    assert abs(record["eval_metric"] - expected) < 1e-6
    assert saved["training"], "the hook left rank 0's layers in eval mode"


def test_tensor_datasets_are_gathered_exactly_as_default_collate_stacks_them() -> None:
    """The runtime's one-index gather of a TensorDataset gives what DataLoader's
    default_collate gives from one sample at a time: values, dtype and shape."""
    from hetpilot.trainer.batches import collate
    from torch.utils.data import TensorDataset, default_collate

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 3, 5, generator=gen),
                         torch.randint(0, 9, (40,), generator=gen),
                         torch.randn(40, generator=gen, dtype=torch.float64))
    for indices in ([7, 3, 3, 39, 0], [12], list(range(40))):
        for which in range(3):
            fast = collate(data, indices, which)
            slow = default_collate([data[i][which] for i in indices])
            assert fast.dtype == slow.dtype and fast.shape == slow.shape
            assert torch.equal(fast, slow)


def test_items_augmented_at_random_are_read_alike_by_first_and_last_stage() -> None:
    """A dataset drawing a joint augmentation in ``__getitem__``: the inputs (first stage)
    and the targets (last stage) of the same items, read on ranks whose generators are
    elsewhere in their streams, still belong together, and reads leave the caller's
    generators where they were; another epoch draws anew."""
    import random

    from hetpilot.trainer.batches import collate
    from hetpilot.trainer.testing.jobs import JointFlip

    data = JointFlip()
    indices = list(range(16))
    torch.manual_seed(1)
    random.seed(1)
    xs = collate(data, indices, 0, 3, 1)
    after = (torch.rand(3), random.random())
    torch.manual_seed(1)
    random.seed(1)
    assert torch.equal(torch.rand(3), after[0]) and random.random() == after[1]
    torch.manual_seed(2)
    random.seed(2)  # the last stage's rank: its generators are in another state
    ys = collate(data, indices, 1, 3, 1)
    sign = ys[:, :1] / data.y[indices, :1]
    assert torch.allclose(sign.abs(), torch.ones_like(sign))
    assert {float(s) for s in sign} == {-1.0, 1.0}
    shift = xs - sign * data.x[indices]  # the same shift over an item's features
    assert torch.allclose(ys, sign * data.y[indices])
    assert torch.allclose(shift, shift[:, :1].expand_as(shift))
    assert torch.equal(collate(data, indices, 0, 3, 1), xs)
    assert not torch.equal(collate(data, indices, 0, 3, 2), xs)


def test_seeded_draws_repeat_and_leave_the_generator_where_it_was() -> None:
    """A stage's forward of a microbatch draws the same numbers every time its key is the
    same, different ones for another microbatch, and the caller's stream is untouched."""
    from hetpilot.trainer.pipeline import microbatch_seed, seeded

    cpu = torch.device("cpu")
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    keys = [microbatch_seed(0, 1, 2, 0, 3, k) for k in (0, 0, 1)]
    draws = []
    for key in keys:
        with seeded(key, cpu):
            draws.append(torch.rand(5))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert torch.equal(torch.rand(4), expected)  # as if the blocks had not run
    assert len(set(keys)) == 2 and all(0 <= k < 2**63 for k in keys)
    assert microbatch_seed(0, 1, 2, 1, 3, 0) != keys[0]  # another group draws otherwise


def test_copies_of_an_old_weight_norm_layer_compute_what_it_computes() -> None:
    # torch.nn.utils.weight_norm (the hook API) keeps `weight` as a non-leaf attribute,
    # which deepcopy refuses: train-check and profile crashed on vocoder-style layers
    import copy

    from hetpilot.trainer.layers import copy_layers
    from torch import nn

    torch.manual_seed(0)
    layer = nn.utils.weight_norm(nn.Linear(3, 4))
    dup = copy_layers([layer])[0]
    x = torch.randn(2, 3)
    assert torch.equal(dup(x), layer(x))
    assert {n for n, _ in dup.named_parameters()} == {"bias", "weight_g", "weight_v"}
    with torch.no_grad():
        dup.weight_g.mul_(2)  # the copy's own parameters drive its weight
    assert not torch.allclose(dup(x), layer(x))
    assert dup.weight_v.grad is None and dup.weight_g.is_leaf
    with pytest.raises(RuntimeError):  # what copy_layers gets around
        copy.deepcopy(layer)


def test_copies_of_a_layer_keep_its_parameters_gradient_hooks() -> None:
    # deepcopy drops them: the pre-flight and the profile ran a backward without the
    # job's gradient clamp (so its note never came) or its raising hook
    from hetpilot.trainer.layers import copy_layers
    from torch import nn

    layer, accumulated = nn.Linear(3, 2), []
    layer.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    layer.bias.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.clone()))
    first, again = copy_layers([layer, layer])  # one layer twice: one copy, hooks once
    assert first is again and len(first.weight._backward_hooks) == 1
    first(torch.randn(4, 3) * 100).sum().backward()
    assert first.weight.grad is not None and first.weight.grad.abs().max() <= 0.01
    assert len(accumulated) == 1 and torch.equal(accumulated[0], first.bias.grad)
    assert layer.weight.grad is None  # the original is left alone


def test_a_layer_keeping_a_computed_tensor_is_refused_naming_it() -> None:
    from hetpilot.trainer.layers import copy_layers
    from torch import nn

    layer = nn.Linear(3, 4)
    layer.scaled = layer.weight * 2  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"layers: item 1 \(Linear\): attribute 'scaled'"):
        copy_layers([nn.Identity(), layer])
