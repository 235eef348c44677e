"""train-check: random plans on N real gloo ranks against one process taking the same steps.

Each tiny job isolates one thing real models need (issue 12's items 1-5):
integer inputs, a parameter-free first stage, a tied parameter, BatchNorm
buffers under recompute and across replicas, tuple and dict activations with
integer and non-tensor leaves. Every layer boundary is cut in some plan.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hetpilot.trainer.statediff import (
    MIXED_NOISE_FACTOR,
    NOISE_FACTOR,
    Difference,
    _compare,
    _perturb,
)
from hetpilot.trainer.traincheck import run_check
from torch import nn


def _check(job: str, ranks: int, seed: int = 0) -> list[str]:
    lines: list[str] = []
    worst = run_check(ranks, job=job, seed=seed, timeout_s=150, log=lines.append)
    assert worst["float64"].value <= 1e-9, "\n".join(lines)
    return lines


def _cuts(lines: list[str]) -> set[int]:
    """Layer boundaries cut by the plans train-check ran (from its plan summaries)."""
    return {int(a) for line in lines for a in re.findall(r"\[(\d+),\d+\)", line)} - {0}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_builtin_mlp_matches_one_process(ranks: int) -> None:
    lines = _check("hetpilot.trainer.examples:mlp", ranks, seed=ranks)
    text = "\n".join(lines)
    for schedule in ("gpipe", "1f1b", "custom"):
        assert schedule in text
    assert _cuts(lines) == set(range(1, 6))
    assert re.search(r"\)R", text), "no plan ran with recompute"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("job", "layers"),
    [
        ("norm_first", 3),  # item 5: a first stage of parameter-free layers
        ("tied_tiny", 5),  # items 1 and 3: integer ids, embedding tied to the head
        ("bn_tiny", 3),  # item 4: BatchNorm under recompute and across replicas
        ("pytree_tiny", 4),  # item 2: tuple/dict activations, int and non-tensor leaves
        ("frozen_tiny", 4),  # frozen parameters (one tied) under AdamW's weight decay
        ("inplace_tiny", 7),  # ReLU(inplace=True) layers first in a stage and recomputed
        ("dropout_tiny", 5),  # dropout: the same draws as one process, recompute included
        ("sparse_tiny", 5),  # a sparse embedding gradient summed into the dense sync buffer
        ("attention_tiny", 6),  # MultiheadAttention, a layer checkpointing itself, AdamW
        ("unused_tiny", 3),  # parameters no sample (or only some groups') uses, weight decay
        ("specnorm_tiny", 4),  # a forward reading buffers it updates, under recompute
        ("reused_tiny", 5),  # one module at two places in `layers`: its parameters tied
        ("groups_tiny", 4),  # parameter groups by ndim (one empty) and by identity
        ("rrelu_tiny", 5),  # RReLU's random slopes under recompute (no early stop)
        ("nonpersistent_tiny", 4),  # a non-persistent buffer the forward updates, moved
        ("weighted_tiny", 3),  # a loss module's float32 class weights; a scripted layer
        ("augment_tiny", 3),  # random augmentation of input and target in __getitem__
        ("owngen_tiny", 3),  # the same from generators the dataset (or its transform) holds
        ("dataclass_tiny", 3),  # a dataclass (not registered with pytree) across cuts
        ("spectral_tiny", 3),  # complex activations (rfft) across cuts
        ("buffers_tiny", 3),  # a -inf causal mask, a quantizer's +-inf observer and zero point
        ("dictskip_tiny", 4),  # layers storing skips in the dict they were given, recomputed
        ("teacher_tiny", 3),  # a layer of frozen parameters; the factory filters them out
        ("packed_tiny", 3),  # a PackedSequence (variable lengths) into and out of a GRU
    ],
)
def test_mechanisms_match_one_process(job: str, layers: int) -> None:
    from hetpilot.trainer.testing import activation_jobs

    module = "activation_jobs" if hasattr(activation_jobs, job) else "jobs"
    lines = _check(f"hetpilot.trainer.testing.{module}:{job}", 3)
    assert _cuts(lines) == set(range(1, layers)), "\n".join(lines)
    if job in ("inplace_tiny", "dropout_tiny", "specnorm_tiny", "rrelu_tiny", "weighted_tiny",
               "dictskip_tiny"):
        assert re.search(r"\)R", "\n".join(lines)), "no plan ran with recompute"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rounding_noise_of_a_bias_before_batchnorm_is_not_a_failure() -> None:
    """At 4 ranks the bias before BatchNorm differs by more than the tolerance (Adam scales
    the rounding noise of its zero gradient up), which failed the check before the noise
    floor; the floor names that bias and the run passes."""
    lines = _check("hetpilot.trainer.testing.jobs:bnbias_tiny", 4)
    plain = [float(m.group(1)) for line in lines
             if (m := re.search(r"max \|diff\| = (\S+) at", line))]
    assert max(plain) > 1e-9, "\n".join(lines)
    noise = [line for line in lines if line.strip().startswith("rounding noise:")]
    assert noise and any("'0.bias'" in line for line in noise), "\n".join(lines)


def test_noise_floor_discounts_only_what_the_perturbed_copies_drift() -> None:
    want = [{"w": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64),
             "n": torch.tensor(4)}]
    floors = [{"w": 1e-14, "b": 5e-10}]

    def diff(dw: float, db: float) -> Difference:
        held = [{0: {"w": want[0]["w"] + dw, "b": want[0]["b"] + db, "n": torch.tensor(4)}}]
        return _compare(held, want, None, ["L"], False, floors)

    wrong = diff(1e-6, 0.0)  # a tensor following its gradient: its floor changes nothing
    assert wrong.value == pytest.approx(1e-6, rel=1e-6) and "'w'" in wrong.where
    assert diff(0.0, 4e-9).value == 0.0  # within 10x the bias's floor: rounding noise
    beyond = diff(0.0, 1e-7)  # far beyond it: still a difference
    assert beyond.value == pytest.approx(1e-7 - NOISE_FACTOR * 5e-10) and "'b'" in beyond.where


def test_mixed_precision_discounts_noise_tensor_by_tensor() -> None:
    """Under mixed precision a floor discounts its own tensor only: a noisy bias does not
    hide an error in the weight beside it (the layer-wide error would)."""
    start = [{"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(1, dtype=torch.float64)}]
    want = [{"w": torch.ones(4, dtype=torch.float64), "b": torch.ones(1, dtype=torch.float64)}]
    floors = [{"w": 0.01, "b": 1.0}]  # the bias's copies drifted as far as it moved

    def diff(dw: float, db: float) -> float:
        held = [{0: {"w": want[0]["w"] + dw, "b": want[0]["b"] + db}}]
        return _compare(held, want, start, ["L"], True, floors, MIXED_NOISE_FACTOR).value

    assert diff(0.0, 1.5) == 0.0  # the bias's noise, within twice its floor
    assert diff(0.5, 1.5) == pytest.approx((1.0 - 2 * 0.01) / 5 ** 0.5)  # the weight's error
    assert _compare([{0: {"w": want[0]["w"], "b": want[0]["b"] + 1.5}}], want, start, ["L"],
                    True).value == pytest.approx(1.5 / 5 ** 0.5)  # without floors


def test_a_nan_difference_is_the_worst_wherever_it_comes() -> None:
    for order in ([1e-12, float("nan"), 1e-13], [float("nan"), 1e-3], [1e-3, float("nan")]):
        worst = Difference()
        for i, value in enumerate(order):
            worst.update(value, f"#{i}")
        assert math.isnan(worst.value), order
        assert worst.where == f"#{[str(v) for v in order].index('nan')}"


def test_equal_runs_name_a_layer_with_tensors_not_a_parameterless_one() -> None:
    """Mixed precision, every difference exactly 0: the line names a tensor that was
    compared, not "most in 'nothing'" of a ReLU (layer 0 here)."""
    w = {"weight": torch.ones(2, 2)}
    held = [{0: {}, 1: {k: v.clone() for k, v in w.items()}}]
    got = _compare(held, [{}, w], [{}, {"weight": torch.zeros(2, 2)}], ["ReLU", "Linear"],
                   mixed=True)
    assert got.value == 0.0 and got.where.startswith("layer 1 (Linear), most in 'weight'")


def test_perturbed_copy_starts_a_few_ulps_away_with_ties_kept() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(3, 3).double()
    layers = [shared, nn.Sequential(shared, nn.Linear(3, 2).double())]
    before = {id(p): p.detach().clone() for layer in layers for p in layer.parameters()}
    _perturb(layers, 1)
    eps = torch.finfo(torch.float64).eps
    for layer in layers:
        for p in layer.parameters():
            rel = ((p.detach() - before[id(p)]) / before[id(p)]).abs()
            assert float(rel.max()) <= 4 * eps * 1.01 and float(rel.max()) > 0
    assert layers[1][0].weight is shared.weight


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_names_the_differing_layer_and_exits_1() -> None:
    """A negative tolerance always fails: exit 1 and the layer that differs most."""
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--job",
         "hetpilot.trainer.testing.jobs:tied_tiny", "--ranks", "2", "--tolerance", "-1"],
        capture_output=True, text=True, timeout=110)
    assert res.returncode == 1, res.stderr[-2000:]
    assert re.search(r"at plan v\d+, (layer \d+ \(\w+\) '[\w.]+' on rank \d|the mean loss)",
                     res.stdout), res.stdout
    assert "FAIL" in res.stdout


@pytest.mark.parametrize("tolerance", ["nan", "inf"])
def test_cli_refuses_a_tolerance_that_is_not_finite(tolerance: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--tolerance", tolerance],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--tolerance" in res.stderr and "finite" in res.stderr


def test_cli_refuses_more_ranks_than_the_memory_holds() -> None:
    """Each local rank is a process with torch (hundreds of MiB): a rank count the machine
    cannot hold is refused before any starts, instead of exhausting its memory."""
    from hetpilot.agents.cpustat import meminfo_gb
    from hetpilot.trainer.cli import RANK_BYTES

    available = int(meminfo_gb()[1] * 1e9)
    assert available > 0  # Linux
    too_many = available // RANK_BYTES + 1
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--ranks", str(too_many)],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--ranks" in res.stderr and "GiB is available" in res.stderr


def test_cli_refuses_cuda_where_there_is_none() -> None:
    """``--device cuda`` without a CUDA device (hidden here where there is one): exit 2
    naming ``--device`` before any rank starts."""
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--device", "cuda", "--ranks", "2"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--device" in res.stderr and "no CUDA device here" in res.stderr
    assert "plan v" not in res.stdout  # no rank ran


def test_backend_nccl_is_refused_where_it_cannot_run() -> None:
    """``--backend nccl`` needs ``--device cuda``, torch with NCCL and a GPU per rank; each
    refusal names ``--backend`` and says which."""
    from hetpilot.planner.errors import ValidationError
    from hetpilot.trainer.traincheck import check_backend

    check_backend("gloo", "cpu", 4, 0, False)  # the default needs none of it
    check_backend("nccl", "cuda", 2, 2, True)
    for args, words in ((("nccl", "cpu", 2, 8, True), "needs --device cuda"),
                        (("nccl", "cuda", 2, 8, False), "without NCCL"),
                        (("nccl", "cuda", 3, 2, True), "--ranks 3 needs 3 CUDA devices, 2 visible"),
                        (("mpi", "cpu", 2, 0, False), "must be one of gloo, nccl")):
        with pytest.raises(ValidationError, match="--backend") as err:
            check_backend(*args)
        assert words in str(err.value)


def test_cli_refuses_backend_nccl_on_the_cpu() -> None:
    """Exit 2 naming ``--backend`` before any rank starts."""
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--backend", "nccl", "--ranks", "2"],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--backend: nccl needs --device cuda" in res.stderr
    assert "plan v" not in res.stdout


def test_init_local_refuses_an_unknown_backend() -> None:
    from hetpilot.trainer.launch import free_port, init_local

    with pytest.raises(ValueError, match="backend"):
        init_local(0, 1, free_port(), backend="mpi")


def staged_pytree_tiny() -> dict[str, Any]:
    """``testing.activation_jobs:pytree_tiny`` (tuple and dict activations, integer and non-tensor leaves)
    whose ranks send every activation, gradient and moved state through a host copy, as
    CUDA tensors cross under gloo (``activations.through_host``): that path, on the CPU.
    The job function runs in each rank, process group up, where it patches the rule, and
    in the checking process, which it leaves alone; the first staged message touches the
    file ``$STAGED_MARK``."""
    import torch.distributed as dist
    from hetpilot.trainer import activations
    from hetpilot.trainer.testing import activation_jobs

    if dist.is_initialized():
        mark = Path(os.environ["STAGED_MARK"])

        def staged(device: torch.device) -> bool:
            if not mark.exists():
                mark.touch()
            return True

        activations.through_host = staged  # wire_device reads it there, the runtime's too
    return activation_jobs.pytree_tiny()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_staging_through_host_memory_matches_one_process(
        tmp_path: Path, importable: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gloo-on-CUDA path (send a host copy, receive into a host buffer, then copy to the
    device) on CPU tensors: the same training as one process, every boundary cut."""
    mark = tmp_path / "staged"
    monkeypatch.setenv("STAGED_MARK", str(mark))
    lines = _check(f"{__name__}:staged_pytree_tiny", 2)
    assert mark.exists(), "no message was staged"
    assert _cuts(lines) == set(range(1, 4)), "\n".join(lines)


def test_cli_refuses_a_job_that_is_not_module_fn() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--job", "nocolon", "--ranks", "2"],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "--job" in res.stderr and "MODULE:FN" in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("example", ["gpt", "resnet", "lstm"])
def test_shipped_examples_match_one_process(example: str, ranks: int) -> None:
    """A GPT-style LM with tied embeddings on integer ids, a ResNet with BatchNorm, an LSTM
    whose tuple output crosses a cut: every boundary cut on 2 and 4 ranks (3 ranks: the
    mechanism jobs and the built-in MLP; CI's 15 minutes)."""
    from hetpilot.trainer import examples

    layers = len(getattr(examples, example)()["layers"])
    lines = _check(f"hetpilot.trainer.examples:{example}", ranks, seed=ranks)
    assert _cuts(lines) == set(range(1, layers)), "\n".join(lines)


FLAKY_JOB = '''
import torch
from hetpilot.trainer.examples import mlp


class Flaky(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if i == 37:
            raise IndexError("item 37 is corrupt")
        return self.base[i]


def job():
    spec = mlp()
    spec["dataset"] = Flaky(spec["dataset"])
    return spec
'''


def test_a_job_failing_in_a_rank_exits_2_naming_the_error_and_where(tmp_path: Path) -> None:
    """The preflight reads only the first microbatch; an item that fails later raised in a
    rank, and train-check ended with hetpilot's own traceback and exit 1. Now the rank's
    traceback is shown, then one line with the error and the user's frame, exit 2."""
    (tmp_path / "flakyjob.py").write_text(FLAKY_JOB)
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--job", "flakyjob:job", "--ranks", "2"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"hetpilot train-check: error: --job: rank \d failed while training: "
                        r"IndexError: item 37 is corrupt \(at .*flakyjob\.py:\d+\)", last), last
    assert "hetpilot/cli.py" not in res.stderr  # not the checker's own traceback


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_check_that_rounding_noise_swamps_is_inconclusive_not_ok() -> None:
    """Issue 39's resnet18 at microbatch 2: the last BatchNorms normalise 2 values a channel,
    float64 runs 4 ulps apart part within a few steps, and the noise floor absorbed every
    difference: the check printed 'beyond rounding noise 0.000e+00 ... ok'. Now it exits 1
    saying why, with the layer, the floor against the tolerance and what to change."""
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--job",
         "hetpilot.trainer.testing.noise_jobs:chaotic_bn", "--ranks", "2", "--iterations", "3"],
        capture_output=True, text=True, timeout=110,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = res.stdout.strip().splitlines()[-1]
    assert res.returncode == 1, res.stdout + res.stderr
    assert last.startswith("vs float64: INCONCLUSIVE: rounding noise alone moves the mean "
                           "loss by up to "), last
    floor = float(re.search(r"by up to (\S+) ", last).group(1))  # type: ignore[union-attr]
    assert floor > 1e-9 and "above the tolerance 1e-09" in last
    assert "at layer" in last and "microbatch_size" in last and "--iterations 1" in last
    assert " ok" not in last
