"""Hugging Face models as hetpilot jobs: layers made of the model's own modules.

``job(model, dataset, global_batch=..., microbatch_size=...)`` returns the
dict a job function returns (docs/trainer.md, "Hugging Face models"):

* ``layers``: the embedding (which also computes the attention masks, the
  position ids and, for rotary models, the cos/sin table, as the HF base
  model's ``forward`` does), one layer per transformer block, and the head.
  Each is a thin :class:`torch.nn.Module` holding HF's own submodules and
  calling them as the HF model's ``forward`` calls them: no math is
  re-implemented. Between layers the activation is a dict (hidden states,
  masks, position embeddings, position ids) that crosses a cut as a pytree.
  A tied head (GPT-2, Llama with ``tie_word_embeddings``) holds the embedding's
  own parameter, which the trainer keeps tied.
* ``loss``: for a causal LM the next-token cross-entropy (logits at ``t``
  against labels at ``t + 1``), for BERT's masked LM the cross-entropy at the
  labelled positions, each a mean over a sample's labelled tokens and then over
  samples, so that the objective does not depend on how a batch is cut into
  microbatches (it equals HF's own loss when every sample has as many labelled
  tokens); labels ``-100`` are ignored, as in HF. Sequence classification:
  cross-entropy (or MSE for one label).
* ``dataset``: items are dicts as HF pipelines give them (``input_ids``,
  ``attention_mask``, ``token_type_ids``, ``labels`` where present); labels
  of a causal LM default to the inputs (shifted by the loss), padding
  (``attention_mask`` 0) ignored.
* ``model``: the model itself, so that checkpoints record every tensor's name
  and ``hetpilot export --hf`` writes a directory ``from_pretrained`` loads.

Supported: GPT-2 (``GPT2LMHeadModel``), the Llama family (``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``MixtralForCausalLM``) and BERT
(``BertForMaskedLM``, ``BertForSequenceClassification``). Any other model is
refused with one line naming its class.

transformers is an optional dependency (``pip install hetpilot[hf]``); this
module imports it on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hetpilot.planner.errors import ValidationError
from torch import nn
from torch.nn import functional as F

__all__ = ["SUPPORTED", "config_record", "job", "layers", "model_from_record"]

IGNORE = -100
"""The label HF's losses ignore."""


def _masking() -> Any:
    try:
        from transformers import masking_utils
    except ImportError as exc:  # an optional extra
        raise ValidationError("model", "hetpilot.trainer.hf needs transformers: "
                                       "pip install 'hetpilot[hf]'") from exc
    return masking_utils


def _block_output(out: Any) -> torch.Tensor:
    """A block's hidden states (transformers 5 returns them alone; older versions a tuple)."""
    return out[0] if isinstance(out, tuple) else out


# --- the Llama family (Llama, Mistral, Qwen2, Mixtral) and GPT-2 ------------------------


def _attention_kind(config: Any, index: int) -> str:
    """Which mask block ``index`` attends with: the config's ``layer_types`` (Qwen2), else
    a sliding window when the config has one (Mistral, Mixtral), else full attention."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return str(kinds[index])
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _mask(build: Callable[..., Any], config: Any, embeds: torch.Tensor, attention_mask: Any,
          **more: Any) -> Any:
    """Call one of HF's mask functions without a cache, in the words of the installed
    transformers (5.x: ``inputs_embeds``, ``cache``; 4.5x: ``input_embeds``,
    ``past_key_values`` and ``cache_position``)."""
    import inspect

    params = inspect.signature(build).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask, **more}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = embeds
    for name in ("cache", "past_key_values"):
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
    return build(**{k: v for k, v in kwargs.items() if k in params})


def _masks(config: Any, kinds: Sequence[str], embeds: torch.Tensor, attention_mask: Any,
           position_ids: torch.Tensor) -> dict[str, Any]:
    """The causal masks the base model's ``forward`` builds (HF's own functions), by kind."""
    masking = _masking()
    build = {"full_attention": masking.create_causal_mask,
             "sliding_attention": masking.create_sliding_window_causal_mask}
    return {kind: _mask(build[kind], config, embeds, attention_mask, position_ids=position_ids)
            for kind in sorted(set(kinds))}


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)


class DecoderEmbedding(nn.Module):
    """Layer 0 of a Llama-family model: token embedding, masks, position ids and the
    rotary cos/sin (``base.rotary_emb``), as ``LlamaModel.forward`` computes them before
    its first block."""

    def __init__(self, base: Any, kinds: Sequence[str]) -> None:
        super().__init__()
        self.embed_tokens = base.embed_tokens
        self.rotary_emb = base.rotary_emb
        self.config = base.config
        self.kinds = tuple(kinds)

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, Any]:
        ids = x["input_ids"]
        hidden = self.embed_tokens(ids)
        position_ids = _positions(ids)
        return {"hidden": hidden, "position_ids": position_ids,
                "masks": _masks(self.config, self.kinds, hidden, x.get("attention_mask"),
                                position_ids),
                "position_embeddings": tuple(self.rotary_emb(hidden, position_ids))}


class DecoderBlock(nn.Module):
    """One HF decoder layer, called as the base model calls it."""

    def __init__(self, block: nn.Module, kind: str) -> None:
        super().__init__()
        self.block = block
        self.kind = kind

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        hidden = self.block(x["hidden"], attention_mask=x["masks"][self.kind],
                            position_ids=x["position_ids"],
                            position_embeddings=x["position_embeddings"])
        return {**x, "hidden": _block_output(hidden)}


class Head(nn.Module):
    """The final norm and the LM head (tied to the embedding where the model ties it)."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.head = head

    def forward(self, x: dict[str, Any]) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.norm(x["hidden"]))
        return logits


def _llama_layers(model: Any) -> list[nn.Module]:
    base, config = model.model, model.config
    n = config.num_hidden_layers
    kinds = [_attention_kind(config, i) for i in range(n)]
    return [DecoderEmbedding(base, kinds),
            *(DecoderBlock(base.layers[i], kinds[i]) for i in range(n)),
            Head(base.norm, model.lm_head)]


class GPT2Embedding(nn.Module):
    """Layer 0 of GPT-2: token and position embeddings, dropout, the causal mask, as
    ``GPT2Model.forward`` computes them."""

    def __init__(self, base: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = base.wte, base.wpe, base.drop
        self.config = base.config

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, Any]:
        ids = x["input_ids"]
        embeds = self.wte(ids)
        position_ids = _positions(ids)
        hidden = self.drop(embeds + self.wpe(position_ids))
        masks = _masks(self.config, ["full_attention"], embeds, x.get("attention_mask"),
                       position_ids)
        return {"hidden": hidden, "mask": masks["full_attention"], "position_ids": position_ids}


class GPT2Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        hidden = self.block(x["hidden"], attention_mask=x["mask"],
                            position_ids=x["position_ids"])
        return {**x, "hidden": _block_output(hidden)}


def _gpt2_layers(model: Any) -> list[nn.Module]:
    base = model.transformer
    return [GPT2Embedding(base), *(GPT2Block(b) for b in base.h),
            Head(base.ln_f, model.lm_head)]


# --- BERT -----------------------------------------------------------------------------


class BertEmbedding(nn.Module):
    """Layer 0 of BERT: ``BertEmbeddings`` and the bidirectional padding mask."""

    def __init__(self, base: Any) -> None:
        super().__init__()
        self.embeddings = base.embeddings
        self.config = base.config

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, Any]:
        hidden = self.embeddings(input_ids=x["input_ids"],
                                 token_type_ids=x.get("token_type_ids"))
        mask = _mask(_masking().create_bidirectional_mask, self.config, hidden,
                     x.get("attention_mask"))
        return {"hidden": hidden, "mask": mask}


class BertBlock(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        return {**x, "hidden": _block_output(self.block(x["hidden"], x["mask"]))}


class BertMaskedLMHead(nn.Module):
    def __init__(self, cls: nn.Module) -> None:
        super().__init__()
        self.cls = cls

    def forward(self, x: dict[str, Any]) -> torch.Tensor:
        logits: torch.Tensor = self.cls(x["hidden"])
        return logits


class BertClassifierHead(nn.Module):
    """The pooler, dropout and classifier of ``BertForSequenceClassification``."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, x: dict[str, Any]) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(self.dropout(self.pooler(x["hidden"])))
        return logits


def _bert_body(base: Any) -> list[nn.Module]:
    return [BertEmbedding(base), *(BertBlock(b) for b in base.encoder.layer)]


def _bert_mlm_layers(model: Any) -> list[nn.Module]:
    return [*_bert_body(model.bert), BertMaskedLMHead(model.cls)]


def _bert_cls_layers(model: Any) -> list[nn.Module]:
    return [*_bert_body(model.bert),
            BertClassifierHead(model.bert.pooler, model.dropout, model.classifier)]


# --- losses -----------------------------------------------------------------------------


def _token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per labelled token, averaged per sample, then over samples: a mean
    over samples, whatever the microbatch (a sample without labels counts 0)."""
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                reduction="none").view(labels.shape)
    counts = (labels != IGNORE).sum(dim=1).clamp(min=1).to(per_token.dtype)
    return (per_token.sum(dim=1) / counts).mean()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss: logits at position ``t`` against the label at ``t + 1``."""
    return _token_mean(logits[:, :-1], labels[:, 1:])


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _token_mean(logits, labels)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if logits.shape[-1] == 1:
        return F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
    return F.cross_entropy(logits, labels)


SUPPORTED: dict[str, tuple[Callable[[nn.Module], list[nn.Module]], Any, str]] = {
    "GPT2LMHeadModel": (_gpt2_layers, causal_lm_loss, "causal"),
    "LlamaForCausalLM": (_llama_layers, causal_lm_loss, "causal"),
    "MistralForCausalLM": (_llama_layers, causal_lm_loss, "causal"),
    "Qwen2ForCausalLM": (_llama_layers, causal_lm_loss, "causal"),
    "MixtralForCausalLM": (_llama_layers, causal_lm_loss, "causal"),
    "BertForMaskedLM": (_bert_mlm_layers, masked_lm_loss, "labels"),
    "BertForSequenceClassification": (_bert_cls_layers, classification_loss, "labels"),
}
"""HF model class -> (its layers, its loss, where its labels come from)."""


def _family(model: Any) -> tuple[Callable[[nn.Module], list[nn.Module]], Any, str]:
    name = type(model).__name__
    if name not in SUPPORTED:
        raise ValidationError("model", f"{name} is not an architecture hetpilot.trainer.hf "
                                       f"knows (it knows {', '.join(SUPPORTED)})")
    return SUPPORTED[name]


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own tensor-parallel plan (its config's ``base_model_tp_plan``) as a job's
    ``tp_plan``: the decoder layers' ``colwise`` / ``rowwise`` entries, renamed to the
    submodules of :class:`DecoderBlock` (``layers.*.self_attn.q_proj`` ->
    ``block.self_attn.q_proj``). Other styles (``colwise_rep``, experts' ``local_*``,
    ``gather``) are left out: those submodules run whole on each rank of a stage. None
    when the model has no such plan (GPT-2, BERT) or no entry is left. The preflight
    refuses a split its attention cannot run (more ranks than key/value heads)."""
    if _family(model)[0] is not _llama_layers:
        return None
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    out = {f"block.{key.removeprefix('layers.*.')}": style for key, style in plan.items()
           if key.startswith("layers.*.") and style in ("colwise", "rowwise")}
    return out or None


def layers(model: nn.Module) -> list[nn.Module]:
    """The model as hetpilot layers (module docstring), sharing the model's parameters."""
    return _family(model)[0](model)


# --- data -------------------------------------------------------------------------------

INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class Pairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """HF-style dict items as the ``(inputs, labels)`` pairs the trainer reads."""

    def __init__(self, data: Any, labels: str) -> None:
        self.data = data
        self.labels = labels

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        item = self.data[index]
        if not isinstance(item, dict) or "input_ids" not in item:
            raise ValidationError("dataset", f"item {index} must be a dict with 'input_ids' "
                                             f"(as HF datasets give), got {type(item).__name__}")
        inputs = {k: torch.as_tensor(item[k]) for k in INPUT_KEYS if item.get(k) is not None}
        if item.get("labels") is not None:
            return inputs, torch.as_tensor(item["labels"])
        if self.labels != "causal":
            raise ValidationError("dataset", f"item {index} has no 'labels', which this model's "
                                             "loss needs")
        labels = inputs["input_ids"].clone()
        if "attention_mask" in inputs:
            labels[inputs["attention_mask"] == 0] = IGNORE
        return inputs, labels


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0)


def job(model: nn.Module, dataset: Any, *, global_batch: int, microbatch_size: int,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        **job_keys: Any) -> dict[str, Any]:
    """A hetpilot job for ``model`` on ``dataset`` (module docstring). ``optimizer``: a
    factory over a parameter list (default AdamW at lr 5e-5, HF Trainer's); ``job_keys``:
    any other key of a job (``eval_dataset``, ``metric``, ``sample``, ``tp_plan``). The
    ``tp_plan`` defaults to the model's own (:func:`tp_plan`), where it has one."""
    build, loss, labels = _family(model)
    split = tp_plan(model)
    return {"layers": build(model), "loss": loss, "optimizer": optimizer or _adamw,
            "dataset": Pairs(dataset, labels), "global_batch": global_batch,
            "microbatch_size": microbatch_size, "model": model,
            **({"tp_plan": split} if split is not None else {}), **job_keys}


# --- the record a checkpoint keeps, and the model back from it ---------------------------


def config_record(model: Any) -> dict[str, Any] | None:
    """What ``hetpilot export --hf`` needs to rebuild ``model`` from a checkpoint alone: its
    class and config (as ``config.json`` has it); None for a model that is not a HF
    ``PreTrainedModel``."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string") \
            or not hasattr(model, "save_pretrained"):
        return None
    import json

    return {"class": type(model).__name__, "config_class": type(config).__name__,
            "config": json.loads(config.to_json_string(use_diff=False))}


def model_from_record(record: dict[str, Any]) -> nn.Module:
    """A model of the recorded class and config, with fresh weights (to load a
    checkpoint's into)."""
    try:
        import transformers
    except ImportError as exc:
        raise ValueError("exporting to Hugging Face needs transformers: "
                         "pip install 'hetpilot[hf]'") from exc
    config_cls = getattr(transformers, record["config_class"], None)
    model_cls = getattr(transformers, record["class"], None)
    if config_cls is None or model_cls is None:
        raise ValueError(f"this transformers has no {record['class']} "
                         f"({transformers.__version__})")
    config = config_cls.from_dict(record["config"])
    model: nn.Module = model_cls(config)
    return model
