"""The profiler on real models: pytree activations, integer inputs, copies of the user's
modules, attention FLOPs on CPU, tied parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hetpilot.planner.serde import model_from_dict
from hetpilot.trainer.profile import _instantiate, layer_times, profile_model
from hetpilot.trainer.speeds import measure_layer_times
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count


class TupleToDict(nn.Module):
    def forward(self, value: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]) -> dict:
        out, (h, _c) = value
        return {"seq": out, "last": h[-1], "tag": "meta"}


class DictHead(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden, 3)

    def forward(self, value: dict) -> torch.Tensor:
        assert value["tag"] == "meta"
        return self.fc(torch.cat([value["seq"].mean(1), value["last"]], dim=-1))


def test_lstm_tuple_and_dict_activations() -> None:
    m, s, hidden = 4, 5, 8
    layers = [nn.Embedding(10, 6), nn.LSTM(6, hidden, batch_first=True), TupleToDict(),
              DictHead(hidden)]
    ids = torch.randint(0, 10, (m, s))
    model = profile_model(layers, ids, name="lstm")
    parsed = model_from_dict(model)
    emb, rnn, summary, head = model["layers"]
    assert len(parsed.layers) == 4
    # (out, (h, c)): every tensor leaf counts
    assert rnn["out_mb"] == pytest.approx((s * hidden + 2 * hidden) * 4 / 1e6)
    assert summary["out_mb"] == pytest.approx((s * hidden + hidden) * 4 / 1e6)
    assert emb["out_mb"] == pytest.approx(s * 6 * 4 / 1e6)
    assert emb["fwd_gflop"] == 0.0  # a lookup
    assert rnn["fwd_gflop"] > 0 and rnn["bwd_gflop"] > 0  # oneDNN LSTM counted
    assert head["fwd_gflop"] == pytest.approx(2 * 2 * hidden * 3 / 1e9)
    # weight and input gradients: the dict's leaves needed gradients
    assert head["bwd_gflop"] == pytest.approx(2 * head["fwd_gflop"])
    assert summary["bwd_gflop"] == 0.0 and summary["param_mb"] == 0.0


def test_lstm_flops_match_the_decomposed_float64_path() -> None:
    """oneDNN runs float32 LSTMs as one op; float64 decomposes into counted matmuls."""
    torch.manual_seed(0)
    rnn = nn.LSTM(6, 8, batch_first=True, num_layers=2, bidirectional=True)
    lin = nn.Linear(6, 6)  # so the LSTM's input needs a gradient
    x = torch.randn(3, 5, 6)
    f32 = profile_model([lin, rnn], x)["layers"][1]
    f64 = profile_model([lin.double(), rnn.double()], x.double())["layers"][1]
    assert f32["fwd_gflop"] == pytest.approx(f64["fwd_gflop"])
    assert f32["bwd_gflop"] == pytest.approx(f64["bwd_gflop"], rel=0.1)


def test_parameter_free_first_layer_on_raw_input() -> None:
    layers = [nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 4)]
    model = profile_model(layers, torch.randn(2, 8))
    first, second = model["layers"]
    assert first["bwd_gflop"] == 0.0
    # nothing before the Linear needs a gradient: weight gradient only
    assert second["bwd_gflop"] == pytest.approx(2 * 8 * 4 / 1e9)


def test_pytree_sample_and_non_tensor_leaves() -> None:
    class Add(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, value: dict) -> tuple[torch.Tensor, int]:
            return self.lin(value["a"]) + value["b"] * value["k"], 3

    class Take(nn.Module):
        def forward(self, value: tuple[torch.Tensor, int]) -> torch.Tensor:
            return value[0] * value[1]

    sample = {"a": torch.randn(5, 4), "b": torch.randn(5, 4), "k": 2.0}
    model = profile_model([Add(), Take()], sample)
    assert model["layers"][0]["out_mb"] == pytest.approx(4 * 4 / 1e6)
    assert model["layers"][1]["bwd_gflop"] == 0.0


def test_profiling_leaves_the_users_modules_alone() -> None:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
              nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 2))]
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    sample = torch.randn(3, 3, 8, 8)
    kept = sample.clone()
    profile_model(layers, sample)
    layer_times(layers, sample, repeats=2)
    bn = layers[0][1]
    assert isinstance(bn, nn.BatchNorm2d)
    assert int(bn.num_batches_tracked) == 0
    assert torch.equal(bn.running_mean, torch.zeros(4))
    for layer, state in zip(layers, before, strict=True):
        for k, v in layer.state_dict().items():
            assert torch.equal(v, state[k]), k
        assert all(p.grad is None for p in layer.parameters())
    assert torch.equal(sample, kept)


class Causal(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = x.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q * 2, q * 3, is_causal=True)


def test_cpu_attention_flops() -> None:
    m, s, heads, d_head = 2, 32, 4, 8
    layers = [nn.Linear(heads * d_head, heads * d_head), Causal(heads)]
    model = profile_model(layers, torch.randn(m, s, heads * d_head))
    att = model["layers"][1]
    per_sample_fwd = 4 * heads * s * s * d_head  # QK^T and AV
    assert att["fwd_gflop"] == pytest.approx(per_sample_fwd / 1e9, rel=0.01)
    shape = (m, heads, s, d_head)
    assert att["fwd_gflop"] == pytest.approx(sdpa_flop_count(shape, shape, shape) / m / 1e9)
    assert att["bwd_gflop"] == pytest.approx(
        sdpa_backward_flop_count(shape, shape, shape, shape) / m / 1e9)
    assert att["bwd_gflop"] == pytest.approx(2.5 * att["fwd_gflop"])


def test_tied_parameter_counts_on_each_holder_and_stays_tied_in_the_copy() -> None:
    emb = nn.Embedding(16, 8)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight)

    head = Head()
    copies = _instantiate([emb, head])
    assert copies[1].weight is copies[0].weight and copies[0].weight is not emb.weight
    model = profile_model([emb, head], torch.randint(0, 16, (4, 3)))
    first, second = model["layers"]
    assert first["param_mb"] == second["param_mb"] == pytest.approx(16 * 8 * 4 / 1e6)
    assert emb.weight.grad is None
    # the head's weight is a parameter of its layer: not counted as a saved activation
    assert second["act_mb"] == pytest.approx(3 * 8 * 4 / 1e6)


def test_factories_are_called() -> None:
    calls = []

    def build() -> nn.Module:
        calls.append(1)
        return nn.Linear(3, 3)

    model = profile_model([build, build], torch.randn(2, 3))
    assert len(calls) == 2 and len(model["layers"]) == 2
    times = layer_times([build, nn.Tanh()], torch.randn(2, 3), repeats=2)
    assert len(times) == 2 and all(f >= 0 and b >= 0 for f, b in times)


@dataclasses.dataclass
class _Gated:  # never registered as a pytree node by the test: the profiler must
    h: torch.Tensor
    gate: torch.Tensor


class _Produce(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(5, 8)

    def forward(self, x: torch.Tensor) -> _Gated:
        return _Gated(torch.tanh(self.a(x)), torch.sigmoid(self.b(x)))


class _Consume(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, v: _Gated) -> torch.Tensor:
        return self.fc(v.h * v.gate)


def test_a_dataclass_activation_is_profiled_and_timed_through() -> None:
    """A layer returning a plain dataclass: its tensors are leaves, as in the runtime. As
    one opaque leaf the profile gave the layer no output bytes and no backward, and timing
    the next layer's backward ran into the first layer's freed graph (a user's job)."""
    x = torch.randn(4, 5)
    prof = profile_model([_Produce(), _Consume()], x, name="gated")
    first = prof["layers"][0]
    assert first["out_mb"] == pytest.approx(2 * 8 * 4 / 1e6) and first["bwd_gflop"] > 0
    times = measure_layer_times([_Produce(), _Consume()], x, 4, device="cpu",
                                loss=(F.mse_loss, torch.randn(4, 2)))
    assert len(times) == 2 and all(f > 0 and b > 0 for f, b in times)


class _GradPenalty(nn.Module):
    """A layer that differentiates inside its forward (an input-gradient penalty)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 12)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x if x.requires_grad else x.detach().requires_grad_()
        h = self.fc(x)
        gx, = torch.autograd.grad(h.sum(), x, create_graph=True)
        return torch.tanh(h), (gx.norm(dim=1) - 1).pow(2)


def test_a_layer_calling_autograd_grad_in_its_forward_is_profiled() -> None:
    """The FLOP counter's per-module hooks made such a layer raise ("A leaf node was
    passed to _will_engine_execute_node ..."); it trains, so it must profile."""
    x = torch.randn(4, 6)
    prof = profile_model([_GradPenalty(), _Pair()], x, name="penalty")
    assert prof["layers"][0]["fwd_gflop"] >= 2 * 6 * 12 / 1e9  # per sample: the linear
    assert prof["layers"][0]["bwd_gflop"] > 0


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 1)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(t[0]).squeeze(-1) + t[1]
