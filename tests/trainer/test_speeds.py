"""Layer times measured on the job's device (hetpilot.trainer.speeds), on the CPU."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from hetpilot.trainer.speeds import (
    as_measurement,
    dtype_label,
    emulated_layer_times,
    measure_layer_times,
)
from torch import nn

pytestmark = pytest.mark.timeout(60)


class Block(nn.Module):
    """A residual MLP block on a tensor or on (tensor, mask); counts forward calls over
    all its instances and their copies."""

    calls = 0

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Any) -> Any:
        Block.calls += 1
        if isinstance(x, tuple):
            return self(x[0]), x[1]
        return x + torch.relu(self.fc(x))


class Pair(nn.Module):
    """A layer whose input is a dict with integer ids and whose output is a tuple."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        Pair.calls += 1
        h = self.embed(batch["ids"]).mean(dim=1)
        return h, batch["mask"]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 3)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = pair
        return self.fc(h) * mask[:, :1]


def test_identical_layers_are_timed_once_and_the_job_is_untouched() -> None:
    torch.manual_seed(0)
    blocks = [Block() for _ in range(3)]
    layers: list[Any] = [Pair(), *blocks, Block, Head()]  # a factory (the class) too
    sample = {"ids": torch.randint(0, 10, (3, 5)), "mask": torch.ones(3, 2)}
    before = [p.detach().clone() for p in blocks[0].parameters()]
    Block.calls = Pair.calls = 0
    times = measure_layer_times(layers, sample, 8, device="cpu", repeats=3, warmup=1)
    assert len(times) == len(layers)
    # one class each: warmup + repeats runs (a Block on a tuple calls itself once more)
    assert Block.calls == 2 * 4 and Pair.calls == 4
    assert all(f > 0 for f, _ in times) and all(b > 0 for _, b in times[1:])
    assert len({times[i] for i in range(1, 5)}) == 1  # the four blocks share their timing
    # the job's modules keep their parameters and get no gradients
    assert all(p.grad is None for b in blocks for p in b.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, blocks[0].parameters(), strict=True))
    # a block with another input shape (after a different layer) is another class
    Block.calls = 0
    times = measure_layer_times([nn.Linear(4, 32), Block(), nn.Linear(32, 64), Block(64),
                                 lambda: Block(64)], torch.randn(2, 4), 4, device="cpu",
                                repeats=2, warmup=0)
    assert Block.calls == 4 and times[3] == times[4] != times[1]


class Slow(nn.Module):
    """A layer of about 5 ms a forward that counts its calls."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Slow.calls += 1
        time.sleep(0.005)
        return x * 2


def test_warm_up_lasts_warmup_s_before_the_timed_runs() -> None:
    Slow.calls = 0
    measure_layer_times([Slow()], torch.randn(2, 4), 2, device="cpu", repeats=2, warmup=1)
    assert Slow.calls == 3  # the CPU default: no time-based warm-up
    Slow.calls = 0
    measure_layer_times([Slow()], torch.randn(2, 4), 2, device="cpu", repeats=2, warmup=1,
                        warmup_s=0.1)
    # at least 0.1 s of 5-ms warm-up runs (sleep never returns early), then the 2 timed
    assert 0.1 / 0.005 * 0.5 <= Slow.calls - 2 <= 0.1 / 0.005 + 1
    with pytest.raises(ValueError, match="warmup_s"):
        measure_layer_times([Slow()], torch.randn(2, 4), 2, device="cpu", warmup_s=-1.0)


def test_a_layer_keeping_its_input_structure_is_timed_chained() -> None:
    """chain=4: a residual block runs 4 times in a row on its own output (after a first
    run that shows it can), its times per application; a layer that changes the
    structure, and the first layer, run once per run."""
    Block.calls = 0
    layers: list[Any] = [nn.Linear(8, 32), Block(), nn.Linear(32, 3)]
    times = measure_layer_times(layers, torch.randn(2, 8), 4, device="cpu", repeats=3,
                                warmup=1, chain=4)
    assert Block.calls == 1 + 3 * 4  # the first (warm-up) run alone, then 3 timed chains
    assert len(times) == 3 and all(f > 0 and b > 0 for f, b in times[1:])
    Block.calls = 0
    measure_layer_times(layers, torch.randn(2, 8), 4, device="cpu", repeats=3, warmup=0,
                        chain=4)
    assert Block.calls == 1 + 2 * 4  # the first run is timed alone, the next two chained
    # a chained run's time is per application: a 5-ms layer stays about 5 ms, not 20
    Slow.calls = 0
    slow = measure_layer_times([nn.Linear(4, 4), Slow()], torch.randn(2, 4), 2,
                               device="cpu", repeats=2, warmup=1, chain=4)
    assert Slow.calls == 1 + 2 * 4 and 0.004 <= slow[1][0] < 0.012
    with pytest.raises(ValueError, match="chain"):
        measure_layer_times(layers, torch.randn(2, 8), 4, device="cpu", chain=0)


def test_microbatch_size_autocast_and_the_daemon_form() -> None:
    model = [nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)]
    small = measure_layer_times(model, torch.randn(2, 64), 2, device="cpu", repeats=3)
    large = measure_layer_times(model, torch.randn(2, 64), 512, device="cpu", repeats=3)
    assert sum(f + b for f, b in large) > sum(f + b for f, b in small)  # samples repeated
    bf16 = measure_layer_times(model, torch.randn(2, 64), 16, device="cpu",
                               autocast_dtype=torch.bfloat16, repeats=2)
    assert all(f > 0 and b > 0 for f, b in bf16)
    assert dtype_label(torch.bfloat16) == "bfloat16" and dtype_label(None) == "float32"
    m = as_measurement(bf16, 16, dtype_label(torch.bfloat16))
    assert m["microbatch"] == 16 and m["dtype"] == "bfloat16"
    assert sorted(m["layers"]) == [0, 1, 2] and m["layers"][2] == bf16[2]
    # emulated devices report the times target-time emulation gives: m * gflop / (1000 T)
    assert emulated_layer_times([2.0, 4.0], [4.0, 8.0], 8, 4.0) == [(0.004, 0.008),
                                                                    (0.008, 0.016)]
    with pytest.raises(ValueError, match="microbatch"):
        measure_layer_times(model, torch.randn(2, 64), 0, device="cpu")


def test_layers_writing_into_their_input_are_profiled_and_timed() -> None:
    """ReLU(inplace=True) as a layer of its own: the profile and the job's own timing (what
    ``hetpilot train`` sends on Attach) give each layer its input behind a copy, as the
    runtime's stages do, instead of failing on an in-place write into an autograd leaf."""
    from hetpilot.trainer.profile import profile_model
    from hetpilot.trainer.testing.jobs import inplace_tiny

    job = inplace_tiny()
    layers = job["layers"]
    prof = profile_model(layers, job["sample"], name="inplace")
    relus = [la for la in prof["layers"] if "ReLU" in la["name"]]
    assert len(relus) == 2 and all(la["fwd_gflop"] == 0.0 for la in relus)
    assert all(la["act_mb"] > 0 for la in relus)  # ReLU keeps its output for the backward
    times = measure_layer_times(layers, job["sample"], 4, device="cpu", repeats=2)
    assert len(times) == len(layers) and all(f > 0 and b >= 0 for f, b in times)


class _SlowLoss(nn.Module):
    """A loss with a class-weight buffer (moved to the device as the runtime moves it) whose
    forward and backward each take at least 20 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(4))

    def forward(self, y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.02)
        return _SlowBackward.apply(nn.functional.cross_entropy(y, target, weight=self.weight))


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.02)
        return g


def test_the_loss_is_timed_on_the_last_layer() -> None:
    """The last stage runs the loss: its forward and backward count in the last layer's
    times, on targets cut or repeated to the microbatch; the other layers' do not change."""
    model = [nn.Linear(8, 16), nn.Linear(16, 4)]
    targets = torch.tensor([0, 3])  # 2 samples, repeated to 6
    plain = measure_layer_times(model, torch.randn(2, 8), 6, device="cpu", repeats=3)
    with_loss = measure_layer_times(model, torch.randn(2, 8), 6, device="cpu", repeats=3,
                                    loss=(_SlowLoss(), targets))
    assert with_loss[-1][0] >= 0.02 > plain[-1][0]
    assert with_loss[-1][1] >= 0.02 > plain[-1][1]
    assert with_loss[0][0] < 0.02 and with_loss[0][1] < 0.02


def test_a_loss_module_is_timed_on_a_copy() -> None:
    """Timing calls the loss several times: a loss module keeping state (a counter here)
    is left as the job has it, and stays on its device."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return nn.functional.mse_loss(y, target)

    loss = Counting()
    measure_layer_times([nn.Linear(4, 3)], torch.randn(2, 4), 4, device="cpu",
                        loss=(loss, torch.randn(2, 3)))
    assert int(loss.calls) == 0
