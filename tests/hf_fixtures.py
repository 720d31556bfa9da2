"""Tiny random Hugging Face models made with transformers itself and saved to disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 96
PAD_ID = 0


def tiny_hf_config(model_type: str, arch_suffix: str, **changes):
    """A 2-layer, D=32 transformers config of the given family and head."""
    from transformers import LlamaConfig, Qwen2Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        pad_token_id=PAD_ID,
        eos_token_id=1,
        bos_token_id=2,
        num_labels=1,
    )
    if model_type == "qwen2":
        base.update(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
        cls, prefix = Qwen2Config, "Qwen2"
    else:
        base.update(
            rope_parameters={"rope_theta": 500.0, "rope_type": "default"}, attention_bias=True
        )
        cls, prefix = LlamaConfig, "Llama"
    base.update(changes)
    return cls(architectures=[prefix + arch_suffix], **base)


def save_tiny_hf_model(
    directory: Path, model_type: str, arch_suffix: str, seed: int = 0, **changes
):
    """Build a random transformers model, perturb its norms and biases, save it; return it."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_hf_config(model_type, arch_suffix, **changes)
    cls = (
        AutoModelForCausalLM if arch_suffix == "ForCausalLM" else AutoModelForSequenceClassification
    )
    model = cls.from_config(config).float().eval()
    with torch.no_grad():  # default norms are ones and biases zeros: make them informative
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.startswith("score"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def padded_batch(rng: np.random.Generator, lengths: list[int], width: int):
    """Right-padded random token ids (never the pad id inside a row) and the attention mask."""
    ids = np.full((len(lengths), width), PAD_ID, np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(3, VOCAB, n)
        mask[i, :n] = 1
    return ids, mask
