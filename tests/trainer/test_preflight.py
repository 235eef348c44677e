"""train-check's one-process pre-flight: what cannot train under the runtime is refused
before any rank starts, naming the key; a loss that is not a mean over samples gets a note."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hetpilot.planner.errors import ValidationError
from hetpilot.trainer.preflight import preflight
from torch import nn
from torch.nn import functional as F


def _spec(layers: list[Any], loss: Any = F.mse_loss, dataset: Any = None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=gen), torch.randn(12, 2, generator=gen)
    return {"layers": layers, "loss": loss, "global_batch": 6,
            "optimizer": lambda ps: torch.optim.SGD(ps, lr=0.1),
            "dataset": dataset if dataset is not None else torch.utils.data.TensorDataset(x, y)}


def _run(spec: dict[str, Any], microbatch: int = 2) -> list[str]:
    return preflight(spec, "--job: m:f()", microbatch, seed=0, dtype=torch.float64)


class ToFloat32(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.float()


class Table(nn.Module):
    """A constant buffer (as a rotary table): sharing it between layers is fine."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


def _shared_bn() -> list[nn.Module]:
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    return [block, nn.Tanh(), block, nn.Linear(4, 2)]


def _shared_table() -> list[nn.Module]:
    table = Table()
    return [table, nn.Linear(4, 4), table, nn.Linear(4, 2)]


@pytest.mark.parametrize(("layers", "loss", "key", "words"), [
    ([nn.Linear(4, 2)], lambda o, t: F.mse_loss(o, t, reduction="none"), "loss",
     "returned a tensor of shape (2, 2): it must return one number"),
    ([nn.Linear(4, 2)], lambda o, t: F.mse_loss(o, t).detach().item(), "loss", "returned a float"),
    (_shared_bn(), F.mse_loss, "layers", "items 0 and 2 share the buffer '1.running_mean'"),
    ([nn.Linear(4, 4), torch.tanh, nn.Linear(4, 2)], F.mse_loss, "layers",
     "item 1 (_VariableFunctionsClass.tanh) is neither a module nor a zero-argument factory"),
    ([nn.Linear(4, 4), lambda: torch.tanh, nn.Linear(4, 2)], F.mse_loss, "layers",
     "returned a builtin_function_or_method, not an nn.Module"),
    ([nn.Linear(4, 4), ToFloat32(), nn.Linear(4, 2)], F.mse_loss, "layers",
     "item 2 (Linear) failed on a microbatch of 2 samples in float64: RuntimeError"),
])
def test_what_cannot_train_is_refused_naming_the_key(layers: list[Any], loss: Any, key: str,
                                                     words: str) -> None:
    with pytest.raises(ValidationError) as info:
        _run(_spec(layers, loss))
    assert str(info.value).startswith(f"--job: m:f()['{key}']"), str(info.value)
    assert words in str(info.value)


class Opaque:
    """Not a pytree node, not a dataclass: torch's pytree sees one leaf."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class ToOpaque(nn.Module):
    def forward(self, h: torch.Tensor) -> Opaque:
        return Opaque(h)


class FromOpaque(nn.Module):
    def forward(self, v: Opaque) -> torch.Tensor:
        return v.h


def test_an_activation_hiding_a_tensor_from_pytree_is_refused_naming_the_layer() -> None:
    """Across a cut its tensor would go pickled, without a gradient."""
    with pytest.raises(ValidationError, match=r"item 1 \(ToOpaque\): an activation crossing a "
                                              r"pipeline cut holds a tensor in Opaque\.h"):
        _run(_spec([nn.Linear(4, 4), ToOpaque(), FromOpaque(), nn.Linear(4, 2)]))


class WithAdjacency(nn.Module):
    """A graph layer returning its sparse adjacency beside the features (PyG style)."""

    def forward(self, h: torch.Tensor) -> Any:
        adj = (torch.eye(h.shape[0], dtype=h.dtype) + 0.5).to_sparse()
        return h, adj


class Propagate(nn.Module):
    def forward(self, value: Any) -> torch.Tensor:
        h, adj = value
        return torch.sparse.mm(adj, h)


def test_a_sparse_activation_is_refused_naming_the_layer_and_a_last_one_passes() -> None:
    """The wire carries dense tensors; the check of a layer's second run took sparse ones
    too, and raised from torch (exit 1, a traceback) before this."""
    with pytest.raises(ValidationError, match=r"item 1 \(WithAdjacency\): an activation "
                                              r"crossing a pipeline cut is a torch.sparse_coo "
                                              r"tensor"):
        _run(_spec([nn.Linear(4, 4), WithAdjacency(), Propagate(), nn.Linear(4, 2)]))
    last = _spec([nn.Linear(4, 4), WithAdjacency()],
                 loss=lambda out, y: F.mse_loss(torch.sparse.mm(out[1], out[0])[:, :2], y))
    _run(last)  # no cut after the last layer: nothing crosses


class ConvOfFloat32(nn.Module):
    """uint8 images made float32 with ``.float()``: conv's dtype error is in lower case."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.float().unsqueeze(1)).flatten(1)[:, :2]


def test_the_float64_hint_comes_with_convs_lower_case_dtype_error() -> None:
    with pytest.raises(ValidationError, match=r"train-check runs float64"):
        _run(_spec([ConvOfFloat32(), nn.Linear(2, 2)]))


def test_a_layer_returning_float32_is_named_when_the_next_one_fails() -> None:
    with pytest.raises(ValidationError, match=r"item 1 \(ToFloat32\) returned float32 values"):
        _run(_spec([nn.Linear(4, 4), ToFloat32(), nn.Linear(4, 2)]))


class NeedsClosure(torch.optim.SGD):
    """Sharpness-aware minimisation's shape: a step that re-evaluates the loss."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is None:
            raise RuntimeError("SAM requires closure")
        return super().step(closure)


def test_an_optimizer_needing_a_closure_is_refused_saying_why() -> None:
    spec = {**_spec([nn.Linear(4, 2)]), "optimizer": lambda ps: NeedsClosure(ps, lr=0.1)}
    with pytest.raises(ValidationError, match=r"SAM requires closure; the runtime calls "
                                              r"step\(\) without a closure"):
        _run(spec)


def test_items_that_cannot_be_batched_are_refused_naming_the_dataset() -> None:
    ragged = [(torch.zeros(4 + i % 2), torch.zeros(2)) for i in range(12)]
    with pytest.raises(ValidationError, match=r"\['dataset'\]: the inputs of items 0-1"):
        _run(_spec([nn.Linear(4, 2)], dataset=ragged))


def test_a_forward_writing_into_a_parameter_is_refused_naming_it() -> None:
    gen = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 9, (12, 3), generator=gen), torch.randn(12, 2, generator=gen)
    layers = [nn.Embedding(9, 4, max_norm=0.5), nn.Flatten(), nn.Linear(12, 2)]
    with pytest.raises(ValidationError, match=r"item 0 \(Embedding\) writes into its "
                                              r"parameter 'weight'"):
        _run(_spec(layers, dataset=torch.utils.data.TensorDataset(ids, y)))


def test_an_optimizer_that_cannot_step_on_dense_gradients_is_refused() -> None:
    """A sparse embedding's gradient is summed into the sync's dense buffer: SparseAdam,
    which would run in one process, would fail at the first plan with two groups."""
    gen = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 9, (12, 3), generator=gen), torch.randn(12, 2, generator=gen)
    spec = _spec([nn.Embedding(9, 4, sparse=True), nn.Flatten(), nn.Linear(12, 2)],
                 dataset=torch.utils.data.TensorDataset(ids, y))
    spec["optimizer"] = lambda ps: (torch.optim.SparseAdam(ps) if ps[0].shape == (9, 4)
                                    else torch.optim.Adam(ps))
    with pytest.raises(ValidationError, match=r"\['optimizer'\]: its step failed on item 0's "
                                              r"\(Embedding\) gradients"):
        _run(spec)


def test_an_optimizer_that_cannot_step_on_sparse_gradients_is_refused() -> None:
    """Under a plan of one data-parallel group nothing syncs a sparse embedding's gradient:
    it reaches the optimizer sparse, which Adam refuses (it used to pass the pre-flight, which
    stepped on dense gradients only, and fail as a traceback in a rank)."""
    gen = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 9, (12, 3), generator=gen), torch.randn(12, 2, generator=gen)
    spec = _spec([nn.Embedding(9, 4, sparse=True), nn.Flatten(), nn.Linear(12, 2)],
                 dataset=torch.utils.data.TensorDataset(ids, y))
    spec["optimizer"] = lambda ps: torch.optim.Adam(ps)
    with pytest.raises(ValidationError, match=r"\['optimizer'\]: its step failed on item 0's "
                                              r"\(Embedding\) gradients as the runtime hands "
                                              r"them \(sparse"):
        _run(spec)
    spec["optimizer"] = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # takes both
    assert _run(spec) == []


class ClipSGD(torch.optim.SGD):
    """SGD behind a gradient-norm clip over all the parameters it is given."""

    def step(self, closure: Any = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, 0.01)
        return super().step(closure)


def test_an_optimizer_coupling_the_layers_parameters_is_refused() -> None:
    """A gradient-norm clip over all the optimizer's parameters: the runtime builds one
    optimizer per layer, which clips each layer apart (train-check then failed, exit 1,
    naming a layer); element-wise optimizers, parameter groups and per-instance lr
    schedules pass."""
    spec = _spec([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)])
    spec["optimizer"] = lambda ps: ClipSGD(ps, lr=0.1)
    with pytest.raises(ValidationError, match=r"\['optimizer'\]: one optimizer over all the "
                                              r"layers' parameters steps them to other values"):
        _run(spec)
    for factory in (lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True, weight_decay=0.1),
                    lambda ps: torch.optim.NAdam(
                        [{"params": [p for p in ps if p.ndim > 1]},
                         {"params": [p for p in ps if p.ndim <= 1], "lr": 0.003}], lr=0.01),
                    lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True, momentum=0.5)):
        spec["optimizer"] = factory
        assert _run(spec) == []


class ListClipSGD(torch.optim.SGD):
    """The usual wrapper: SGD clipping the gradient norm over the list it was given, kept in
    an attribute (and, for good measure, in a wrapped optimizer's attribute too)."""

    def __init__(self, params: Any, **kw: Any) -> None:
        self.params = list(params)
        super().__init__(self.params, **kw)
        self.inner = torch.optim.SGD(self.params, lr=0.0)
        self.inner.mine = tuple(self.params)  # type: ignore[attr-defined]

    def step(self, closure: Any = None) -> Any:
        mine = self.inner.mine  # type: ignore[attr-defined]
        assert all(a is b for a, b in zip(mine, self.param_groups[0]["params"], strict=True))
        torch.nn.utils.clip_grad_norm_(self.params, 0.01)
        return super().step(closure)


def test_a_clip_over_the_parameter_list_an_optimizer_keeps_is_refused() -> None:
    # preflight built the optimizer on the job's own parameters and pointed only its
    # param_groups at the copies it steps: the wrapper clipped the originals, which had no
    # gradients, so the clip went unseen (train-check FAILed naming a weight, and
    # `hetpilot train` clipped each layer apart)
    spec = _spec([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)])
    spec["optimizer"] = lambda ps: ListClipSGD(ps, lr=0.1)
    with pytest.raises(ValidationError, match=r"\['optimizer'\]: one optimizer over all the "
                                              r"layers' parameters steps them to other values"):
        _run(spec)


def test_a_wrapped_optimizers_groups_are_stepped_as_the_runtime_hands_them() -> None:
    # an optimizer stepping inner optimizers of its own (SparseAdam for the sparse embedding,
    # Adam for the rest): the inner ones kept the job's own parameters, which have no
    # gradients in preflight, and the rank crashed on the dense gradient it was handed
    emb = nn.Embedding(9, 4, sparse=True)

    class Both(torch.optim.Optimizer):
        def __init__(self, ps: Any) -> None:
            ps = list(ps)
            super().__init__(ps, {"lr": 0.01})
            sparse = [p for p in ps if p is emb.weight]
            dense = [p for p in ps if p is not emb.weight]
            self.inner = ([torch.optim.SparseAdam(sparse)] if sparse else []) + (
                [torch.optim.Adam(dense)] if dense else [])

        def step(self, closure: Any = None) -> Any:
            for inner in self.inner:
                inner.step()

    gen = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 9, (12, 3), generator=gen), torch.randn(12, 2, generator=gen)
    spec = _spec([emb, nn.Flatten(), nn.Linear(12, 2)],
                 dataset=torch.utils.data.TensorDataset(ids, y))
    spec["optimizer"] = Both
    with pytest.raises(ValidationError, match=r"\['optimizer'\]: its step failed on item 0's "
                                              r"\(Embedding\) gradients .* \(dense, summed"):
        _run(spec)


def test_a_backward_failing_as_in_one_process_is_refused_naming_the_layers() -> None:
    class HalveInPlace(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.mul_(0.5)  # what ReLU saved for its backward

    with pytest.raises(ValidationError, match=r"\['layers'\]: the backward of one microbatch "
                                              r"failed, as it would in one process"):
        _run(_spec([nn.Linear(4, 4), nn.ReLU(), HalveInPlace(), nn.Linear(4, 2)]))


class WarmupSGD(torch.optim.SGD):
    """SGD with a linear lr warm-up counted in a Python attribute (not in its state_dict)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr, momentum=0.9)
        self.base, self.t = lr, 0

    def step(self, closure: Any = None) -> Any:
        self.t += 1
        for group in self.param_groups:
            group["lr"] = self.base * min(1.0, self.t / 3)
        return super().step(closure)


class EmaTeacher(nn.Module):
    """A mean teacher: an EMA of the weight in a buffer, updated in place in the forward
    and used in a product (autograd saves it for the input's gradient)."""

    def __init__(self, clone: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.clone = clone
        self.register_buffer("ema", self.lin.weight.detach().clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.lerp_(self.lin.weight, 0.1)
        ema = self.ema.clone() if self.clone else self.ema
        return torch.tanh(self.lin(h)) + F.linear(h, ema)


def test_a_forward_overwriting_what_an_earlier_backward_needs_is_refused() -> None:
    """Pipelines run several forwards before their backwards: the second forward's in-place
    update of the buffer the first one's backward needs failed that backward in a rank (a
    traceback, exit 1); the same layer using a copy of the buffer passes."""
    with pytest.raises(ValidationError, match=r"\['layers'\]: item 1 \(EmaTeacher\) writes in "
                                              r"its forward, in place, into a tensor that the "
                                              r"backward of an earlier microbatch needs"):
        _run(_spec([nn.Linear(4, 4), EmaTeacher(clone=False), nn.Linear(4, 2)]))
    assert _run(_spec([nn.Linear(4, 4), EmaTeacher(clone=True), nn.Linear(4, 2)])) == []


def test_an_optimizer_with_state_outside_its_state_dict_is_refused() -> None:
    """A layer's optimizer moves to another rank by its state_dict when a plan switch moves
    the layer: a step count kept in an attribute restarted there (train-check failed, exit
    1, at the first plan moving a layer). Torch's optimizers and a wrapper returning its
    scheduler's state in its state_dict pass."""
    spec = _spec([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)])
    spec["optimizer"] = lambda ps: WarmupSGD(ps, lr=0.1)
    with pytest.raises(ValidationError, match=r"\['optimizer'\]: WarmupSGD steps otherwise "
                                              r"after a fresh one is given its state_dict"):
        _run(spec)
    for factory in (lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=1),
                    lambda ps: torch.optim.Rprop(ps, lr=0.01),
                    lambda ps: torch.optim.NAdam(ps, lr=0.01, decoupled_weight_decay=True,
                                                 weight_decay=0.01)):
        spec["optimizer"] = factory
        assert _run(spec) == []


def test_a_layer_failing_on_the_microbatch_train_check_chose_says_how_to_choose() -> None:
    """BatchNorm1d fails on one sample; with no microbatch_size in the job, train-check
    picked 1 itself (global_batch 6 over 3 ranks), which the refusal says."""
    spec = _spec([nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)])
    with pytest.raises(ValidationError, match=r"item 1 \(BatchNorm1d\) failed on a microbatch "
                                              r"of 1 samples.*train-check chose microbatches "
                                              r"of 1 sample.*'microbatch_size'"):
        _run(spec, microbatch=1)
    spec["microbatch_size"] = 2
    assert _run(spec, microbatch=2) == []


def test_a_factory_sharing_a_parameter_is_refused() -> None:
    shared = nn.Linear(4, 4)
    with pytest.raises(ValidationError, match=r"items 0 and 2 share a parameter, and one is "
                                              r"a factory"):
        _run(_spec([lambda: shared, nn.Tanh(), shared, nn.Linear(4, 2)]))


def test_shared_parameters_and_constant_buffers_pass() -> None:
    shared = nn.Linear(4, 4)
    assert _run(_spec([shared, nn.Tanh(), shared, nn.Linear(4, 2)])) == []
    assert _run(_spec(_shared_table())) == []


def test_a_loss_that_is_not_a_mean_over_samples_gets_a_note() -> None:
    """cross_entropy with ignore_index over padded targets averages over the tokens it
    keeps, a count that differs between microbatches. A model whose outputs depend on the
    microbatch (BatchNorm, dropout) is no such thing: the loss is compared on the same
    outputs."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 5, (12, 6), generator=gen)
    targets = ids.clone()
    targets[::3, 2:] = -100  # every third sample mostly padding

    def token_mean(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=-100)

    lm = [nn.Embedding(5, 4), nn.Linear(4, 5)]
    data = torch.utils.data.TensorDataset(ids, targets)
    notes = _run(_spec(lm, token_mean, data))
    assert len(notes) == 1 and "not a mean over samples" in notes[0]
    assert _run(_spec(lm, token_mean, data), microbatch=6) == []  # one microbatch: the same

    def per_sample(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # as docs/trainer.md
        return F.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=-100,
                               reduction="sum") / t.numel()

    assert _run(_spec(lm, per_sample, data)) == []
    bn_dropout = [nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)]
    assert _run(_spec(bn_dropout)) == []


class InBatchSimilarity(nn.Module):
    """CLIP's head: each sample's similarity to every sample of the microbatch (m x m)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = F.normalize(h, dim=1)
        return z @ z.T / 0.1


def _in_batch_targets(logits: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, torch.arange(logits.shape[0]))


def test_a_head_comparing_the_samples_of_a_microbatch_gets_a_note() -> None:
    """Its outputs do not concatenate across microbatches (m x m each), so the loss alone
    cannot be compared; two microbatches as one against apart say the objective is the
    microbatch's."""
    notes = _run(_spec([nn.Linear(4, 4), InBatchSimilarity()], _in_batch_targets))
    assert len(notes) == 1 and "couples the samples of a microbatch" in notes[0]
    assert _run(_spec([nn.Linear(4, 4), InBatchSimilarity()], _in_batch_targets),
                microbatch=6) == []  # one microbatch per global batch: nothing to compare


def test_a_backward_depending_on_the_microbatch_gets_a_note() -> None:
    """``Embedding(scale_grad_by_freq=True)`` divides each row's gradient by its count in
    the microbatch: the loss is a mean, the forward per sample, but the gradients of a
    global batch differ from the sum of its microbatches' (train-check passed it without a
    word, its reference taking the same microbatches)."""
    gen = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 6, (12, 5), generator=gen), torch.randn(12, 4, generator=gen)
    data = torch.utils.data.TensorDataset(ids, y)

    class Mean(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.mean(1)

    notes = _run(_spec([nn.Embedding(6, 4, scale_grad_by_freq=True), Mean(), nn.Linear(4, 4)],
                       dataset=data))
    assert len(notes) == 1 and "gradients depend on how samples are grouped" in notes[0]
    assert "item 0 (Embedding) 'weight'" in notes[0]
    assert _run(_spec([nn.Embedding(6, 4), Mean(), nn.Linear(4, 4)], dataset=data)) == []
    assert _run(_spec([nn.Embedding(6, 4, scale_grad_by_freq=True), Mean(), nn.Linear(4, 4)],
                      dataset=data), microbatch=6) == []  # one microbatch: the same
    assert "although its outputs and the loss, a mean over samples, agree" in notes[0]

    class Centre(nn.Module):  # the forward computes over the microbatch (no train/eval)
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h - h.mean(0, keepdim=True)

    notes = _run(_spec([nn.Linear(4, 4), Centre(), nn.Linear(4, 2)]))
    assert len(notes) == 1 and "and so do its outputs: a layer computes" in notes[0]


def test_parameter_hooks_run_in_the_preflight() -> None:
    """A gradient hook on a parameter (``Tensor.register_hook``) is lost in a deep copy, and
    the pre-flight runs copies: an element-wise clamp, which makes the gradient depend on
    the microbatch, got no note, and a hook that raises reached the ranks as a traceback."""
    clamped = nn.Linear(4, 4)
    clamped.weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    notes = _run(_spec([clamped, nn.Tanh(), nn.Linear(4, 2)]))
    assert len(notes) == 1 and "gradients depend on how samples are grouped" in notes[0]
    assert "item 0 (Linear) 'weight'" in notes[0]

    def refuse(_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this hook refuses every gradient")

    raising = nn.Linear(4, 2)
    raising.bias.register_hook(refuse)
    with pytest.raises(ValidationError, match=r"\['layers'\].*this hook refuses"):
        _run(_spec([nn.Linear(4, 4), nn.Tanh(), raising]))


def test_a_loss_module_is_cast_as_the_layers_and_class_weights_get_the_note() -> None:
    """``nn.CrossEntropyLoss(weight=w)`` holds a float32 buffer: the loss module is cast to
    the run's dtype as the layers are (it used to be refused in a float64 check, the kernel
    finding Float weights for Double outputs), and a class-weighted mean, which is not a
    mean over samples, gets the note."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=gen), torch.tensor([0, 0, 1, 2, 1, 1] * 2)
    data = torch.utils.data.TensorDataset(x, y)
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]))
    notes = _run(_spec([nn.Linear(4, 3)], weighted, data))
    assert len(notes) == 1 and "class weights (weight=w)" in notes[0]
    assert weighted.weight.dtype == torch.float32  # the job's own module is left alone
    assert _run(_spec([nn.Linear(4, 3)], nn.CrossEntropyLoss(), data)) == []

    def closure(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # cannot be cast
        return F.cross_entropy(out, t, weight=torch.tensor([1.0, 2.0, 0.5]))

    with pytest.raises(ValidationError, match=r"\['loss'\]: failed .*\(train-check runs "
                                              r"float64: the loss must compute"):
        _run(_spec([nn.Linear(4, 3)], closure, data))


def test_a_scripted_layer_passes() -> None:
    """Deep-copying a ``torch.jit.script``-ed module makes its parameters non-leaf clones,
    which the pre-flight's optimizer refused ("can't optimize a non-leaf Tensor") though the
    ranks, which never copy a layer, train it fine."""
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    assert _run(_spec([scripted, nn.Linear(4, 2)])) == []


class StepCounter(nn.Module):
    """Warms up over its first calls with a Python counter: state the runtime cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(h) * min(1.0, self.calls / 10)


class CachedTable(nn.Module):
    """A cache built on the first call (as rotary tables often are): the same output again."""

    def __init__(self) -> None:
        super().__init__()
        self.table: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0.5, 1.5, h.shape[1], dtype=h.dtype)
        return h * self.table


def test_a_layer_with_state_of_its_own_is_refused() -> None:
    """A step counter in a Python attribute advances by the microbatches each rank runs (and
    again under recompute): replicas parted from one process (train-check: 4e-2) instead of
    being refused. Buffers, caches and dropout are not such state."""
    with pytest.raises(ValidationError, match=r"\['layers'\]: item 1 \(StepCounter\) returns "
                                              r"another output when run again"):
        _run(_spec([nn.Linear(4, 4), StepCounter(), nn.Linear(4, 2)]))
    fine = [nn.Linear(4, 4), CachedTable(), nn.Dropout(0.3), nn.BatchNorm1d(4),
            nn.utils.parametrizations.spectral_norm(nn.Linear(4, 2))]
    assert _run(_spec(fine)) == []


def test_train_check_exits_2_before_any_rank_starts(tmp_path: Path) -> None:
    (tmp_path / "userjobs_preflight.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn

        def job():
            x, y = torch.randn(12, 4), torch.randn(12, 2)
            return {"layers": [nn.Linear(4, 3), nn.Linear(3, 2)],
                    "loss": lambda o, t: nn.functional.mse_loss(o, t, reduction="none"),
                    "optimizer": lambda p: torch.optim.SGD(p, lr=0.1),
                    "dataset": torch.utils.data.TensorDataset(x, y), "global_batch": 6}
    '''))
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--job", "userjobs_preflight:job",
         "--ranks", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "['loss']" in res.stderr and "one number" in res.stderr
    assert "Traceback" not in res.stderr and "plan v1" not in res.stdout


def test_an_optimizer_choosing_groups_by_identity_sees_the_jobs_own_parameters() -> None:
    """SGD with no weight decay for a sparse embedding, chosen with ``p is emb.weight``: the
    ranks and the reference hand the factory the job's parameters, so preflight must too
    (on copies, the embedding fell into the weight-decay group and the job was refused:
    'add(sparse, dense) is not supported')."""
    gen = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 20, (12, 4), generator=gen), torch.randn(12, 2, generator=gen)
    emb = nn.Embedding(20, 8, sparse=True)

    def optimizer(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": [p for p in ps if p is emb.weight], "weight_decay": 0.0},
                                {"params": [p for p in ps if p is not emb.weight],
                                 "weight_decay": 1e-3}], lr=0.1)

    spec = _spec([emb, nn.Flatten(), nn.Linear(32, 2)],
                 dataset=torch.utils.data.TensorDataset(ids, y))
    spec["optimizer"] = optimizer
    assert _run(spec) == []


class _GaussHead(nn.Module):
    """A probabilistic head: the last layer returns a distribution the loss scores."""

    def __init__(self, counting: bool = False) -> None:
        super().__init__()
        self.fc, self.counting, self.calls = nn.Linear(4, 4), counting, 0

    def forward(self, h: torch.Tensor) -> torch.distributions.Normal:
        self.calls += 1
        mu, s = self.fc(h).chunk(2, 1)
        scale = F.softplus(s) + 1e-3 + (self.calls if self.counting else 0)
        return torch.distributions.Normal(mu, scale)


def _nll(d: torch.distributions.Normal, y: torch.Tensor) -> torch.Tensor:
    return -d.log_prob(y).mean()


def test_a_distribution_is_compared_by_its_values_when_the_layer_runs_twice() -> None:
    """Two equal Normal objects are not ``==`` (identity): the run-twice probe refused a
    deterministic head as keeping state of its own. It still refuses one that does."""
    assert _run(_spec([nn.Linear(4, 4), _GaussHead()], loss=_nll)) == []
    with pytest.raises(ValidationError, match=r"item 1 \(_GaussHead\) returns another output"):
        _run(_spec([nn.Linear(4, 4), _GaussHead(counting=True)], loss=_nll))


def test_a_loss_keeping_a_step_counter_is_refused_and_a_sampling_one_passes() -> None:
    """A KL-annealing counter in the loss's closure: each group's last stage would advance
    its own copy; train-check failed naming a weight, with no word on why."""
    calls = [0]

    def annealed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return F.mse_loss(out, y) + min(1.0, calls[0] / 10) * out.pow(2).mean()

    with pytest.raises(ValidationError, match=r"\['loss'\]: returns another value"):
        _run(_spec([nn.Linear(4, 2)], loss=annealed))

    def sampled(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the probe replays draws
        keep = torch.rand(out.shape[0]) < 0.9
        return F.mse_loss(out[keep], y[keep]) if keep.any() else out.sum() * 0

    _run(_spec([nn.Linear(4, 2)], loss=sampled))


def test_a_loss_reading_earlier_layers_weights_is_refused_and_the_heads_are_fine() -> None:
    """An L2 penalty in the loss's closure: only the last stage runs the loss, so the
    penalty on layer 0's weight would land on a copy no optimizer steps (train-check
    failed naming the weight, with no word on why). The head's own weight is fine."""
    first, head = nn.Linear(4, 4), nn.Linear(4, 2)

    def penalised(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y) + 1e-2 * (first.weight.pow(2).sum() + head.weight.pow(2).sum())

    with pytest.raises(ValidationError, match=r"\['loss'\]: reads parameter 'weight' of "
                                              r"layers item 0 directly"):
        _run(_spec([first, nn.Tanh(), head], loss=penalised))

    def head_only(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y) + 1e-2 * head.weight.pow(2).sum()

    _run(_spec([first, nn.Tanh(), head], loss=head_only))


class _HeadByList(nn.Module):
    """A head tied to the embedding through a Python list (so ``parameters()`` does not
    list the weight twice): a tie the ranks cannot see."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self._emb = [emb]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._emb[0].weight)


def test_a_tie_through_a_python_list_is_refused_and_a_registered_one_passes() -> None:
    ids = torch.randint(0, 7, (12, 3), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(ids, ids)

    def lm(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    emb = nn.Embedding(7, 4)
    with pytest.raises(ValidationError, match=r"item 2 \(_HeadByList\) reaches parameters of "
                                              r"item 0 through the Python attribute '_emb'"):
        _run(_spec([emb, nn.Linear(4, 4), _HeadByList(emb)], loss=lm, dataset=data))
    head = nn.Linear(4, 7, bias=False)
    head.weight = emb.weight  # registered: a tie the ranks keep
    _run(_spec([emb, nn.Linear(4, 4), head], loss=lm, dataset=data))


def test_a_scheduler_stepped_from_a_hook_is_refused_and_one_in_the_state_dict_passes() -> None:
    """LambdaLR stepped from an optimizer hook counts its steps outside the state_dict: a
    layer's optimizer moved to another rank restarts the schedule (train-check failed at
    9e-3 after a move, naming a weight). The parameters of the probe's third step agree;
    the next step's lr does not."""

    def hooked(params: Any) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(params, lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
        opt.register_step_post_hook(lambda o, a, k: sched.step())
        return opt

    spec = _spec([nn.Linear(4, 2)])
    spec["optimizer"] = hooked
    with pytest.raises(ValidationError, match=r"\['optimizer'\]: SGD's state_dict "
                                              r"\['param_groups'\]\[0\]\['lr'\] parts"):
        _run(spec)

    class Scheduled:  # the scheduler's state in the state_dict, param_groups left stale
        def __init__(self, params: Any) -> None:
            self.opt = torch.optim.SGD(params, lr=0.1)
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 0.9 ** s)
            self.param_groups, self.state = self.opt.param_groups, self.opt.state

        def step(self, closure: Any = None) -> None:
            self.opt.step()
            self.sched.step()

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.opt.zero_grad(set_to_none)

        def state_dict(self) -> dict[str, Any]:
            return {"opt": self.opt.state_dict(), "sched": self.sched.state_dict()}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.opt.load_state_dict(sd["opt"])
            self.sched.load_state_dict(sd["sched"])

    spec["optimizer"] = Scheduled
    _run(spec)


class _RunningMean(nn.Module):
    """A running mean kept in a frozen Parameter, updated in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


def test_a_forward_writing_a_frozen_parameter_is_named_as_such() -> None:
    """The run-twice probe restored buffers only, so the written parameter made the second
    output differ first, and the refusal spoke of a Python attribute or a generator."""
    with pytest.raises(ValidationError, match=r"item 0 \(_RunningMean\) writes into its "
                                              r"parameter 'mean'"):
        _run(_spec([_RunningMean(), nn.Linear(4, 2)]))
