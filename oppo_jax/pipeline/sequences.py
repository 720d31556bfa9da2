"""Joining prompts and responses into contiguous rows for scoring and training."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int


def assemble_sequences(
    prompts: Int[Array, "B P"],
    prompt_len: Int[Array, " B"],
    response: Int[Array, "B R"],
    response_len: Int[Array, " B"],
    pad_id: int = 0,
) -> Int[Array, "B L"]:
    """Rows of prompt then response then padding, L = P + R.

    Example: prompts [[5, 6, 0]], prompt_len [2], response [[7, 8, 0]], response_len [2]
    -> [[5, 6, 7, 8, 0, 0]].
    """
    batch, width = prompts.shape
    resp_width = response.shape[1]
    total = width + resp_width
    rows = jnp.arange(batch)[:, None]
    out = jnp.full((batch, total), pad_id, jnp.int32)
    cols = jnp.arange(width)[None, :]
    prompt_at = jnp.where(cols < prompt_len[:, None], cols, total)  # padding: dropped
    out = out.at[rows, prompt_at].set(prompts, mode="drop")
    rcols = jnp.arange(resp_width)[None, :]
    resp_at = jnp.where(rcols < response_len[:, None], prompt_len[:, None] + rcols, total)
    return out.at[rows, resp_at].set(response, mode="drop")


def response_mask(response_len: Int[Array, " B"], width: int) -> Array:
    """Valid response tokens as a prefix mask. Example: [2, 0], width 3 -> [[1,1,0],[0,0,0]]."""
    return jnp.arange(width)[None, :] < response_len[:, None]
