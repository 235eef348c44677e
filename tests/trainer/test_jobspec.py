"""load_job: a job function's values are checked when it is loaded, each refusal naming the
key and the problem (the CLI turns it into exit 2), instead of failing later in a rank."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hetpilot.planner.errors import ValidationError
from hetpilot.trainer.jobspec import load_job

JOBS = textwrap.dedent('''
    import torch
    from torch import nn

    def job(**change):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        spec = {"layers": [nn.Linear(4, 3), nn.Linear(3, 2)], "loss": nn.functional.mse_loss,
                "optimizer": lambda p: torch.optim.SGD(p, lr=0.1),
                "dataset": torch.utils.data.TensorDataset(x, y), "global_batch": 4,
                "sample": x[:2]}
        spec.update(change)
        return spec

    def good(): return job()
    def zero_batch(): return job(global_batch=0)
    def bool_batch(): return job(global_batch=True)
    def big_batch(): return job(global_batch=100)
    def big_micro(): return job(microbatch_size=8)
    def no_layers(): return job(layers=[])
    def layer_is_int(): return job(layers=[nn.Linear(4, 2), 3])
    def loss_not_callable(): return job(loss="mse")
    def iterable_data(): return job(dataset=iter([1, 2]))
    def lbfgs(): return job(optimizer=lambda p: torch.optim.LBFGS(p))
    _MODEL = nn.Linear(4, 2)
    def not_its_params(): return job(optimizer=lambda p: torch.optim.SGD(_MODEL.parameters(), lr=1))
    def opt_and_schedule(): return job(optimizer=lambda p: (torch.optim.SGD(p, lr=0.1), None))
    def dict_items(): return job(dataset=[{"x": torch.zeros(4), "y": torch.zeros(2)}] * 8)
    def triples(): return job(dataset=[(torch.zeros(4), torch.zeros(2), 1.0)] * 8)
    def micro_not_dividing(): return job(microbatch_size=3)
    def lazy_layer(): return job(layers=[nn.Sequential(nn.LazyLinear(3)), nn.Linear(3, 2)])
    def function_layer(): return job(layers=[nn.Linear(4, 2), lambda h: h.tanh()])
    def builtin_layer(): return job(layers=[nn.Linear(4, 2), torch.tanh])
    def factory_of_a_function(): return job(layers=[nn.Linear(4, 2), lambda: torch.tanh])
    def groups():  # the usual decay split: a layer of 1-d parameters only leaves one empty
        return job(layers=[nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2)],
                   optimizer=lambda ps: torch.optim.AdamW(
                       [{"params": [p for p in ps if p.ndim > 1], "weight_decay": 0.1},
                        {"params": [p for p in ps if p.ndim <= 1], "weight_decay": 0.0}]))
    def factories(): return job(layers=[nn.Tanh, lambda: nn.Linear(4, 2)])

    def _scheduled(params):  # a scheduler wraps opt.step: it is still a plain step
        opt = torch.optim.AdamW(params, lr=0.01)
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=1.0, total_iters=1)
        return opt

    def scheduled(): return job(optimizer=_scheduled)

    class Tempered(nn.Module):  # a learned temperature, as in contrastive losses
        def __init__(self, learn=True):
            super().__init__()
            self.log_t = nn.Parameter(torch.zeros(()), requires_grad=learn)
        def forward(self, out, target):
            return nn.functional.mse_loss(out * self.log_t.exp(), target)

    def learned_loss(): return job(loss=Tempered())
    def frozen_loss(): return job(loss=Tempered(learn=False))
    def weighted_loss(): return job(loss=nn.CrossEntropyLoss(weight=torch.ones(2)))
    def misspelt_micro(): return job(micro_batch_size=2)
    def lr_scheduler(): return job(lr_scheduler=lambda opt: None)
    def unknown_key(): return job(clip_norm=1.0)
    def eval_without_metric(): return job(eval_dataset=job()["dataset"])
    def metric_not_callable(): return job(eval_dataset=job()["dataset"], metric="accuracy")
    def metric_raising(): return job(eval_dataset=job()["dataset"], metric=lambda o, t: 1 / 0)
    def raising():
        return {}["layers"]
''')


@pytest.fixture()
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "userjobs_spec.py").write_text(JOBS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "userjobs_spec"


@pytest.mark.parametrize(("fn", "key", "words"), [
    ("zero_batch", "global_batch", "positive integer, got 0"),
    ("bool_batch", "global_batch", "positive integer, got True"),
    ("big_batch", "global_batch", "100, more than the dataset's 8 samples"),
    ("big_micro", "microbatch_size", "8, more than global_batch 4"),
    ("no_layers", "layers", "is empty"),
    ("layer_is_int", "layers", "item 1 (int) is neither a module nor a factory"),
    ("loss_not_callable", "loss", "must be callable, got str"),
    ("iterable_data", "dataset", "map-style dataset"),
    ("lbfgs", "optimizer", "LBFGS.step needs a closure"),
    ("not_its_params", "optimizer", "over 2 parameter(s) it was not given"),
    ("opt_and_schedule", "optimizer", "must return an optimizer"),
    ("dict_items", "dataset", "item 0 is a dict with keys ['x', 'y']"),
    ("triples", "dataset", "item 0 is a tuple of 3"),
    ("micro_not_dividing", "microbatch_size", "3, which does not divide global_batch 4"),
    ("lazy_layer", "layers", "item 0 (Sequential) has uninitialized parameters (its LazyLinear"),
    ("function_layer", "layers", "takes an argument"),
    ("builtin_layer", "layers", "item 1 (_VariableFunctionsClass.tanh) takes an argument"),
    ("learned_loss", "loss", "Tempered has parameters that require grad (log_t)"),
    # a key the trainer does not read was ignored without a word
    ("misspelt_micro", "micro_batch_size", "would be ignored; did you mean 'microbatch_size'?"),
    ("lr_scheduler", "lr_scheduler", "whose step() also steps the scheduler"),
    ("unknown_key", "clip_norm", "the keys are layers, loss, optimizer, dataset"),
    ("eval_without_metric", "eval_dataset", "eval_dataset and metric go together"),
    ("metric_not_callable", "metric", "must be a function (output, target) -> number, got str"),
])
def test_bad_values_are_refused_naming_the_key(jobs: str, fn: str, key: str,
                                               words: str) -> None:
    with pytest.raises(ValidationError) as info:
        load_job(f"{jobs}:{fn}", "--job")
    assert f"['{key}']" in str(info.value) and words in str(info.value)
    assert str(info.value).startswith("--job")


@pytest.mark.parametrize("fn", ["good", "groups", "factories", "frozen_loss",
                                "weighted_loss", "scheduled"])
def test_a_good_job_loads(jobs: str, fn: str) -> None:
    assert load_job(f"{jobs}:{fn}", "--job")["global_batch"] == 4


def test_a_job_function_that_raises_is_named_with_where(jobs: str) -> None:
    """It had escaped as a traceback (exit 1) from train-check, train and profile."""
    with pytest.raises(ValidationError) as info:
        load_job(f"{jobs}:raising", "--job")
    assert str(info.value).startswith(f"--job: {jobs}:raising() raised KeyError: 'layers' (at ")
    assert "userjobs_spec.py:" in str(info.value)


def test_a_failing_metric_is_refused_by_the_preflight(jobs: str) -> None:
    """An evaluation metric that raised had ended `hetpilot train` after its first epoch."""
    from hetpilot.trainer.preflight import preflight

    spec = load_job(f"{jobs}:metric_raising", "--job")
    with pytest.raises(ValidationError, match=r"\['metric'\]: failed on the last layer's output"):
        preflight(spec, "--job: metric_raising()", 2, 0, None)


def test_an_optimizer_with_a_scheduler_passes_the_preflight(jobs: str) -> None:
    """Its step wrapper holds the optimizer weakly: a step on a temporary optimizer
    raised "'NoneType' object has no attribute '_opt_called'"."""
    from hetpilot.trainer.preflight import preflight

    spec = load_job(f"{jobs}:scheduled", "--job")
    assert isinstance(preflight(spec, "--job: scheduled()", 2, 0, None), list)


def test_train_check_exits_2_on_a_bad_value(tmp_path: Path) -> None:
    (tmp_path / "userjobs_cli.py").write_text(JOBS)
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train-check", "--job", "userjobs_cli:big_batch",
         "--ranks", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "['global_batch']" in res.stderr and "Traceback" not in res.stderr


def test_train_exits_2_on_a_factory_that_builds_no_module(tmp_path: Path) -> None:
    """Found only when the layers are built: ``hetpilot train`` says so with exit 2, as
    train-check does, not with a traceback."""
    (tmp_path / "userjobs_train.py").write_text(JOBS)
    (tmp_path / "plan.json").write_text(
        '{"microbatch_size": 2, "schedule": "1f1b", "groups": [{"samples": 4, "stages": '
        '[{"device": "cpu:0", "layers": [0, 2]}]}]}')
    res = subprocess.run(
        [sys.executable, "-m", "hetpilot", "train", "--model",
         "userjobs_train:factory_of_a_function", "--plan", "plan.json", "--device-id", "cpu:0",
         "--steps", "1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--model: layers: item 1: its factory" in res.stderr and "not an nn.Module" in \
        res.stderr and "Traceback" not in res.stderr


def test_a_job_without_a_sample_gets_one_from_its_dataset() -> None:
    """``hetpilot train`` profiles and times the layers on a sample; most users' jobs give
    none, so it takes the inputs of the dataset's first items."""
    import torch
    from hetpilot.trainer.cli import _with_sample

    x, y = torch.arange(40.0).reshape(20, 2), torch.zeros(20)
    data = torch.utils.data.TensorDataset(x, y)
    got = _with_sample({"dataset": data, "global_batch": 12})
    assert torch.equal(got["sample"], x[:8])  # 8 unless the job says otherwise
    got = _with_sample({"dataset": data, "global_batch": 12, "microbatch_size": 3})
    assert torch.equal(got["sample"], x[:3])
    assert torch.equal(_with_sample({"dataset": data, "global_batch": 4})["sample"], x[:4])
    # items of (dict input, target): batched as the trainer batches them
    items = [({"ids": torch.tensor([i, i + 1]), "n": i}, 0) for i in range(5)]
    got = _with_sample({"dataset": items, "global_batch": 4})["sample"]
    assert got["ids"].shape == (4, 2) and got["n"].tolist() == [0, 1, 2, 3]
    # a job's own sample is kept; a dataset that cannot be batched leaves the job as it was
    own = {"dataset": data, "global_batch": 12, "sample": x[:2]}
    assert _with_sample(own) is own
    ragged = [(torch.zeros(i + 1), 0) for i in range(4)]
    assert "sample" not in _with_sample({"dataset": ragged, "global_batch": 4})


def test_a_layer_failing_to_be_timed_leaves_the_daemon_its_probes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``hetpilot train --daemon`` times the layers on Attach; a layer that fails there (it
    would fail in training too, with the trainer's own message) must not end the rank
    before training starts: the measurement is left out, and the rank says why."""
    import argparse

    import torch
    from hetpilot.trainer.rankmeasure import measure as _measure

    class Fails(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("not on this input")

    data = torch.utils.data.TensorDataset(torch.zeros(8, 2), torch.zeros(8, 2))
    spec = {"layers": [torch.nn.Linear(2, 2), Fails()], "sample": torch.zeros(4, 2),
            "loss": torch.nn.functional.mse_loss, "dataset": data}
    args = argparse.Namespace(no_measure=False, emulate_slowdown=1.0, dtype=None)
    assert _measure(args, spec, 4, None, None, torch.device("cpu")) is None
    assert "timing the job's layers failed (RuntimeError: not on this input)" in \
        capsys.readouterr().err
    spec["layers"] = [torch.nn.Linear(2, 2)]
    got = _measure(args, spec, 4, None, None, torch.device("cpu"))
    assert got is not None and got["microbatch"] == 4 and len(got["layers"]) == 1
