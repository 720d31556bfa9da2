"""Write our parameters as a Hugging Face directory (config.json + model.safetensors)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from oppo_jax.models.hf_io import hf_names
from oppo_jax.models.model_config import ModelConfig

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def hf_config_for(cfg: ModelConfig):
    """The transformers config object describing ``cfg`` (Qwen2Config or LlamaConfig)."""
    from transformers import LlamaConfig, Qwen2Config

    kind = {"qwen2": ("Qwen2", Qwen2Config), "llama": ("Llama", LlamaConfig)}[cfg.model_type]
    suffix = "ForCausalLM" if cfg.head == "lm" else "ForSequenceClassification"
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=cfg.pad_token_id,
        architectures=[kind[0] + suffix],
        num_labels=cfg.num_labels,
        dtype=cfg.param_dtype,
    )
    if cfg.model_type == "llama":
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError("Llama ties the q/k/v and o biases (attention_bias); got different")
        kwargs.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    elif not cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise ValueError("Qwen2 layout needs qkv_bias=True, o_bias=False, mlp_bias=False")
    return kind[1](**kwargs)


def export_hf(
    params,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Save ``params`` so that ``transformers`` AutoModel*.from_pretrained(out_dir) loads them.

    Tokenizer files found in ``tokenizer_dir`` are copied beside the weights. Returns out_dir.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names, transposed = hf_names(tuple(k.key for k in kp), cfg.num_layers)
        array = np.asarray(jax.device_get(leaf))
        # Stacked layer parameters [L, ...] are written as one tensor per layer.
        parts = list(array) if kp[0].key == "layers" else [array]
        for name, part in zip(names, parts, strict=True):
            tensors[name] = np.ascontiguousarray(part.T if transposed else part)
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")  # atomic: never a half-written weights file
    hf_config_for(cfg).save_pretrained(out)
    if tokenizer_dir is not None:
        for fname in _TOKENIZER_FILES:
            src = Path(tokenizer_dir) / fname
            if src.is_file():
                shutil.copyfile(src, out / fname)
    return out
