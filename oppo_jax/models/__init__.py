"""Decoder transformer models, their KV cache, and Hugging Face import/export."""

from oppo_jax.models.kv_cache import KVCache, init_cache
from oppo_jax.models.model_config import PRESETS, ModelConfig, preset
from oppo_jax.models.transformer import Transformer, init_params

__all__ = [
    "KVCache",
    "ModelConfig",
    "PRESETS",
    "Transformer",
    "init_cache",
    "init_params",
    "preset",
]
