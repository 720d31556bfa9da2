"""Architecture description of a decoder transformer (Qwen2 / Llama family) and built-in presets."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

import oppo_jax.models.lora as lora

# Which head sits on the backbone: next-token logits (actor, reference) or a linear
# "score" layer (critic: applied at every token; reward model: read at the last valid token).
HeadKind = Literal["lm", "score"]

# What the backward pass keeps of each layer's forward: everything ("none"), only the layer's
# input ("full": the whole layer is recomputed), or the layer's weight matmul outputs ("dots").
Remat = Literal["none", "full", "dots"]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")

# Attention kernels (oppo_jax.models.attention): auto picks cuDNN on a GPU (the ragged kernel
# for decode steps), splash on a TPU.
ATTENTION_KERNELS = ("auto", "xla", "cudnn", "splash", "ragged")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one decoder; hashable so it can be a static jit argument."""

    vocab_size: int  # V, rows of the embedding table
    hidden_size: int  # D, width of the residual stream
    intermediate_size: int  # F, width of the SwiGLU hidden layer
    num_layers: int  # L, transformer blocks
    num_heads: int  # H, query heads
    num_kv_heads: int  # K, key/value heads (grouped-query attention when K < H)
    head_dim: int  # Dh, width of one head
    rope_theta: float = 10000.0  # base of the rotary frequencies
    rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm
    tie_word_embeddings: bool = False  # LM head reuses the embedding table
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False  # bias on the MLP projections (Llama mlp_bias)
    max_position_embeddings: int = 32768  # longest context the model was trained for, tokens
    head: HeadKind = "lm"  # which head the model carries
    num_labels: int = 1  # outputs of the score head
    pad_token_id: int | None = None  # padding id (used by HF sequence classifiers)
    model_type: str = "qwen2"  # Hugging Face model_type, kept for export
    dtype: str = "float32"  # activation dtype
    param_dtype: str = "float32"  # parameter dtype
    remat: Remat = "none"  # per-layer rematerialisation in the backward pass (see Remat)
    attention: str = "auto"  # kernel: auto | xla | cudnn | splash | ragged (models.attention)
    lora_rank: int = 0  # r, rank of the LoRA adapters (0 = no adapters; see models.lora)
    lora_alpha: float = 16.0  # adapters scale by lora_alpha / lora_rank
    lora_targets: tuple[str, ...] = lora.ALL_TARGETS  # projections that carry an adapter
    # with LoRA, an untied LM head (lm_head) is trained in full beside the adapters
    lora_train_head: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.head not in ("lm", "score"):
            raise ValueError(f"head={self.head!r}: expected 'lm' or 'score'")
        if self.remat not in ("none", "full", "dots"):
            raise ValueError(f"remat={self.remat!r}: expected 'none', 'full' or 'dots'")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r}: expected one of {ATTENTION_KERNELS}")
        unknown = set(self.lora_targets) - set(lora.ALL_TARGETS)
        if self.lora_rank < 0 or unknown:
            raise ValueError(
                f"lora_rank={self.lora_rank}, lora_targets={self.lora_targets}: the rank must be "
                f">= 0 and the targets among {lora.ALL_TARGETS}"
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected float32 or bfloat16")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no allocation)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d
        attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        block = attn + mlp + 2 * d
        head = 0 if self.head == "lm" and self.tie_word_embeddings else d * self.head_out
        return v * d + self.num_layers * block + d + head

    @property
    def head_out(self) -> int:
        return self.vocab_size if self.head == "lm" else self.num_labels


# Built-in architectures: two small ones for random-weight runs on any machine (``tiny`` for
# tests, ``small`` about 25M parameters), and those of real checkpoints, for random-weight
# benchmarks and abstract shape checks (no weights needed).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, qkv_bias=True, max_position_embeddings=4096,
    ),
    "small": ModelConfig(
        vocab_size=8192, hidden_size=384, intermediate_size=1024, num_layers=12, num_heads=6,
        num_kv_heads=2, head_dim=64, qkv_bias=True, max_position_embeddings=4096,
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "qwen2.5-3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
        num_heads=16, num_kv_heads=2, head_dim=128, rope_theta=1e6, tie_word_embeddings=True,
        qkv_bias=True,
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6, qkv_bias=True,
    ),
    # Qwen2.5-Math-7B: Qwen2.5-7B's layout, a 4K context and rotary base 10^4
    "qwen2.5-math-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e4, qkv_bias=True,
        max_position_embeddings=4096,
    ),
    "qwen2.5-32b": ModelConfig(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
        num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1e6, qkv_bias=True,
    ),
}  # fmt: skip


def preset(name: str, **changes: Any) -> ModelConfig:
    """A built-in architecture by name, with optional field changes (e.g. head="score")."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**changes)
