"""Tiny jobs for the trainer's tests, one per thing real models need of the layers.

Each isolates one case (an integer input, a parameter-free first layer, a tied parameter,
BatchNorm buffers, frozen parameters under weight decay, layers that write into their
input, dropout, sparse gradients, attention with the user's own checkpointing, parameters
no sample uses, buffers a forward reads after updating them, one module at two places,
parameter groups, a quantizer's buffers, a frozen teacher) so that a failing test names
the mechanism. What crosses between stages (pytrees, dataclasses, complex tensors, skip
connections) is :mod:`hetpilot.trainer.testing.activation_jobs`'. They live in the package
because spawned ranks import them by module name (``hetpilot.trainer.testing.jobs:bn_tiny``).
The realistic models are in :mod:`hetpilot.trainer.examples`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "attention_tiny",
    "augment_tiny",
    "bn_tiny",
    "bnbias_tiny",
    "buffers_tiny",
    "dropout_tiny",
    "drowsy_tiny",
    "frozen_tiny",
    "groups_tiny",
    "inplace_tiny",
    "mobile_tiny",
    "nonpersistent_tiny",
    "norm_first",
    "owngen_tiny",
    "reused_tiny",
    "rrelu_tiny",
    "sparse_tiny",
    "specnorm_tiny",
    "teacher_tiny",
    "tied_tiny",
    "unused_tiny",
    "weighted_tiny",
]


def _job(layers: list[Any], x: torch.Tensor, y: torch.Tensor, loss: Any,
         batch: int = 12, optimizer: Any = None) -> dict[str, Any]:
    return {
        "layers": layers,
        "sample": x[:3],
        "loss": loss,
        "optimizer": optimizer or (lambda params: torch.optim.Adam(params, lr=0.02)),
        "dataset": torch.utils.data.TensorDataset(x, y),
        "global_batch": batch,
    }


class Standardize(nn.Module):
    """No parameters: a first stage of only this must still run (nothing to backpropagate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=1, keepdim=True)) / (x.std(dim=1, keepdim=True) + 1e-5)


def norm_first() -> dict[str, Any]:
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 5, generator=gen), torch.randn(48, 2, generator=gen)
    layers = [Standardize(), nn.Sequential(nn.Linear(5, 6), nn.Tanh()), nn.Linear(6, 2)]
    return _job(layers, x, y, nn.functional.mse_loss)


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)


class Head(nn.Module):
    """Logits with the embedding's weight (tied by identity, as GPT-2 does)."""

    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.weight = embed.tok.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def tied_tiny() -> dict[str, Any]:
    """Integer token ids in, embedding and head tied, two layers in between."""
    torch.manual_seed(2)
    vocab, d = 11, 6
    embed = Embed(vocab, d)
    layers = [embed, nn.Sequential(nn.Linear(d, d), nn.Tanh()), nn.LayerNorm(d),
              nn.Sequential(nn.Linear(d, d), nn.Tanh()), Head(embed)]
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (48, 5), generator=gen)
    return _job(layers, ids, torch.roll(ids, -1, dims=1), _lm_loss)


def bn_tiny() -> dict[str, Any]:
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, 4, generator=gen) * 3 + 1
    y = torch.randint(0, 3, (48,), generator=gen)
    # no bias before BatchNorm (as in ResNets); bnbias_tiny has one
    layers = [nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU()),
              nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8, momentum=None),
                            nn.ReLU()),
              nn.Linear(8, 3)]
    return _job(layers, x, y, nn.functional.cross_entropy, batch=24)  # BatchNorm: m >= 2


def bnbias_tiny() -> dict[str, Any]:
    """A bias right before BatchNorm under Adam, as users write it: that bias's gradient is
    zero in exact arithmetic, so it is rounding noise that Adam scales up; train-check must
    tell that from a wrong gradient (its noise floor) instead of failing the run."""
    torch.manual_seed(4)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(96, 4, generator=gen)
    y = torch.randn(96, 2, generator=gen)
    layers = [nn.Sequential(nn.Linear(4 if i == 0 else 16, 16), nn.BatchNorm1d(16), nn.ReLU())
              for i in range(3)] + [nn.Linear(16, 2)]
    return _job(layers, x, y, nn.functional.mse_loss, batch=24,
                optimizer=lambda params: torch.optim.Adam(params, lr=0.01))


class Shifted(nn.Module):
    """A trainable Linear plus a frozen offset vector (``requires_grad=False``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.offset = nn.Parameter(torch.randn(d), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h) + self.offset)


def frozen_tiny() -> dict[str, Any]:
    """Fine-tuning: a frozen embedding tied to the head, a frozen parameter beside trainable
    ones, and AdamW with weight decay over every parameter (as ``model.parameters()``
    gives them): a frozen parameter must get no gradient, or the decay would move it."""
    torch.manual_seed(4)
    vocab, d = 11, 6
    embed = Embed(vocab, d)
    embed.tok.weight.requires_grad_(False)
    layers = [embed, Shifted(d), Shifted(d), Head(embed)]
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, vocab, (48, 5), generator=gen)
    return _job(layers, ids, torch.roll(ids, -1, dims=1), _lm_loss,
                optimizer=lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.1))


def inplace_tiny() -> dict[str, Any]:
    """A flattened VGG-style list: ``ReLU(inplace=True)`` as layers of their own, so that
    cuts put one first in a stage (its input an autograd leaf), or after layers that
    return views of that leaf (``Unflatten``, ``Flatten``), and recompute checkpoints it
    alone (its saved input is what it overwrites)."""
    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(48, 6, generator=gen), torch.randn(48, 2, generator=gen)
    layers = [nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Unflatten(1, (2, 4)),
              nn.Flatten(), nn.ReLU(inplace=True), nn.Linear(8, 2)]
    return _job(layers, x, y, nn.functional.mse_loss)


class NoisyBlock(nn.Module):
    """Functional dropout inside a module (as attention dropout is), beside a Linear."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(nn.functional.dropout(self.lin(h), 0.3, self.training))


def dropout_tiny() -> dict[str, Any]:
    """Random draws in the forward: ``nn.Dropout`` as a layer, inside a layer, and
    functional. The trainer seeds each stage's forward of each microbatch from the data
    position (``pipeline.microbatch_seed``), so one process taking the same steps draws
    the same masks, whichever rank ran what before."""
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(48, 6, generator=gen), torch.randn(48, 2, generator=gen)
    layers = [nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2)), NoisyBlock(8), nn.Dropout(0.1),
              NoisyBlock(8), nn.Linear(8, 2)]
    return _job(layers, x, y, nn.functional.mse_loss)


def sparse_tiny() -> dict[str, Any]:
    """``nn.Embedding(sparse=True)``: its gradient arrives as a sparse tensor, which the
    gradient sync sums into its dense buffer."""
    torch.manual_seed(7)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 20, (48, 4), generator=gen)
    y = torch.randn(48, 2, generator=gen)
    layers = [nn.Embedding(20, 8, sparse=True), nn.Flatten(), nn.Linear(32, 8), nn.Tanh(),
              nn.Linear(8, 2)]
    return _job(layers, ids, y, nn.functional.mse_loss,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05))


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` with a residual and LayerNorm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out, _ = self.mha(h, h, h, need_weights=False)
        return self.ln(h + out)


class OwnCheckpoint(nn.Module):
    """A layer that checkpoints itself (reentrant), as some user models do."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def _inner(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.utils.checkpoint.checkpoint(self._inner, h, use_reentrant=True)
        assert isinstance(out, torch.Tensor)
        return out


def attention_tiny() -> dict[str, Any]:
    """Sequences through attention blocks and a self-checkpointing layer, under AdamW."""
    torch.manual_seed(8)
    gen = torch.Generator().manual_seed(8)
    x, y = torch.randn(24, 5, 8, generator=gen), torch.randn(24, 5, 8, generator=gen)
    layers = [nn.Linear(8, 8), SelfAttention(8), OwnCheckpoint(8), nn.GELU(), SelfAttention(8),
              nn.Linear(8, 8)]
    return _job(layers, x, y, nn.functional.mse_loss,
                optimizer=lambda params: torch.optim.AdamW(params, lr=0.01))


class Routed(nn.Module):
    """Two experts; each microbatch takes the one its first input feature picks, so the
    samples of one group may never reach the other expert."""

    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(d_in, d), nn.Linear(d_in, d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.experts[0 if float(x[:, 0].mean()) > 0 else 1](x))


class Spare(nn.Module):
    """A Linear beside one its forward never calls (a head left over from pre-training)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.spare = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


def unused_tiny() -> dict[str, Any]:
    """Parameters without a gradient: a spare Linear no sample uses, and routed experts
    some groups' samples never reach, under AdamW with weight decay. In one process
    their ``.grad`` is None and the step leaves them alone; the gradient sync must not
    hand them zeros, which the decay (and momentum) would move."""
    torch.manual_seed(9)
    gen = torch.Generator().manual_seed(9)
    x, y = torch.randn(48, 5, generator=gen), torch.randn(48, 2, generator=gen)
    layers = [Routed(5, 8), Spare(8), nn.Linear(8, 2)]
    return _job(layers, x, y, nn.functional.mse_loss,
                optimizer=lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.1))


def specnorm_tiny() -> dict[str, Any]:
    """``spectral_norm``: each forward updates the power-iteration vectors (buffers) and
    computes its weight from them, so a recomputation must start from the vectors its
    forward saw, not from what later forwards left there."""
    torch.manual_seed(10)
    gen = torch.Generator().manual_seed(10)
    x, y = torch.randn(48, 5, generator=gen), torch.randn(48, 2, generator=gen)
    sn = nn.utils.parametrizations.spectral_norm
    layers = [sn(nn.Linear(5, 8)), nn.Tanh(), sn(nn.Linear(8, 8)), nn.Linear(8, 2)]
    return _job(layers, x, y, nn.functional.mse_loss)


def reused_tiny() -> dict[str, Any]:
    """One module at two places of ``layers`` (a weight-shared block applied twice): its
    parameters are ties between the two layers, wherever the cuts put them."""
    torch.manual_seed(11)
    gen = torch.Generator().manual_seed(11)
    x, y = torch.randn(48, 5, generator=gen), torch.randn(48, 2, generator=gen)
    shared = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    layers = [nn.Linear(5, 8), shared, nn.LayerNorm(8), shared, nn.Linear(8, 2)]
    return _job(layers, x, y, nn.functional.mse_loss)


def groups_tiny() -> dict[str, Any]:
    """The usual parameter groups: no weight decay on 1-d parameters (a LayerNorm layer of
    its own leaves the decayed group empty), and a higher learning rate for the head, picked
    by identity (``p is head.weight``), as one process over ``model.parameters()`` does. The
    factory closes over the job's own modules: train-check's reference must use them too."""
    torch.manual_seed(12)
    gen = torch.Generator().manual_seed(12)
    x, y = torch.randn(48, 5, generator=gen), torch.randn(48, 2, generator=gen)
    head = nn.Linear(8, 2)
    layers = [nn.Linear(5, 8), nn.Tanh(), nn.LayerNorm(8), head]

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        mine = {id(p) for p in head.parameters()}
        groups = [{"params": [p for p in params if id(p) in mine], "lr": 0.05},
                  {"params": [p for p in params if id(p) not in mine and p.ndim > 1],
                   "weight_decay": 0.1},
                  {"params": [p for p in params if id(p) not in mine and p.ndim <= 1],
                   "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=0.01)

    return _job(layers, x, y, nn.functional.mse_loss, optimizer=optimizer)


def rrelu_tiny() -> dict[str, Any]:
    """``nn.RReLU`` draws a random slope per negative input and saves the slopes' tensor
    before filling it: a recomputation stopped early (torch's default) left the backward
    uninitialized memory; each layer must be recomputed to its end."""
    torch.manual_seed(13)
    gen = torch.Generator().manual_seed(13)
    x, y = torch.randn(48, 5, generator=gen), torch.randn(48, 2, generator=gen)
    layers = [nn.Linear(5, 8), nn.RReLU(), nn.Linear(8, 8), nn.RReLU(0.1, 0.3), nn.Linear(8, 2)]
    return _job(layers, x, y, nn.functional.mse_loss)


class RunningCentre(nn.Module):
    """Centres its input on a running mean kept in a non-persistent buffer (not in the
    ``state_dict``), which the forward updates and reads."""

    centre: torch.Tensor

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("centre", torch.zeros(d), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.centre.mul_(0.9).add_(0.1 * h.mean(0))
        return torch.tanh(self.lin(h - self.centre))


def nonpersistent_tiny() -> dict[str, Any]:
    """A buffer ``register_buffer(..., persistent=False)`` that the forward updates: a layer
    moving to another rank must take it along although ``state_dict`` leaves it out."""
    torch.manual_seed(14)
    gen = torch.Generator().manual_seed(14)
    x, y = torch.randn(48, 5, generator=gen), torch.randn(48, 2, generator=gen)
    layers = [nn.Linear(5, 8), RunningCentre(8), RunningCentre(8), nn.Linear(8, 2)]
    return _job(layers, x, y, nn.functional.mse_loss)


def weighted_tiny() -> dict[str, Any]:
    """A loss module holding float32 class weights (``nn.CrossEntropyLoss(weight=w)``) and a
    ``torch.jit.script``-ed layer: the loss module is cast with the layers (float64 here),
    and the scripted layer runs (not checkpointed) in recompute stages."""
    torch.manual_seed(15)
    gen = torch.Generator().manual_seed(15)
    x, y = torch.randn(48, 5, generator=gen), torch.randint(0, 3, (48,), generator=gen)
    layers = [nn.Linear(5, 8), torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh())),
              nn.Linear(8, 3)]
    return _job(layers, x, y, nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5])))


class JointFlip(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Pairs ``(x, x @ w)`` where ``__getitem__`` negates both halves at random, from
    torch's and Python's global generators (a joint augmentation of an input and its
    target, as a segmentation mask is flipped with its image)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(16)
        self.x = torch.randn(48, 5, generator=gen)
        self.y = self.x @ torch.randn(5, 2, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        import random

        sign = -1.0 if torch.rand(()) < 0.5 else 1.0
        shift = random.random()
        return sign * self.x[i] + shift, sign * self.y[i]


def augment_tiny() -> dict[str, Any]:
    """A dataset augmenting at random in ``__getitem__``, input and target together: the
    first stage reads the inputs, the last the targets, on other ranks, and the pair must
    still belong together (each item is read under generators seeded per item)."""
    torch.manual_seed(16)
    layers = [nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)]
    return {"layers": layers, "loss": nn.functional.mse_loss,
            "optimizer": lambda params: torch.optim.Adam(params, lr=0.02),
            "dataset": JointFlip(), "global_batch": 12}


class _RandomSign:
    """A transform holding its own ``torch.Generator``, as augmentation objects do."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(17)

    def __call__(self) -> float:
        return -1.0 if float(torch.rand((), generator=self.gen)) < 0.5 else 1.0


class OwnGenerators(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Like :class:`JointFlip`, but drawing from generators the dataset holds: a numpy
    ``Generator`` attribute (``np.random.default_rng``) and a transform's
    ``torch.Generator``, not the global ones."""

    def __init__(self) -> None:
        import numpy as np

        gen = torch.Generator().manual_seed(17)
        self.x = torch.randn(48, 5, generator=gen)
        self.y = self.x @ torch.randn(5, 2, generator=gen)
        self.rng = np.random.default_rng(17)
        self.transforms = [_RandomSign()]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        sign = self.transforms[0]()
        shift = float(self.rng.random())
        return sign * self.x[i] + shift, sign * self.y[i]


def owngen_tiny() -> dict[str, Any]:
    """:func:`augment_tiny` with the dataset's own generators, reached through a ``Subset``."""
    torch.manual_seed(17)
    layers = [nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)]
    return {"layers": layers, "loss": nn.functional.mse_loss,
            "optimizer": lambda params: torch.optim.Adam(params, lr=0.02),
            "dataset": torch.utils.data.Subset(OwnGenerators(), range(48)), "global_batch": 12}


class CausalMix(nn.Module):
    """A causal mask kept as a buffer, ``-inf`` above the diagonal (``inf - inf`` made
    it NaN when replicas' buffers were reconciled)."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.fc = nn.Linear(t, t)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.fc(x)[:, None, :] + self.mask
        return (scores.softmax(-1) * x[:, None, :]).sum(-1)


class FakeQuantized(nn.Module):
    """Quantization-aware training: an observer whose ``min_val``/``max_val`` start at
    ``+-inf`` and an integer ``zero_point`` that falls, which is no counter."""

    def __init__(self, d: int) -> None:
        super().__init__()
        from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

        self.fc = nn.Linear(d, d)
        self.fq = FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0,
                               quant_max=255, dtype=torch.quint8,
                               qscheme=torch.per_tensor_affine, averaging_constant=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fq(torch.relu(self.fc(x)))


def buffers_tiny() -> dict[str, Any]:
    """Buffers that are not running statistics, across replicas (the replica rule)."""
    torch.manual_seed(21)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(48, 5, generator=gen) * 2 + 1
    y = torch.randn(48, 5, generator=gen)
    return _job([CausalMix(5), FakeQuantized(5), nn.Linear(5, 5)], x, y,
                nn.functional.mse_loss)


class Teacher(nn.Module):
    """A frozen layer (distillation): its output rides along with the input."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return x, self.net(x)


class Student(nn.Module):
    def __init__(self, d_in: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, 3)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(t[0]), t[1]


class Widen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.fc(t[0])), t[1]


def _distill_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out[0], target) + nn.functional.mse_loss(out[0], out[1])


def teacher_tiny() -> dict[str, Any]:
    """A layer of only frozen parameters and the usual factory filtering them out: it was
    handed the teacher's parameters alone and raised on the empty list."""
    torch.manual_seed(25)
    gen = torch.Generator().manual_seed(25)
    x, y = torch.randn(48, 6, generator=gen), torch.randint(0, 3, (48,), generator=gen)
    return _job([Teacher(), Widen(), Student(6)], x, y, _distill_loss, optimizer=lambda params:
                torch.optim.Adam([p for p in params if p.requires_grad], lr=0.01))


def mobile_tiny() -> dict[str, Any]:
    """A MobileNet-style stack (depthwise and pointwise convolutions, BatchNorm, an
    InstanceNorm after a 1x1 conv) under momentum SGD: bfloat16 itself moves the first
    conv about 55% and the mean loss up to 36% away from float32 in one process (the model's
    sensitivity), above the 0.1 the ranks are allowed against float32 before train-check
    discounted one process's own drift, the loss's included."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 3, 8, 8, generator=gen), torch.randint(0, 4, (24,), generator=gen)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
              nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8),
              nn.Hardswish(), nn.Conv2d(8, 12, 1), nn.InstanceNorm2d(12, affine=True),
              nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(12, 4)]
    return _job(layers, x, y, nn.functional.cross_entropy, optimizer=lambda params:
                torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=4e-5))


class Drowsy(nn.Module):
    """A linear layer on two unequal devices, one of which slows down after Attach.

    Rank 1 sleeps ``steady_s`` in every forward, Attach's measurement included: its device
    is the slower one when the job starts, so the first plans put the work on rank 0. Rank
    0 sleeps ``sleep_s`` in each forward once the process has called forward on it (or a
    copy) ``after`` times: its device slows down after the job measured its layers, as
    another job arriving on it would make it, and becomes the slower one by far.

    Why these figures: Attach calls forward 9 times (the profile, the layer timing, the
    preflight), so with ``after`` 12 the slowdown starts in the trainer's first slot, which
    the calibration does not count. With two equal devices (and 40), a busy machine's
    measurements decided where the first plans put the work: a plan on rank 1 alone left
    rank 0 nothing to slow down in, in 3 runs of 6. ``sleep_s`` is 16 ms: with 4 ms, a CI
    machine whose two cores were busy while the ranks timed their layers measured them so
    slowly that rank 0's stage ran only 2.8x its measurement."""

    calls = 0

    def __init__(self, width: int, after: int = 12, sleep_s: float = 0.016,
                 steady_s: float = 0.002) -> None:
        super().__init__()
        self.fc, self.after = nn.Linear(width, width), after
        self.sleep_s, self.steady_s = sleep_s, steady_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Drowsy.calls += 1
        rank = dist.get_rank() if dist.is_initialized() else None
        if rank == 1:
            time.sleep(self.steady_s)
        elif rank == 0 and Drowsy.calls > self.after:
            time.sleep(self.sleep_s)
        return torch.tanh(self.fc(x))


def drowsy_tiny() -> dict[str, Any]:
    """Rank 0's device, the faster at Attach, slows down well past rank 1's after it
    (:class:`Drowsy`): the stage timings disagree with the layer times it measured, and
    the trainer corrects them (:mod:`hetpilot.trainer.calibration`)."""
    torch.manual_seed(26)
    gen = torch.Generator().manual_seed(26)
    x, y = torch.randn(64, 8, generator=gen), torch.randn(64, 2, generator=gen)
    layers = [nn.Linear(8, 16), nn.Tanh(), Drowsy(16), nn.Linear(16, 2)]
    job = _job(layers, x, y, nn.functional.mse_loss, batch=16)
    del job["sample"]  # as most users' jobs: the trainer takes one from the dataset
    return job
