"""A job's ``"model"``: checkpoints record each layer tensor's names in it, and
``hetpilot export --out`` writes those names (``hetpilot.trainer.modelnames``, ``.export``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hetpilot.planner.errors import ValidationError
from hetpilot.trainer import checkpoint as ckpt
from hetpilot.trainer.export import named_state_dict
from hetpilot.trainer.modelnames import layer_names, model_meta
from torch import nn


class Net(nn.Module):
    """A model whose head shares the embedding's weight, cut into two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def _layers(net: Net) -> list[nn.Module]:
    return [nn.Sequential(net.embed), nn.Sequential(net.norm, net.head)]


def test_names_are_the_models_by_identity_tied_under_both() -> None:
    net = Net()
    names = layer_names(net, _layers(net))
    assert names[0] == {"0.weight": ["embed.weight", "head.weight"]}
    assert names[1]["0.running_mean"] == ["norm.running_mean"]
    assert names[1]["1.weight"] == ["embed.weight", "head.weight"]
    assert model_meta({"layers": _layers(net)}) == {}
    assert "hf" not in model_meta({"layers": _layers(net), "model": net})["model"]


def test_a_tensor_outside_the_model_and_a_tensor_in_no_layer_are_refused() -> None:
    net = Net()
    with pytest.raises(ValidationError, match=r"^model: layers item 1 \(Linear\) holds "
                                              r"'weight', which is not a tensor of the model"):
        layer_names(net, [net.embed, nn.Linear(3, 3), net.norm])
    with pytest.raises(ValidationError, match=r"5 tensor\(s\) of the model are in no layer "
                                              r"\(norm.weight, norm.bias, norm.running_mean"):
        layer_names(net, [net.embed])
    with pytest.raises(ValidationError, match="item 0 is a factory"):
        layer_names(net, [lambda: net.embed, net.norm])


def test_export_writes_the_models_names(tmp_path: Path) -> None:
    """A checkpoint as the trainer writes it (the tie in its own file), with the names
    recorded: the exported state_dict loads strictly into the user's model."""
    net = Net()
    layers = _layers(net)
    meta = {"step": 1, "num_layers": 2, **model_meta({"layers": layers, "model": net})}
    ckpt.begin_save(tmp_path, 1)
    staging = ckpt.staging_dir(tmp_path, 1)
    with torch.no_grad():
        net.embed.weight.add_(1.0)
        net.norm.running_mean.fill_(0.5)
    ckpt.write_file(staging, ckpt.layer_file(0), {"module": {}, "optim": None})
    state1 = {k: v for k, v in layers[1].state_dict().items() if k != "1.weight"}
    ckpt.write_file(staging, ckpt.layer_file(1), {"module": state1, "optim": None})
    ckpt.write_file(staging, ckpt.tied_file(0), {"keys": ["0.0.weight", "1.1.weight"],
                                                 "param": net.embed.weight.detach(),
                                                 "optim": None})
    ckpt.commit(tmp_path, 1, meta)
    state = named_state_dict(tmp_path)
    assert set(state) == set(Net().state_dict())
    fresh = Net()
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh.head.weight, net.embed.weight)
    assert fresh.norm.running_mean.tolist() == [0.5] * 3
