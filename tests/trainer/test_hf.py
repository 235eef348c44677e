"""Hugging Face models as jobs (``hetpilot.trainer.hf``), checkpoints back as HF models.

Models come from tiny configs (``hetpilot.trainer.testing.hf_jobs``); nothing touches a hub.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hetpilot.planner.errors import ValidationError  # noqa: E402
from hetpilot.trainer import hf  # noqa: E402
from hetpilot.trainer.modelnames import layer_names  # noqa: E402
from hetpilot.trainer.testing import hf_jobs as _hfjobs  # noqa: E402
from hetpilot.trainer.traincheck import run_check  # noqa: E402

from hetpilot.cli import main as cli_main  # noqa: E402

FAMILIES = ("gpt2", "llama", "qwen2", "mixtral", "bert", "bert_classifier")


def _inputs(job: dict) -> dict[str, torch.Tensor]:
    pairs = [job["dataset"][i] for i in range(4)]
    return {k: torch.stack([p[0][k] for p in pairs]) for k in pairs[0][0]}


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_are_the_models_own_forward(family: str) -> None:
    """The layers chained give the HF model's logits exactly, padding masks included, and
    hold nothing but the model's tensors (every one of them)."""
    job = getattr(_hfjobs, family)()
    model = job["model"].eval()
    x = _inputs(job)
    assert x["attention_mask"].min() == 0  # a padded item is in it
    y: object = x
    for layer in job["layers"]:
        y = layer.eval()(y)
    assert torch.equal(y, model(**x).logits)
    names = layer_names(model, job["layers"])
    assert {n for layer in names for ns in layer.values() for n in ns} == set(model.state_dict())


def test_tied_head_holds_the_embeddings_parameter() -> None:
    job = _hfjobs.gpt2()
    layers = job["layers"]
    assert layers[-1].head.weight is layers[0].wte.weight
    names = layer_names(job["model"], layers)
    assert sorted(names[0]["wte.weight"]) == ["lm_head.weight", "transformer.wte.weight"]


def test_causal_labels_default_to_the_inputs_and_ignore_padding() -> None:
    job = _hfjobs.llama()
    inputs, labels = job["dataset"][1]  # padded
    assert torch.equal(labels[:5], inputs["input_ids"][:5])
    assert labels[5:].tolist() == [hf.IGNORE] * 3
    logits = torch.randn(1, 8, _hfjobs.VOCAB)
    want = torch.nn.functional.cross_entropy(logits[0, :4], labels[1:5])
    assert torch.allclose(job["loss"](logits, labels[None]), want)


def test_an_unknown_architecture_is_refused_naming_it() -> None:
    model = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        num_layers=1, hidden_size=8, num_heads=2, attention_types=[[["global"], 1]],
        vocab_size=16))
    with pytest.raises(ValidationError, match=r"^model: GPTNeoForCausalLM is not an "
                                              r"architecture hetpilot.trainer.hf knows"):
        hf.layers(model)


def test_items_without_labels_are_refused_for_a_masked_lm() -> None:
    job = hf.job(_hfjobs.bert()["model"], [{"input_ids": [1, 2, 3]}], global_batch=1,
                 microbatch_size=1)
    with pytest.raises(ValidationError, match="has no 'labels'"):
        job["dataset"][0]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "ranks"), [
    ("gpt2", 2), ("llama", 2), ("qwen2", 2), ("mixtral", 2), ("bert", 2),
    ("gpt2", 4), ("llama", 4), ("qwen2", 4), ("mixtral", 4), ("bert", 4)])
def test_train_check_passes(family: str, ranks: int) -> None:
    worst = run_check(ranks, job=f"hetpilot.trainer.testing.hf_jobs:{family}", iterations=1,
                      log=lambda *_: None, timeout_s=240)
    assert worst["float64"].value <= 1e-9, worst["float64"]


def _torchrun(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hetpilot", *args], env=env, capture_output=True, text=True, timeout=150)


def _hetpilot(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetpilot", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", ["gpt2", "pretrained", "qwen2", "mixtral", "bert"])
def test_two_stage_train_then_export_hf_loads_strictly(family: str, tmp_path: Path) -> None:
    """``hetpilot train`` on a 2-stage pipeline, then ``export --hf``: ``from_pretrained``
    loads the directory with no key missing or unexpected and gives the logits of the
    trained model (the job's model with the checkpoint's tensors, ``export --out``);
    ``pretrained`` fine-tunes a Llama that ``from_pretrained`` loaded from a directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    if family == "pretrained":
        torch.manual_seed(1)
        start = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_key_value_heads=2, **_hfjobs.SMALL))
        start.save_pretrained(tmp_path / "start")
        env["HETPILOT_TEST_HF_DIR"] = str(tmp_path / "start")
        os.environ["HETPILOT_TEST_HF_DIR"] = str(tmp_path / "start")
    try:
        job = getattr(_hfjobs, family)()
    finally:
        os.environ.pop("HETPILOT_TEST_HF_DIR", None)
    n = len(job["layers"])
    plan = {"microbatch_size": 2, "schedule": "1f1b", "groups": [{"samples": 8, "stages": [
        {"device": "local:0", "layers": [0, 2]}, {"device": "local:1", "layers": [2, n]}]}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    res = _torchrun("train", "--model", f"hetpilot.trainer.testing.hf_jobs:{family}",
                    "--plan", str(tmp_path / "plan.json"), "--steps", "3",
                    "--device-id", "local:{local_rank}", "--checkpoint", str(tmp_path / "ck"),
                    "--slot-iterations", "1", "--tensorboard", str(tmp_path / "tb"), env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    log = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in log] == ["step 1", "step 2", "step 3"], res.stdout
    assert all(" tokens/s | " in line and line.endswith(" | plan v1 | local:0,local:1")
               for line in log), log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [step for step, _ in losses] == [1, 2, 3]
    assert [f"loss {value:.4f}" for _, value in losses] == [ln.split(" | ")[2] for ln in log]
    assert {"train/tokens_per_s", "train/samples_per_s", "train/iteration_s"} <= set(
        events.Tags()["scalars"])
    if family == "gpt2":  # the command as a user runs it; the others in this process
        res = _hetpilot("export", str(tmp_path / "ck"), "--hf", str(tmp_path / "hf"))
        assert res.returncode == 0, res.stderr
    else:
        assert cli_main(["export", str(tmp_path / "ck"), "--hf", str(tmp_path / "hf")]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    assert cli_main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "model.pt")]) == 0

    model = job["model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    loaded, info = type(model).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    x = _inputs(job)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**x).logits, model.eval()(**x).logits)


def test_preflight_names_the_op_without_a_float64_kernel() -> None:
    """Mixtral's default experts path calls torch._grouped_mm, which has no float64 kernel:
    the refusal names it, not a `.float()` cast the model does not make."""
    from hetpilot.trainer.preflight import preflight

    with pytest.raises(ValidationError) as caught:
        preflight(_hfjobs.mixtral_grouped(), "--job: m:f()", 2, seed=0, dtype=torch.float64)
    text = str(caught.value)
    assert "torch._grouped_mm has no float64 kernel" in text, text
    assert ".float()" not in text and 'experts_implementation="eager"' in text


def test_float32_islands_of_a_float64_check_are_noted() -> None:
    """Llama's RMSNorm and rotary embedding compute in float32 inside a float64 model."""
    from hetpilot.trainer.preflight import preflight

    notes = preflight(_hfjobs.llama(), "--job: m:f()", 2, seed=0, dtype=torch.float64)
    islands = [n for n in notes if "narrower dtype inside this float64 check" in n]
    assert islands, notes
    assert "item 0 (DecoderEmbedding): float32 (" in islands[0]
    assert "item 1 (DecoderBlock): float32 (" in islands[0] and "rsqrt" in islands[0]
    assert not [n for n in preflight(_hfjobs.bert(), "--job: m:f()", 2, seed=0,
                                     dtype=torch.float64) if "narrower dtype" in n]


def test_tensorboard_without_its_package_is_refused_before_training(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['tensorboard'] = None; from hetpilot.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"microbatch_size": 4, "schedule": "1f1b", "groups": [
        {"samples": 16, "stages": [{"device": "solo:0", "layers": [0, 6]}]}]}))
    res = subprocess.run([sys.executable, "-c", code, "train", "--model",
                          "hetpilot.trainer.examples:mlp", "--plan", str(plan), "--device-id",
                          "solo:0", "--tensorboard", str(tmp_path / "tb")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("hetpilot: error: --tensorboard: needs the tensorboard "
                                 "package"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "tb").exists()
