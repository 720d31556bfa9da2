"""Full-sequence scoring (the sync baseline): one forward pass per scorer after generation."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer


def reward_scores(
    cfg: ModelConfig, params, tokens: Int[Array, "B L"], seq_len: Int[Array, " B"]
) -> Float[Array, " B"]:
    """The reward model's score read at each row's last valid token (prompt + response)."""
    out, _ = Transformer(cfg).apply({"params": params}, tokens)
    last = jnp.maximum(seq_len - 1, 0)
    return jnp.take_along_axis(out[..., 0], last[:, None], axis=1)[:, 0].astype(jnp.float32)
