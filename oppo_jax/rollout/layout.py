"""Sequence layout helpers: rows of prompt then response, and response-aligned views of them.

Each row holds one sequence contiguously: prompt (``prompt_len[b]`` tokens), then the
response, then padding: ``[B, L]``. Per-response-token quantities are stored response-aligned,
``[B, R]``: column i is response token i. A model output at sequence position p belongs to the
token at p + 1 (the logits at p predict it; the critic's value at p is the value of the state
in which it was chosen, as in TRL), so response token i reads position ``prompt_len[b] - 1 + i``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int


def response_positions(prompt_len: Int[Array, " B"], response_len: int) -> Int[Array, "B R"]:
    """Sequence positions whose outputs belong to response tokens 0..R-1.

    Example: prompt_len [2, 3], R = 3 -> [[1, 2, 3], [2, 3, 4]].
    """
    return prompt_len[:, None] - 1 + jnp.arange(response_len, dtype=jnp.int32)[None, :]


def response_tokens(tokens: Int[Array, "B L"], prompt_len, response_len: int) -> Array:
    """The response tokens [B, R] of contiguous rows (clipped positions past the row's end)."""
    pos = jnp.clip(response_positions(prompt_len, response_len) + 1, 0, tokens.shape[1] - 1)
    return jnp.take_along_axis(tokens, pos, axis=1)


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
