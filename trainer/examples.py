"""Small models for ``hetpilot profile`` / ``hetpilot train`` examples and the checks.

A job spec is a zero-argument function returning a dict with ``layers`` (a
list of modules or factories), ``sample`` (one microbatch of inputs, for
``profile``), and for ``train`` also ``loss``, ``optimizer`` (a factory over
a parameter list), ``dataset`` and ``global_batch``; optionally
``eval_dataset`` and ``metric`` (``metric(output, target)``, a mean over the
microbatch) for the end-of-epoch evaluation.

Each job trains on a CPU in seconds and is deterministic: the data comes from
a seeded generator and the modules are built under a fixed seed (in a forked
RNG, so calling a job leaves the caller's random state alone); no dropout.

* :func:`mlp`: 6 tanh layers (factories), regression;
* :func:`gpt`: a GPT-style causal LM on ``torch.long`` token ids, 5 layers;
  the LM head (layer 4) and the token embedding (layer 0) share one weight;
* :func:`resnet`: a small ResNet with BatchNorm in layers 0-3, image
  classification, 5 layers;
* :func:`lstm`: an LSTM sequence classifier, 4 layers, whose activations
  after layer 1 (``nn.LSTM``'s ``(out, (h, c))``) and layer 2 (a dict) are
  pytrees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .traincheck import make_layers

__all__ = ["gpt", "lstm", "mlp", "resnet"]


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Build modules under ``seed`` without touching the caller's random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def accuracy(logits: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction of samples (or tokens) whose arg-max class is the target."""
    pred = logits.argmax(dim=-1)
    return float((pred == target).float().mean())


def _adamw(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    return make


def mlp() -> dict[str, Any]:
    """The train-check tanh MLP (6 layers) on 64 random regression samples, batch 16."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = torch.randn(64, 2, generator=gen)
    return {
        "layers": make_layers(6),
        "sample": x[:4],
        "loss": nn.functional.mse_loss,
        "optimizer": lambda params: torch.optim.Adam(params, lr=0.01),
        "dataset": torch.utils.data.TensorDataset(x, y),
        "global_batch": 16,
    }


# --- GPT ---------------------------------------------------------------------------------


class Embedding(nn.Module):
    """Token plus learned position embeddings: ids ``(b, s)`` -> ``(b, s, d)``."""

    def __init__(self, vocab: int, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(positions)


class Block(nn.Module):
    """Pre-LN transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v projections, whose head count
    follows from its input (``view(b, s, -1, head_dim)``), so it runs split by heads."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.head_dim = d_model // heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(att.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TPBlock(nn.Module):
    """Pre-LN transformer block (:class:`Block`'s computation) laid out as Megatron splits
    it: q/k/v and the MLP's up projection column-parallel, the attention's output and the
    MLP's down projection row-parallel (:data:`GPT_TP_PLAN`)."""

    def __init__(self, d_model: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


GPT_TP_PLAN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise",
               "attn.out": "rowwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
"""The ``tp_plan`` of :func:`gpt_tp`'s blocks (patterns relative to each layer)."""


class LMHead(nn.Module):
    """Logits ``(b, s, vocab)`` from the token embedding's own weight (tied, no bias)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight  # the same Parameter object: a tied weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _gpt_init(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _arithmetic_sequences(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """``n`` sequences ``(a + k t) mod vocab``, random start ``a`` and step ``k`` in 1..4:
    from the second token on, the next token is predictable."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    step = torch.randint(1, 5, (n, 1), generator=gen)
    return (start + step * torch.arange(length)) % vocab


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``(b, s, vocab)`` logits against ``(b, s)`` next tokens, mean over tokens."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def gpt(vocab: int = 64, seq_len: int = 16, d_model: int = 32, heads: int = 4,
        blocks: int = 2) -> dict[str, Any]:
    """A GPT-style causal LM (about 28k parameters with the defaults).

    Layers: ``[Embedding, Block x blocks, LayerNorm, LMHead]`` (5 with the
    defaults), given as modules; the head's weight *is* the token embedding's
    (layer 0 and the last layer hold one tied Parameter). Input: ``torch.long``
    ids ``(b, seq_len)``; target: the same sequence shifted by one token.
    Data: 256 training and 64 held-out arithmetic sequences mod ``vocab``;
    metric: next-token accuracy.
    """
    with _seeded(0):
        emb = Embedding(vocab, seq_len, d_model)
        body = [Block(d_model, heads) for _ in range(blocks)]
        norm = nn.LayerNorm(d_model)
        for module in (emb, *body):
            module.apply(_gpt_init)
        head = LMHead(emb.tok)
    train = _arithmetic_sequences(256, seq_len + 1, vocab, seed=1)
    held_out = _arithmetic_sequences(64, seq_len + 1, vocab, seed=2)
    return {
        "layers": [emb, *body, norm, head],
        "sample": train[:4, :-1],
        "loss": lm_loss,
        "optimizer": _adamw(1e-2),
        "dataset": torch.utils.data.TensorDataset(train[:, :-1], train[:, 1:]),
        "eval_dataset": torch.utils.data.TensorDataset(held_out[:, :-1], held_out[:, 1:]),
        "metric": accuracy,
        "global_batch": 32,
    }


def gpt_tp(vocab: int = 64, seq_len: int = 16, d_model: int = 32, heads: int = 4,
           blocks: int = 2) -> dict[str, Any]:
    """:func:`gpt` with :class:`TPBlock` blocks and a ``tp_plan``: the job whose plans may
    have tensor-parallel stages (degrees dividing ``heads``). The embedding, final norm and
    tied head match no pattern: a tensor-parallel stage runs them whole."""
    job = gpt(vocab, seq_len, d_model, heads, blocks)
    with _seeded(0):
        body = [TPBlock(d_model, heads) for _ in range(blocks)]
        for module in body:
            module.apply(_gpt_init)
    layers = job["layers"]
    return {**job, "layers": [layers[0], *body, *layers[-2:]], "tp_plan": dict(GPT_TP_PLAN)}


# --- ResNet ------------------------------------------------------------------------------


class Stem(nn.Module):
    """3x3 convolution, BatchNorm, ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv+BN, identity shortcut (1x1 conv+BN when the
    shape changes), ReLU after the sum."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class PoolHead(nn.Module):
    """Global average pool and a linear classifier."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def _prototype_images(n: int, prototypes: torch.Tensor, noise: float,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images: a random class's prototype plus Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, prototypes.shape[0], (n,), generator=gen)
    images = prototypes[labels] + noise * torch.randn(n, *prototypes.shape[1:], generator=gen)
    return images, labels


def resnet(classes: int = 10, size: int = 16, width: int = 16) -> dict[str, Any]:
    """A small ResNet with BatchNorm (about 39k parameters with the defaults).

    Layers: ``[Stem, BasicBlock(w, w), BasicBlock(w, 2w, stride 2),
    BasicBlock(2w, 2w), PoolHead]`` (5), given as modules; layers 0-3 hold
    BatchNorm2d (running statistics are buffers). Input: float images
    ``(b, 3, size, size)``; target: class ids. Data: 256 training and 64
    held-out images, each one of ``classes`` seeded random prototypes plus
    noise; loss: cross-entropy; metric: accuracy.
    """
    with _seeded(0):
        layers = [Stem(3, width), BasicBlock(width, width),
                  BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width),
                  PoolHead(2 * width, classes)]
    gen = torch.Generator().manual_seed(1)
    prototypes = torch.randn(classes, 3, size, size, generator=gen)
    x, y = _prototype_images(256, prototypes, noise=1.0, seed=2)
    x_eval, y_eval = _prototype_images(64, prototypes, noise=1.0, seed=3)
    return {
        "layers": layers,
        "sample": x[:4],
        "loss": F.cross_entropy,
        "optimizer": _adamw(3e-3),
        "dataset": torch.utils.data.TensorDataset(x, y),
        "eval_dataset": torch.utils.data.TensorDataset(x_eval, y_eval),
        "metric": accuracy,
        "global_batch": 32,
    }


# --- LSTM --------------------------------------------------------------------------------


class Summary(nn.Module):
    """``nn.LSTM``'s ``(out, (h, c))`` -> ``{"seq": out, "last": h[-1]}`` (the cell
    state is dropped: its gradient is zero)."""

    def forward(self, value: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
                ) -> dict[str, torch.Tensor]:
        out, (h, _c) = value
        return {"seq": out, "last": h[-1]}


class SequenceHead(nn.Module):
    """Logits from the mean of the output sequence and the last hidden state."""

    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, value: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat([value["seq"].mean(dim=1), value["last"]], dim=-1))


def _class_sequences(n: int, length: int, vocab: int, classes: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences whose class decides which band of the vocabulary most
    tokens come from (a quarter are uniform noise)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=gen)
    band = vocab // classes
    tokens = labels[:, None] * band + torch.randint(0, band, (n, length), generator=gen)
    noise = torch.randint(0, vocab, (n, length), generator=gen)
    mask = torch.rand(n, length, generator=gen) < 0.25
    return torch.where(mask, noise, tokens), labels


def lstm(vocab: int = 16, seq_len: int = 12, d_embed: int = 16, hidden: int = 32,
         classes: int = 4) -> dict[str, Any]:
    """An LSTM sequence classifier whose activations are pytrees (about 7k parameters).

    Layers: ``[nn.Embedding, nn.LSTM(batch_first=True), Summary, SequenceHead]``
    (4), given as modules. Layer 1 returns the tuple ``(out, (h, c))``, layer 2
    turns it into the dict ``{"seq": out, "last": h[-1]}``, so a cut after
    either moves a pytree. Input: ``torch.long`` ids ``(b, seq_len)``; target:
    class ids. Data: 256 training and 64 held-out sequences; loss:
    cross-entropy; metric: accuracy.
    """
    with _seeded(0):
        layers: list[nn.Module] = [nn.Embedding(vocab, d_embed),
                                   nn.LSTM(d_embed, hidden, batch_first=True),
                                   Summary(), SequenceHead(hidden, classes)]
    x, y = _class_sequences(256, seq_len, vocab, classes, seed=1)
    x_eval, y_eval = _class_sequences(64, seq_len, vocab, classes, seed=2)
    return {
        "layers": layers,
        "sample": x[:4],
        "loss": F.cross_entropy,
        "optimizer": _adamw(1e-2),
        "dataset": torch.utils.data.TensorDataset(x, y),
        "eval_dataset": torch.utils.data.TensorDataset(x_eval, y_eval),
        "metric": accuracy,
        "global_batch": 32,
    }
