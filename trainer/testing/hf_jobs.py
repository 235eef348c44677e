"""Tiny Hugging Face jobs for the tests (``hetpilot.trainer.hf``): models from configs,
no hub access, seeded so that every rank builds the same model and data.

``pretrained`` fine-tunes what ``from_pretrained($HETPILOT_TEST_HF_DIR)`` loads (the
test saves a tiny model there first).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import hf

SEQ, VOCAB, ITEMS = 8, 64, 32
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": 32}
"""A decoder of the Llama family at a size that trains in milliseconds."""


def _items(seed: int = 0, labels: bool = False, classes: int = 0) -> list[dict[str, Any]]:
    """Token-id items as HF pipelines give them, the second of every four padded."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ITEMS, SEQ), generator=gen)
    out = []
    for i in range(ITEMS):
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % 4 == 1:
            mask[SEQ - 3:] = 0
        item: dict[str, Any] = {"input_ids": ids[i].tolist(), "attention_mask": mask.tolist()}
        if labels:
            mlm = torch.full((SEQ,), hf.IGNORE)
            mlm[i % SEQ] = int(ids[i, i % SEQ])
            item["labels"] = mlm.tolist()
        if classes:
            item["labels"] = i % classes
        out.append(item)
    return out


def _job(model: Any, **items: Any) -> dict[str, Any]:
    return hf.job(model, _items(**items), global_batch=8, microbatch_size=2,
                  optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0))


def _build(config_cls: str, model_cls: str, **config: Any) -> Any:
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))


def gpt2() -> dict[str, Any]:
    return _job(_build("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32, n_head=4,
                       vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0))


def llama() -> dict[str, Any]:
    return _job(_build("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2,
                       tie_word_embeddings=True, **SMALL))


def qwen2() -> dict[str, Any]:
    return _job(_build("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **SMALL))


def mixtral() -> dict[str, Any]:
    """4 experts, top 2; the eager experts path (the default, ``torch._grouped_mm``, has no
    float64 kernel: the preflight names it)."""
    return _job(_build("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
                       num_local_experts=4, num_experts_per_tok=2,
                       experts_implementation="eager", **SMALL))


def mixtral_grouped() -> dict[str, Any]:
    return _job(_build("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
                       num_local_experts=4, num_experts_per_tok=2, **SMALL))


def bert() -> dict[str, Any]:
    """BERT's masked LM on padded items, one labelled token a sample."""
    config = {k: v for k, v in SMALL.items()}
    return _job(_build("BertConfig", "BertForMaskedLM", **config), labels=True)


def bert_classifier() -> dict[str, Any]:
    return _job(_build("BertConfig", "BertForSequenceClassification", num_labels=3, **SMALL),
                classes=3)


def pretrained() -> dict[str, Any]:
    """Fine-tuning: the model ``from_pretrained`` loads from ``$HETPILOT_TEST_HF_DIR``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.environ["HETPILOT_TEST_HF_DIR"])
    return _job(model)
