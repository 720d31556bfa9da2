"""Tiny random Qwen2 CausalLM made with transformers and saved to disk, for the benchmarks.

A standalone copy of the small model-building code in ``tests/hf_fixtures.py`` (benchmarks do not
import from ``tests/``), with the width, depth and vocabulary as parameters.
"""

from __future__ import annotations

from pathlib import Path

PAD_ID = 0


def tiny_qwen2_config(hidden: int, layers: int, vocab: int, max_positions: int):
    """A Qwen2 config: head_dim 16, grouped KV (2 query heads per KV head), MLP 2x wide.

    EOS is disabled (``eos_token_id=None``) so ``generate`` always makes ``max_new_tokens``.
    """
    from transformers import Qwen2Config

    if hidden % 16:
        raise ValueError(f"hidden={hidden} must be a multiple of 16 (head_dim 16)")
    heads = hidden // 16
    return Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        pad_token_id=PAD_ID,
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )


def save_tiny_qwen2(
    directory: Path,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 256,
    max_positions: int = 512,
    seed: int = 0,
):
    """Build a random float32 Qwen2ForCausalLM, save it (safetensors), and return it in eval mode.

    Norms and biases are perturbed (their defaults are ones and zeros), as in the tests' fixture.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_qwen2_config(hidden, layers, vocab, max_positions)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(directory, safe_serialization=True)
    return model
