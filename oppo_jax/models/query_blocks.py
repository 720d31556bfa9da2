"""Attention over blocks of queries: the result of one ``dot_product_attention`` call with only
one block's scores alive at a time.

XLA's attention (jax 0.10, ``implementation=None``, every backend without a fused kernel)
materialises the float32 scores and probabilities [S, H, T, Tc] of a call. At real sizes that
is the largest buffer of a program: a Qwen2.5-7B admission prefill of 120 rows with 512-token
prompts against a 1,536-column cache holds 120 x 28 x 512 x 1536 x 4 B = 9.9 GiB per tensor,
and the padded update's [4, 28, 1536, 1536] another 1 GiB per tensor and layer kept for the
backward. A query's softmax reads only its own row of scores, so splitting the queries into
blocks changes nothing of the result: each block attends to all keys with its own rows of
the mask. The blocks run in a ``lax.map`` whose body is rematerialised, so the backward also
holds one block's probabilities, not all of them.

Dimension letters: S rows, T queries, Tc keys, H query heads, K kv-heads, Dh head width,
Tb queries per block, Nb blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

# Bytes of float32 scores one block may hold ([S, H, Tb, Tc], global shapes: a sharded call
# holds a fraction of it per device). A call whose scores fit it runs unblocked.
SCORE_BUDGET_BYTES = 1 << 30
MIN_QUERY_BLOCK = 16  # fewer queries per block would make the matmuls too thin to pay


def query_block(rows: int, heads: int, queries: int, keys: int, budget: int) -> int:
    """Queries per block: all ``queries`` when their float32 scores fit ``budget`` bytes, else
    the largest power of two (at least ``MIN_QUERY_BLOCK``) whose scores do.

    Example: 120 rows, 28 heads, 512 queries, 1536 keys, 1 GiB -> 32 (0.62 GiB a block).
    """
    per_query = rows * heads * keys * 4
    if queries * per_query <= budget:
        return queries
    block = MIN_QUERY_BLOCK
    while block * 2 * per_query <= budget and block * 2 < queries:
        block *= 2
    return block


def attention(
    q: Float[Array, "S T H Dh"],
    k: Float[Array, "S Tc K Dh"],
    v: Float[Array, "S Tc K Dh"],
    mask: Bool[Array, "S 1 T Tc"] | None,
    causal: bool,
    budget: int | None = None,
) -> Float[Array, "S T H Dh"]:
    """``jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)`` over query blocks
    whose scores fit ``budget`` bytes (default ``SCORE_BUDGET_BYTES``, read when traced).
    ``causal`` counts query i and key j as in one sequence starting at 0 (key j <= i), as
    ``is_causal`` does; ``mask`` further restricts (segments, a cache's positions)."""
    s, t, h, dh = q.shape
    tc = k.shape[1]
    block = query_block(s, h, t, tc, SCORE_BUDGET_BYTES if budget is None else budget)
    if block >= t:
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=causal, implementation=None
        )
    blocks = -(-t // block)
    pad = blocks * block - t  # padded queries attend to every key; their rows are dropped
    q_blocks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_blocks = q_blocks.reshape(s, blocks, block, h, dh).swapaxes(0, 1)  # [Nb, S, Tb, H, Dh]
    if mask is None:
        mask = jnp.ones((s, 1, t, tc), bool)
    m_blocks = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=True)
    m_blocks = m_blocks.reshape(mask.shape[0], 1, blocks, block, tc).transpose(2, 0, 1, 3, 4)
    starts = jnp.arange(blocks, dtype=jnp.int32) * block

    @jax.checkpoint  # the backward recomputes a block's probabilities instead of keeping all
    def one_block(args):
        q_b, m_b, start = args
        if causal:
            query_pos = start + jnp.arange(block, dtype=jnp.int32)
            m_b = m_b & (jnp.arange(tc, dtype=jnp.int32)[None, :] <= query_pos[:, None])
        return jax.nn.dot_product_attention(q_b, k, v, mask=m_b, implementation=None)

    out = jax.lax.map(one_block, (q_blocks, m_blocks, starts))  # [Nb, S, Tb, H, Dh]
    return out.swapaxes(0, 1).reshape(s, blocks * block, h, dh)[:, :t]
