"""Heads applied only where a value is needed, and LM log-probs computed in vocabulary blocks.

``Transformer(cfg).apply(..., return_hidden=True)`` gives the final-normed hidden states
[B T D]; these functions apply the head (LM, tied or not, or score) to the rows that need it.
At Qwen2.5's V = 152,064 a [rows, T, V] float32 logits tensor is tens of GiB, so the LM
log-probs never build one: ``token_logprobs_and_entropy`` walks the vocabulary in blocks of
``block`` columns with an online log-sum-exp, forward and backward (a custom VJP recomputes
each block's logits), so at most one [N, block] block of logits exists at a time.

Dimension letters: N rows (flattened positions), D model width, V vocabulary, O head outputs.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from oppo_jax.models.model_config import ModelConfig

# Vocabulary columns per block: at 8k rows a float32 block is 128 MiB.
VOCAB_BLOCK = 4096


def head_weight(cfg: ModelConfig, params) -> tuple[Array, int]:
    """The head matrix and its output axis: the tied embedding [V D] (axis 0), else a kernel
    [D O] (axis 1)."""
    if cfg.head == "lm" and cfg.tie_word_embeddings:
        return params["embed_tokens"]["embedding"], 0
    return params["lm_head" if cfg.head == "lm" else "score"]["kernel"], 1


def gather_rows(hidden: Float[Array, "B T D"], positions: Int[Array, "B R"]) -> Array:
    """Hidden states at per-row positions [B R D] (positions clipped into range).

    Example: positions [[0, 2]] picks hidden[0, 0] and hidden[0, 2].
    """
    pos = jnp.clip(positions, 0, hidden.shape[1] - 1)
    return jnp.take_along_axis(hidden, pos[..., None], axis=1)


def apply_head(
    cfg: ModelConfig, params, hidden: Float[Array, "*rows D"]
) -> Float[Array, "*rows O"]:
    """The head's outputs at these hidden states, computed as the Transformer's own head does
    (both operands in the activation dtype)."""
    weight, axis = head_weight(cfg, params)
    contract = ((hidden.ndim - 1,), (1 - axis,))
    return jax.lax.dot_general(
        hidden.astype(cfg.jnp_dtype), weight.astype(cfg.jnp_dtype), (contract, ((), ()))
    )


def token_logprobs_and_entropy(
    cfg: ModelConfig,
    params,
    hidden: Float[Array, "N D"],
    targets: Int[Array, " N"],
    temperature: float | Float[Array, ""] = 1.0,
    block: int = VOCAB_BLOCK,
) -> tuple[Float[Array, " N"], Float[Array, " N"]]:
    """log softmax(logits / temperature)[target] and the entropy of that softmax, per row.

    Both in float32; the head matmul accumulates in float32 (a bf16 head's logits are not
    rounded to bf16 first). Gradients flow to ``hidden`` and the head (tied or not).
    """
    if cfg.head != "lm":
        raise ValueError("token_logprobs_and_entropy needs an LM head")
    weight, axis = head_weight(cfg, params)
    block = min(block, weight.shape[axis])
    h, w = hidden.astype(cfg.jnp_dtype), weight.astype(cfg.jnp_dtype)
    temperature = jnp.asarray(temperature, jnp.float32)  # may be traced: no recompile per value
    return _blocked(h, w, targets.astype(jnp.int32), temperature, block, axis)


def _block_logits(h, w, j, temperature, block: int, axis: int):
    """Scaled float32 logits of vocabulary block j [N block], its columns, and which of them
    are new: the last block is shifted back to end at V, and re-visited columns are masked."""
    vocab = w.shape[axis]
    begin = j * block
    start = jnp.minimum(begin, vocab - block)
    w_blk = jax.lax.dynamic_slice_in_dim(w, start, block, axis=axis)
    dims = (((1,), (1 - axis,)), ((), ()))
    z = jax.lax.dot_general(h, w_blk, dims, preferred_element_type=jnp.float32) / temperature
    cols = start + jnp.arange(block, dtype=jnp.int32)
    return z, cols, cols >= begin, start


def _num_blocks(w, block: int, axis: int) -> int:
    return -(-w.shape[axis] // block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocked(h, w, targets, temperature, block: int, axis: int):
    return _blocked_fwd(h, w, targets, temperature, block, axis)[0]


def _blocked_fwd(h, w, targets, temperature, block: int, axis: int):
    """Online over blocks: running max m, s = sum exp(z - m), u = sum exp(z - m) (z - m).

    Then lse = m + log s and entropy = lse - E[z] = log s - u / s (shifted, so no cancellation
    between two numbers of size log V).
    """
    n = h.shape[0]

    def body(carry, j):
        m, s, u, tgt = carry
        z, cols, fresh, _ = _block_logits(h, w, j, temperature, block, axis)
        z = jnp.where(fresh, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        alpha = jnp.exp(m - m_new)
        shifted = z - m_new[:, None]
        e = jnp.exp(shifted)  # 0 at masked columns
        s_new = alpha * s + jnp.sum(e, axis=-1)
        u_new = alpha * (u + (m - m_new) * s) + jnp.sum(jnp.where(fresh, e * shifted, 0.0), -1)
        hit = fresh & (cols[None, :] == targets[:, None])
        tgt = tgt + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
        return (m_new, s_new, u_new, tgt), None

    # A finite start for m keeps (m - m_new) * s at 0 rather than -inf * 0 on the first block.
    zeros = jnp.zeros((n,), jnp.float32)
    init = (jnp.full((n,), jnp.finfo(jnp.float32).min), zeros, zeros, zeros)
    steps = jnp.arange(_num_blocks(w, block, axis), dtype=jnp.int32)
    (m, s, u, tgt), _ = jax.lax.scan(body, init, steps)
    lse = m + jnp.log(s)
    mean_z = lse - (jnp.log(s) - u / s)
    return (tgt - lse, jnp.log(s) - u / s), (h, w, targets, temperature, lse, mean_z)


def _blocked_bwd(block: int, axis: int, residuals, cotangents):
    """d logp / dz_j = [j = target] - p_j; d entropy / dz_j = -p_j (z_j - E[z]), per block."""
    h, w, targets, temperature, lse, mean_z = residuals
    g_logp, g_ent = cotangents
    dims_h = (((1,), (axis,)), ((), ()))  # dz [N blk] x w_blk -> [N D]
    dims_w = (((0,), (0,)), ((), ()))  # h [N D] x dz [N blk] -> [D blk]

    def body(carry, j):
        dh, dw = carry
        z, cols, fresh, start = _block_logits(h, w, j, temperature, block, axis)
        p = jnp.exp(z - lse[:, None])
        onehot = cols[None, :] == targets[:, None]
        dz = g_logp[:, None] * (onehot - p) - g_ent[:, None] * p * (z - mean_z[:, None])
        # Re-visited columns contribute nothing, so each weight column is written once.
        dz = jnp.where(fresh, dz, 0.0) / temperature
        w_blk = jax.lax.dynamic_slice_in_dim(w, start, block, axis=axis).astype(jnp.float32)
        dh = dh + jax.lax.dot_general(dz, w_blk, dims_h)
        dw_blk = jax.lax.dot_general(h.astype(jnp.float32), dz, dims_w)
        dw_blk = dw_blk.T if axis == 0 else dw_blk
        old = jax.lax.dynamic_slice_in_dim(dw, start, block, axis=axis)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_blk.astype(dw.dtype), start, axis)
        return (dh, dw), None

    # The head-sized gradient is laid out like the head itself (under active sharding rules),
    # not replicated on every device.
    head_axes = ("vocab", "embed") if axis == 0 else ("embed", "vocab")
    init = (
        jnp.zeros(h.shape, jnp.float32),
        nn.with_logical_constraint(jnp.zeros_like(w), head_axes),
    )
    steps = jnp.arange(_num_blocks(w, block, axis), dtype=jnp.int32)
    (dh, dw), _ = jax.lax.scan(body, init, steps)
    # No gradient for the targets (integers) or the temperature (a sampling setting).
    return dh.astype(h.dtype), dw, None, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def logprobs_at(
    cfg: ModelConfig,
    params,
    hidden: Float[Array, "*rows D"],
    targets: Int[Array, "*rows"],
    temperature: float | Float[Array, ""] = 1.0,
) -> Float[Array, "*rows"]:
    """log softmax(logits / temperature)[target] at hidden states of any leading shape, in
    vocabulary blocks (``token_logprobs_and_entropy``)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, _ = token_logprobs_and_entropy(cfg, params, flat, targets.reshape(-1), temperature)
    return logp.reshape(targets.shape)


def scores_at(cfg: ModelConfig, params, hidden: Float[Array, "*rows D"]) -> Float[Array, "*rows"]:
    """A score head's first output (value, reward) at hidden states, in float32."""
    return apply_head(cfg, params, hidden)[..., 0].astype(jnp.float32)
