"""Tiny jobs for the trainer's tests of what crosses between stages.

Each isolates one form of activation: tuple and dict activations with non-tensor leaves,
packed sequences, a dataclass, complex spectra, a causal decoder's mask, layers filling
the dict they were given. Spawned ranks import them by module name
(``hetpilot.trainer.testing.activation_jobs:pytree_tiny``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .jobs import _job

__all__ = [
    "dataclass_tiny",
    "decoder_tiny",
    "dictskip_tiny",
    "misweighted_decoder_tiny",
    "packed_tiny",
    "pytree_tiny",
    "spectral_tiny",
]


class Split(nn.Module):
    """Returns a tuple holding a nested tuple, an integer tensor and a plain number."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Any:
        counts = (x > 0).sum(dim=1)  # int64, crosses the cut as an integer
        return self.a(x).tanh(), (self.b(x), counts), 0.5


class Merge(nn.Module):
    """Takes Split's tuple, returns a dict (one leaf is never used downstream)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(9, 5)

    def forward(self, value: Any) -> dict[str, Any]:
        h, (g, counts), scale = value
        out = self.lin(torch.cat([h, g], dim=1)) * scale + counts.unsqueeze(1).to(h.dtype) * 0.1
        return {"h": out.tanh(), "unused": g * 2, "tag": "merged"}


class Out(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 2)

    def forward(self, value: dict[str, Any]) -> torch.Tensor:
        assert value["tag"] == "merged"
        return self.lin(value["h"])


def pytree_tiny() -> dict[str, Any]:
    torch.manual_seed(4)
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(48, 4, generator=gen), torch.randn(48, 2, generator=gen)
    layers = [Split(), Merge(), nn.Identity(), Out()]
    return _job(layers, x, y, nn.functional.mse_loss)


class Pack(nn.Module):
    """Sequences to the ``PackedSequence`` an RNN takes (lengths 3 to 5, read from each
    sample's first step)."""

    def forward(self, x: torch.Tensor) -> Any:
        lengths = 3 + (x[:, 0, 0] > 0).long() + (x[:, 0, 1] > 0).long()
        return nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                 enforce_sorted=False)


class LastHidden(nn.Module):
    """An RNN's (packed output, last hidden state) to the last layer's hidden state."""

    def forward(self, out: Any) -> torch.Tensor:
        return out[1][-1]


def packed_tiny() -> dict[str, Any]:
    """A ``PackedSequence`` (a namedtuple of data, batch sizes and sort indices; its
    constructor refuses ``None`` data) crossing cuts into and out of a bidirectional GRU."""
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(48, 5, 3, generator=gen), torch.randn(48, 4, generator=gen)
    return _job([Pack(), nn.GRU(3, 4, batch_first=True, bidirectional=True), LastHidden()],
                x, y, nn.functional.mse_loss)


@dataclass
class Hidden:
    """A layer output as HuggingFace-style models return them: a dataclass, not registered
    with torch's pytree."""

    h: torch.Tensor
    gate: torch.Tensor


class ProduceHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 8)

    def forward(self, x: torch.Tensor) -> Hidden:
        return Hidden(torch.tanh(self.a(x)), torch.sigmoid(x.sum(dim=1, keepdim=True)))


class RelayHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(8, 8)

    def forward(self, v: Hidden) -> Hidden:
        return Hidden(torch.tanh(self.b(v.h)) * v.gate, v.gate)


class ConsumeHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, v: Hidden) -> torch.Tensor:
        return self.fc(v.h)


def dataclass_tiny() -> dict[str, Any]:
    """Layers passing a dataclass across cuts: its tensors must carry their gradients back
    (unregistered, it crossed as one pickled leaf and the layers before the cut stopped
    learning)."""
    torch.manual_seed(18)
    gen = torch.Generator().manual_seed(18)
    x, y = torch.randn(48, 5, generator=gen), torch.randn(48, 2, generator=gen)
    return _job([ProduceHidden(), RelayHidden(), ConsumeHidden()], x, y,
                nn.functional.mse_loss)


class ToSpectrum(nn.Module):
    """FNO-style: the layer's output is complex (``torch.fft.rfft``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(self.lin(x), dim=1)


class SpectralMix(nn.Module):
    """Weights as real pairs and as a complex parameter, and a complex running mean of the
    spectrum that the forward updates (a complex buffer of replicas: merged by the
    floating rule). Casting the model to float64 kept them complex only since
    ``precision.cast_floating``: ``Module.to(dtype=)`` made them real."""

    running: torch.Tensor

    def __init__(self, modes: int, channels: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(modes, channels, 2) * 0.3)
        self.c = nn.Parameter(torch.ones(modes, channels, dtype=torch.complex64))
        self.register_buffer("running", torch.zeros(modes, channels, dtype=torch.complex64))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if not self.c.is_complex():
            raise TypeError(f"the complex parameter was cast to {self.c.dtype}")
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * z.mean(0))
        return (z - self.running) * torch.view_as_complex(self.w) * self.c


class FromSpectrum(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.out = nn.Linear(4, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(torch.fft.irfft(z, n=self.n, dim=1)).squeeze(-1)


def spectral_tiny() -> dict[str, Any]:
    """Complex activations crossing cuts (their gradients go back; a receiver that took
    only floating leaves as needing one hung the sender until gloo's timeout), a complex
    parameter and a complex buffer (:class:`SpectralMix`)."""
    torch.manual_seed(19)
    gen = torch.Generator().manual_seed(19)
    x = torch.randn(48, 8, 2, generator=gen)
    y = torch.roll(x[..., 0], 1, 1) + 0.5 * x[..., 1]
    return _job([ToSpectrum(), SpectralMix(5, 4), FromSpectrum(8)], x, y,
                nn.functional.mse_loss)


class DecoderIn(nn.Module):
    """Target and memory sequences, as a tuple."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.tgt, self.mem = nn.Linear(4, d), nn.Linear(4, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tgt(x), self.mem(x.flip(1))


class CausalDecoder(nn.Module):
    """``nn.TransformerDecoderLayer`` with a causal mask built in the forward; the memory
    rides along."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.dec = nn.TransformerDecoderLayer(d, 2, dim_feedforward=16, dropout=0.1,
                                              batch_first=True)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mem = x
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1], dtype=h.dtype)
        return self.dec(h, mem, tgt_mask=mask, tgt_is_causal=True), mem


class DecoderOut(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.out = nn.Linear(d, 2)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.out(x[0])


def _decoder_job(loss: Any) -> dict[str, Any]:
    torch.manual_seed(9)
    gen = torch.Generator().manual_seed(9)
    x, y = torch.randn(48, 5, 4, generator=gen), torch.randn(48, 5, 2, generator=gen)
    return _job([DecoderIn(8), CausalDecoder(8), CausalDecoder(8), DecoderOut(8)], x, y, loss)


def decoder_tiny() -> dict[str, Any]:
    """Causal decoder layers under Adam: the attention's key biases have zero exact
    gradients, and their rounding noise, which Adam turns into full steps, put a layer 0.75
    of its change from one process in bfloat16 (above the 0.5 tolerance) while that
    process computed on 2 threads; on one, as the ranks, nothing differs."""
    return _decoder_job(nn.functional.mse_loss)


def _misweighted_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    wrong = 3.0 if dist.is_initialized() and dist.get_rank() == 1 else 1.0
    return wrong * nn.functional.mse_loss(out, target)


def misweighted_decoder_tiny() -> dict[str, Any]:
    """:func:`decoder_tiny` whose loss is 3x too heavy on rank 1 (the one-process
    reference is not distributed, so it is right): what a runtime weighting one rank's
    gradients wrong does. train-check must fail it, noise floors or not."""
    return _decoder_job(_misweighted_mse)


class StoreSkip(nn.Module):
    """Writes its skip into the dict it was given and returns that dict (diffusers-style
    UNet blocks): recompute had rerun it on the dict its forward had filled."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.i, self.fc = i, nn.Linear(4, 4)

    def forward(self, d: Any) -> dict[str, torch.Tensor]:
        if not isinstance(d, dict):
            d = {"x": d}
        d[f"skip{self.i}"] = d["x"]
        d["x"] = torch.tanh(self.fc(d["x"]))
        return d


class JoinSkips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(d["x"] + d["skip0"] + d["skip1"])


def dictskip_tiny() -> dict[str, Any]:
    torch.manual_seed(23)
    gen = torch.Generator().manual_seed(23)
    x, y = torch.randn(48, 4, generator=gen), torch.randn(48, 2, generator=gen)
    return _job([StoreSkip(0), StoreSkip(1), StoreSkip(2), JoinSkips()], x, y,
                nn.functional.mse_loss)
