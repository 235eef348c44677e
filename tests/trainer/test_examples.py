"""The example jobs: they train in one process, are deterministic, and profile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hetpilot.planner.serde import model_from_dict
from hetpilot.trainer import examples
from hetpilot.trainer.profile import profile_model
from torch import nn

JOBS: dict[str, Callable[[], dict[str, Any]]] = {
    "gpt": examples.gpt, "resnet": examples.resnet, "lstm": examples.lstm,
}


def _chain(layers: list[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def _unique_params(layers: list[nn.Module]) -> list[nn.Parameter]:
    return list({id(p): p for layer in layers for p in layer.parameters()}.values())


@pytest.mark.parametrize("name", sorted(JOBS))
def test_example_trains_in_one_process(name: str) -> None:
    spec = JOBS[name]()
    layers = list(spec["layers"])
    assert all(isinstance(layer, nn.Module) for layer in layers)
    params = _unique_params(layers)
    assert 1_000 <= sum(p.numel() for p in params) <= 100_000
    opt = spec["optimizer"](params)
    batch = spec["global_batch"]
    x, y = spec["dataset"][:batch]
    losses = []
    for _ in range(8):  # the same batch: the loss must fall
        loss = spec["loss"](_chain(layers, x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    ex, ey = spec["eval_dataset"][:8]
    for layer in layers:
        layer.eval()
    with torch.no_grad():
        metric = spec["metric"](_chain(layers, ex), ey)
    assert 0.0 <= metric <= 1.0
    assert spec["sample"].shape[0] >= 1
    assert len(spec["dataset"]) % batch == 0


@pytest.mark.parametrize("name", sorted(JOBS))
def test_example_is_deterministic(name: str) -> None:
    torch.manual_seed(123)
    outside = torch.rand(1)
    a, b = JOBS[name](), JOBS[name]()
    torch.manual_seed(123)
    JOBS[name]()
    assert torch.equal(torch.rand(1), outside)  # the caller's random state is left alone
    for la, lb in zip(a["layers"], b["layers"], strict=True):
        sa, sb = la.state_dict(), lb.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for key in ("dataset", "eval_dataset"):
        for ta, tb in zip(a[key].tensors, b[key].tensors, strict=True):
            assert torch.equal(ta, tb)
    assert torch.equal(a["sample"], b["sample"])


def test_gpt_head_is_tied_to_the_token_embedding() -> None:
    spec = examples.gpt()
    layers = spec["layers"]
    emb, head = layers[0], layers[-1]
    assert isinstance(emb, examples.Embedding) and isinstance(head, examples.LMHead)
    assert head.weight is emb.tok.weight
    assert sum(isinstance(layer, examples.Block) for layer in layers) >= 2
    ids = spec["sample"]
    assert ids.dtype == torch.long
    logits = _chain(layers, ids)
    assert logits.shape == (*ids.shape, emb.tok.num_embeddings)
    x, y = spec["dataset"][:2]
    assert torch.equal(x[:, 1:], y[:, :-1])  # target: the input shifted by one


def test_gpt_attention_is_causal() -> None:
    spec = examples.gpt()
    layers = spec["layers"]
    ids = spec["sample"].clone()
    before = _chain(layers, ids)
    ids[:, -1] = (ids[:, -1] + 1) % layers[0].tok.num_embeddings
    after = _chain(layers, ids)
    assert torch.allclose(before[:, :-1], after[:, :-1], atol=1e-6)
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_resnet_has_batchnorm_and_lstm_passes_pytrees() -> None:
    resnet = examples.resnet()["layers"]
    holders = [i for i, layer in enumerate(resnet)
               if any(isinstance(m, nn.BatchNorm2d) for m in layer.modules())]
    assert holders == [0, 1, 2, 3]
    spec = examples.lstm()
    layers = spec["layers"]
    out = layers[1](layers[0](spec["sample"]))
    assert isinstance(out, tuple) and isinstance(out[1], tuple)
    summary = layers[2](out)
    assert isinstance(summary, dict) and set(summary) == {"seq", "last"}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_example_profiles(name: str) -> None:
    spec = JOBS[name]()
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in spec["layers"]]
    model = profile_model(spec["layers"], spec["sample"], name=name)
    parsed = model_from_dict(model)
    assert len(parsed.layers) == len(spec["layers"])
    for layer, state in zip(spec["layers"], before, strict=True):  # untouched by profiling
        assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())
        assert all(p.grad is None for p in layer.parameters())
    rows = model["layers"]
    assert all(r["out_mb"] > 0 and r["param_mb"] >= 0 for r in rows)
    if name == "gpt":
        blocks = [r for r in rows if r["name"].endswith(":Block")]
        assert blocks and all(r["fwd_gflop"] > 0 and r["bwd_gflop"] > 0 for r in blocks)
        assert rows[0]["param_mb"] > 0 and rows[-1]["param_mb"] > 0  # the tied weight, twice
        emb = spec["layers"][0].tok
        assert rows[-1]["param_mb"] == pytest.approx(emb.weight.numel() * 4 / 1e6)
    elif name == "resnet":
        assert all(r["fwd_gflop"] > 0 for r in rows)
    else:
        m = spec["sample"].shape[0]
        emb, rnn, summary, _head = spec["layers"]
        with torch.no_grad():
            out = rnn(emb(spec["sample"]))
            leaves = [out[0], *out[1]]
            assert rows[1]["out_mb"] == pytest.approx(
                sum(t.numel() * t.element_size() for t in leaves) / m / 1e6)
            value = summary(out)
            assert rows[2]["out_mb"] == pytest.approx(
                sum(t.numel() * t.element_size() for t in value.values()) / m / 1e6)
        assert rows[1]["fwd_gflop"] > 0
        assert rows[1]["act_mb"] > 0
