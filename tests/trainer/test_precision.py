"""Mixed precision: the dtype rules, float16's loss scaler agreed by every rank, memory in the
profile following the dtype, and train-check's two comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.precision import precision_for
from hetpilot.trainer.testing.ranks import _scaler_run
from hetpilot.trainer.traincheck import MIXED_TOLERANCE, SAME_PRECISION_TOLERANCE, run_check


def test_dtype_names_mean_a_cast_or_mixed_precision() -> None:
    assert precision_for(None).param_dtype is None and not precision_for(None).mixed
    plain = precision_for(torch.float64)
    assert (plain.param_dtype, plain.compute_dtype) == (torch.float64, None)
    for low in (torch.bfloat16, torch.float16):
        mixed = precision_for(low)
        assert (mixed.param_dtype, mixed.compute_dtype) == (torch.float32, low)
        assert mixed.wire(torch.ones(2)).dtype == low
        assert mixed.wire(torch.ones(2, dtype=torch.long)).dtype == torch.long
    assert precision_for(torch.float16).scaled and not precision_for(torch.bfloat16).scaled
    with pytest.raises(ValueError, match="floating"):
        precision_for(torch.int32)


def test_loss_scaler_skips_on_every_rank_when_one_overflows(tmp_path: Path) -> None:
    spawn(_scaler_run, 2, (str(tmp_path),), timeout_s=60)
    runs = [json.loads((tmp_path / f"scaler{r}.json").read_text()) for r in range(2)]
    assert runs[0]["seen"] == runs[1]["seen"]  # the same decisions and scales everywhere
    # step 0 clean; step 1 overflow on rank 1 only -> skip, halve; 2 clean steps -> double
    assert runs[0]["seen"] == [[True, 1024.0], [False, 512.0], [True, 512.0], [True, 1024.0]]
    assert runs[0]["skipped"] == 1
    assert runs[0]["unscaled"][0] == [8.0 / 1024.0] * 3  # a taken step unscales in place
    assert runs[0]["unscaled"][1] == [8.0] * 3  # a skipped one leaves the gradient alone


def test_profile_memory_follows_the_dtype() -> None:
    from hetpilot.trainer.examples import gpt
    from hetpilot.trainer.profile import profile_model

    spec = gpt()
    full = profile_model(spec["layers"], spec["sample"])
    half = profile_model(spec["layers"], spec["sample"], dtype=torch.bfloat16)
    double = profile_model(spec["layers"], spec["sample"], dtype=torch.float64)
    for f, h, d in zip(full["layers"], half["layers"], double["layers"], strict=True):
        assert h["param_mb"] == pytest.approx(f["param_mb"])  # float32 master weights
        assert d["param_mb"] == pytest.approx(2 * f["param_mb"])
        assert h["out_mb"] == pytest.approx(f["out_mb"] / 2)  # what crosses a cut
        assert h["act_mb"] <= f["act_mb"]  # the embedding saves its integer ids either way
        assert h["fwd_gflop"] == pytest.approx(f["fwd_gflop"])
    assert sum(h["act_mb"] for h in half["layers"]) < 0.7 * sum(f["act_mb"] for f in full["layers"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_train_check_mixed_precision_on_a_tied_gpt(dtype: str) -> None:
    worst = run_check(2, job="hetpilot.trainer.examples:gpt", dtype=dtype, log=lambda _: None)
    same, f32 = worst[f"{dtype} in one process"], worst["float32 in one process"]
    assert same.value <= SAME_PRECISION_TOLERANCE, same.where
    assert f32.value <= MIXED_TOLERANCE[dtype], f32.where
    assert f32.value > 1e-6  # it did compute in the low dtype


@pytest.mark.timeout(150)
def test_bfloat16_ranks_equal_one_process_computing_on_one_thread() -> None:
    """decoder_tiny (causal TransformerDecoderLayer, Adam): its key biases' rounding noise,
    which Adam turns into full steps, had put it 0.75 from one process in bfloat16 (above
    0.5) when the reference computed on the machine's 2 threads; on one, as the ranks,
    every kernel sums in the same order and nothing differs."""
    lines: list[str] = []
    worst = run_check(2, job="hetpilot.trainer.testing.activation_jobs:decoder_tiny", dtype="bfloat16",
                      log=lines.append)
    assert worst["bfloat16 in one process"].value == 0.0, "\n".join(lines)
    assert 0.0 < worst["float32 in one process"].value <= MIXED_TOLERANCE["bfloat16"]


@pytest.mark.timeout(150)
def test_a_models_own_sensitivity_to_bfloat16_is_not_the_runtimes_error() -> None:
    """mobile_tiny: one process in bfloat16 is itself ~55% from float32 at the first conv
    and up to 36% in the mean loss, above the ranks' 0.1 against float32; the second pass
    counts only beyond that drift, tensor by tensor and in the loss."""
    lines: list[str] = []
    worst = run_check(2, job="hetpilot.trainer.testing.jobs:mobile_tiny", dtype="bfloat16",
                      log=lines.append)
    assert any(line.startswith("above the tolerance") for line in lines), "\n".join(lines)
    f32 = worst["float32 in one process"]
    assert f32.beyond_noise and f32.value <= MIXED_TOLERANCE["bfloat16"], "\n".join(lines)
    assert worst["bfloat16 in one process"].value <= SAME_PRECISION_TOLERANCE


@pytest.mark.timeout(150)
def test_a_misweighted_rank_still_fails_beyond_the_bfloat16_noise_floor() -> None:
    """The same job with rank 1's loss 3x too heavy (1.2x fails too, by hand): far beyond
    the floors, in both comparisons."""
    worst = run_check(2, job="hetpilot.trainer.testing.activation_jobs:misweighted_decoder_tiny",
                      dtype="bfloat16", log=lambda _: None)
    assert worst["bfloat16 in one process"].value > 2 * SAME_PRECISION_TOLERANCE
    assert worst["float32 in one process"].value > MIXED_TOLERANCE["bfloat16"]


@pytest.mark.timeout(150)
def test_complex_parameters_are_compared_up_to_the_tolerance_in_bfloat16() -> None:
    """spectral_tiny (a complex parameter and buffer, complex activations across cuts):
    its complex tensors had been taken for integer ones, which must be equal, and failed
    the check with an infinite difference though the ranks trained as one process."""
    lines: list[str] = []
    worst = run_check(2, job="hetpilot.trainer.testing.activation_jobs:spectral_tiny", dtype="bfloat16",
                      log=lines.append)
    assert worst["bfloat16 in one process"].value <= SAME_PRECISION_TOLERANCE, "\n".join(lines)
    assert worst["float32 in one process"].value <= MIXED_TOLERANCE["bfloat16"], "\n".join(lines)


def test_a_difference_in_the_imaginary_part_is_seen() -> None:
    """``.double()`` of a complex tensor keeps its real part: a complex parameter whose
    imaginary part differed compared as equal in float64."""
    from hetpilot.trainer.statediff import _l2, _max_abs

    a, b = torch.tensor([1 + 1j, 2 + 0j]), torch.tensor([1 + 2j, 2 + 0j])
    assert _max_abs(a, b) == 1.0 and _l2(a, b) == 1.0
    assert _max_abs(a, a) == 0.0


@pytest.mark.timeout(150)
def test_float16_loss_scaling_takes_sparse_gradients() -> None:
    """sparse_tiny (``nn.Embedding(sparse=True)``): under a plan of one group its gradient
    stays sparse, and the overflow check (``isfinite``, which sparse tensors lack) crashed
    the rank; it now reads the values, as torch.amp.GradScaler does."""
    lines: list[str] = []
    worst = run_check(3, job="hetpilot.trainer.testing.jobs:sparse_tiny", dtype="float16",
                      log=lines.append)
    assert worst["float16 in one process"].value <= SAME_PRECISION_TOLERANCE, "\n".join(lines)
    assert worst["float32 in one process"].value <= MIXED_TOLERANCE["float16"], "\n".join(lines)


class _NoHalfOnCpu(torch.nn.Module):
    """Stands in for a layer torch's CPU has no float16 kernel for (an LSTM, RReLU): it
    raises torch's words for that under CPU float16 autocast, as those do here."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
            raise NotImplementedError('"lstm_cpu" not implemented for \'Half\'')
        return self.lin(x)


def test_a_cpu_lacking_a_float16_kernel_does_not_refuse_gpu_ranks() -> None:
    """The preflight runs on the CPU: `train-check --device cuda --dtype float16` refused the
    shipped LSTM job, which CUDA trains, because this CPU has no float16 LSTM. For ranks on
    a GPU it now runs again without autocast and says so; for CPU ranks it still refuses."""
    from hetpilot.planner.errors import ValidationError
    from hetpilot.trainer.preflight import preflight

    x, y = torch.randn(8, 4), torch.randn(8, 2)
    spec = {"layers": [_NoHalfOnCpu()], "loss": torch.nn.functional.mse_loss,
            "optimizer": lambda ps: torch.optim.SGD(ps, lr=0.1),
            "dataset": torch.utils.data.TensorDataset(x, y), "global_batch": 4}
    with pytest.raises(ValidationError, match="not implemented for 'Half'") as err:
        preflight(spec, "--job: nohalf()", 2, 0, torch.float32, torch.float16)
    assert "on CPU ranks use --dtype bfloat16" in str(err.value)  # what to do instead
    notes = preflight(spec, "--job: nohalf()", 2, 0, torch.float32, torch.float16,
                      ranks_on="cuda")
    assert notes[0].startswith("the preflight ran without float16 autocast, as this CPU has "
                               "no float16 kernel")
    assert notes[0].endswith("the ranks compute on cuda")
