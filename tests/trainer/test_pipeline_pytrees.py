"""Pipeline mechanics real models need: pytree activations across a cut, recompute that
leaves BatchNorm's running statistics as one forward does and recomputes from the buffers
the forward saw (spectral norm), and a loss that must be one number."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.pipeline import StageRunner
from hetpilot.trainer.testing.ranks import _activation_round_trip
from torch import nn


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_nested_activation_and_its_gradients_cross_a_cut(tmp_path: Path) -> None:
    spawn(_activation_round_trip, 2, (str(tmp_path),), timeout_s=45)
    got = torch.load(tmp_path / "recv.pt", weights_only=False)
    assert got["ids_dtype"] == "torch.int64"  # integer ids stay integers
    assert got["half_dtype"] == "torch.bfloat16"  # each leaf keeps its dtype
    assert got["meta"] == ["x", 7]  # non-tensor leaves arrive as metadata
    assert got["needs"] == 3 and got["h_requires"] is False  # only leaves that needed grads
    # complex and int16 leaves cross as their bytes (NCCL has no such types), unchanged
    assert torch.equal(got["z"], torch.ones(3) * (1 + 2j))
    assert torch.equal(got["short"], torch.tensor([-1, 0, 1], dtype=torch.int16))
    grad = torch.load(tmp_path / "grad.pt", weights_only=True)["w_grad"]
    assert torch.equal(grad, torch.full((3,), 2 * 5 + 3.0 + 2 * 4))  # d/dw (10w + 3w + 8w)


def _bn_stage(recompute: bool) -> tuple[StageRunner, nn.Module]:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    runner = StageRunner([layer], prev_rank=None, next_rank=None, recompute=recompute,
                         loss_fn=nn.functional.mse_loss, loss_scale=0.5,
                         device=torch.device("cpu"))
    return runner, layer


def test_recompute_updates_batchnorm_statistics_once() -> None:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    ys = [torch.randn(4, 4, generator=gen) for _ in range(2)]
    ops = [(False, 0), (False, 1), (True, 0), (True, 1)]
    results = []
    for recompute in (False, True):
        runner, layer = _bn_stage(recompute)
        runner.run(ops, lambda k: xs[k], lambda k: ys[k])
        results.append(layer)
    plain, recomputed = results
    bn_plain, bn_recomputed = plain[1], recomputed[1]
    assert isinstance(bn_plain, nn.BatchNorm1d) and isinstance(bn_recomputed, nn.BatchNorm1d)
    assert int(bn_recomputed.num_batches_tracked) == 2
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(bn_plain, name), getattr(bn_recomputed, name)), name
    for p, q in zip(plain.parameters(), recomputed.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-7)


def test_recompute_gives_rrelu_the_gradient_of_one_forward() -> None:
    """``nn.RReLU`` saves its random-slope tensor before filling it in place: torch's
    checkpoint early stop ended the recomputation there, and the backward read uninitialized
    memory (gradients of order 1e-310, or anything). Each layer now recomputes to its end."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randn(4, 2, generator=gen, dtype=torch.float64) for _ in range(2)]
    ops = [(False, 0), (False, 1), (True, 0), (True, 1)]
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        layers = [nn.Linear(3, 4).double(), nn.RReLU(), nn.Linear(4, 2).double()]
        runner = StageRunner(layers, prev_rank=None, next_rank=None, recompute=recompute,
                             loss_fn=nn.functional.mse_loss, loss_scale=0.5,
                             device=torch.device("cpu"))
        runner.rng_seed = lambda k: 100 + k
        runner.run(ops, lambda k: xs[k], lambda k: ys[k])
        grads.append([p.grad for layer in layers for p in layer.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        assert plain is not None and recomputed is not None
        assert torch.equal(plain, recomputed)


def test_a_scripted_layer_runs_in_a_recompute_stage() -> None:
    """torch's checkpoint failed inside the TorchScript interpreter on a fresh scripted
    module (its profiling executor saves other tensors on the recomputation): such a layer
    is not checkpointed, and its gradients are those of one forward."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    ys = [torch.randn(4, 2, generator=gen) for _ in range(2)]
    ops = [(False, 0), (False, 1), (True, 0), (True, 1)]
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        layers = [nn.Linear(3, 4), torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh())),
                  nn.Linear(4, 2)]
        runner = StageRunner(layers, prev_rank=None, next_rank=None, recompute=recompute,
                             loss_fn=nn.functional.mse_loss, loss_scale=0.5,
                             device=torch.device("cpu"))
        runner.run(ops, lambda k: xs[k], lambda k: ys[k])
        grads.append([p.grad for layer in layers for p in layer.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        assert plain is not None and recomputed is not None
        assert torch.allclose(plain, recomputed, atol=1e-6)  # the executor may fuse


def test_a_stage_of_parameter_free_layers_on_raw_input_runs() -> None:
    """Nothing needs a gradient: the stage runs its backward ops without autograd."""
    runner = StageRunner([nn.LayerNorm(3, elementwise_affine=False)], prev_rank=None,
                         next_rank=None, recompute=False, loss_fn=nn.functional.mse_loss,
                         loss_scale=1.0, device=torch.device("cpu"))
    stats, loss = runner.run([(False, 0), (True, 0)], lambda k: torch.randn(2, 3),
                             lambda k: torch.zeros(2, 3))
    assert stats.microbatches == 1 and loss > 0


def test_recompute_sees_the_buffers_the_forward_saw() -> None:
    """Spectral norm's forward updates its power-iteration vectors (buffers) and depends
    on them: 1f1b-style, microbatch 1's forward runs before microbatch 0's backward, and the
    recomputation of microbatch 0 must start from the vectors its forward started from, or
    it recomputes another weight (other gradients)."""
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(3)]
    ys = [torch.randn(4, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    ops = [(False, 0), (False, 1), (True, 0), (False, 2), (True, 1), (True, 2)]
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        layer = nn.utils.parametrizations.spectral_norm(nn.Linear(3, 4)).double()
        runner = StageRunner([layer], prev_rank=None, next_rank=None, recompute=recompute,
                             loss_fn=nn.functional.mse_loss, loss_scale=1 / 3,
                             device=torch.device("cpu"))
        runner.run(ops, lambda k: xs[k], lambda k: ys[k])
        results.append(layer)
    plain, recomputed = results
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-15), name
    for (name, a), b in zip(plain.named_buffers(), recomputed.buffers(), strict=True):
        assert torch.equal(a, b), name  # the recomputation left them as the forwards did


def test_a_loss_that_is_not_one_number_is_refused_naming_the_loss() -> None:
    runner = StageRunner([nn.Linear(3, 2)], prev_rank=None, next_rank=None, recompute=False,
                         loss_fn=lambda o, t: nn.functional.mse_loss(o, t, reduction="none"),
                         loss_scale=1.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"loss: returned a tensor of shape \(2, 2\)"):
        runner.run([(False, 0), (True, 0)], lambda k: torch.randn(2, 3),
                   lambda k: torch.zeros(2, 2))


def test_reading_a_tree_spec_raises_no_deprecation_warning() -> None:
    """A structseq (``torch.max(dim=)``'s result) in a message: the spec's children were
    read through ``children_specs``, which torch deprecates (a FutureWarning per message)."""
    import warnings

    from hetpilot.trainer.activations import _register_spec_types, flatten

    leaves, spec = flatten((torch.randn(3, 4).max(dim=1), {"a": torch.ones(2)}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _register_spec_types(spec)
    assert len(leaves) == 3


def test_evaluation_keeps_a_submodule_the_job_froze_in_eval_mode() -> None:
    # fine-tuning with frozen BatchNorm statistics: the layer trains, its BatchNorm stays in
    # eval mode; restoring the layer's own mode after evaluation put the BatchNorm back
    # in training, so its running statistics moved from then on
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4).eval()
    layer = nn.Sequential(nn.Linear(3, 4), bn)
    runner = StageRunner([layer], prev_rank=None, next_rank=None, recompute=False,
                         loss_fn=nn.functional.mse_loss, loss_scale=1.0,
                         device=torch.device("cpu"))
    x, y = torch.randn(4, 3), torch.randn(4, 4)
    runner.evaluate([4], lambda k: x, lambda k: y, nn.functional.mse_loss)
    assert layer.training and not bn.training
    before = bn.running_mean.clone()
    runner.run([(False, 0), (True, 0)], lambda k: x, lambda k: y)
    assert torch.equal(bn.running_mean, before)


def test_dtypes_nccl_cannot_send_cross_as_their_bytes() -> None:
    """NCCL's send and recv take a fixed table of dtypes; a complex, int16 or float8 leaf
    goes as a flat uint8 view of its own memory (what a receive fills in place)."""
    from hetpilot.trainer.activations import NATIVE_DTYPES, as_bytes

    for dtype in (torch.complex64, torch.complex128, torch.int16, torch.float8_e4m3fn):
        t = torch.zeros(2, 3, dtype=dtype)
        b = as_bytes(t)
        assert b.dtype == torch.uint8 and b.numel() == 6 * t.element_size()
        assert b.data_ptr() == t.data_ptr()  # a view: receiving into it fills t
    for dtype in NATIVE_DTYPES:
        t = torch.zeros(2, dtype=dtype)
        assert as_bytes(t) is t
    scalar = torch.tensor(1 + 2j)
    assert as_bytes(scalar).numel() == 8
