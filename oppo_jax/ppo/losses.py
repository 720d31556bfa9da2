"""PPO policy, value and entropy losses as pure float32 functions of masked per-token arrays:
padded [B, T] rows, or the packed update's [N] response slots (with ``segments``)."""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from oppo_jax.ppo.masked import Scalar, as_bool_mask, masked_mean

Aggregation = Literal["token_mean", "seq_mean"]


# Packed per-token arrays [N] name their sequence instead of holding one per row:
# (segment id of each token [N], number of sequences m); ids >= m mark unused slots.
Segments = tuple[Int[Array, " N"], int]


def aggregate(
    per_token: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    agg: Aggregation,
    segments: Segments | None = None,
) -> Float[Array, ""]:
    """Reduce a per-token loss to a scalar.

    token_mean: Σ_{b,t} m·ℓ / Σ_{b,t} m                (every valid token weighs the same)
    seq_mean:   mean over sequences with ≥ 1 valid token of (Σ_t m·ℓ / Σ_t m)
    A sequence is a row of [B, T] arrays, or with ``segments`` the tokens of one segment id
    (the packed layout, ``oppo_jax.ppo.packing``).
    """
    if agg == "token_mean":
        return masked_mean(per_token, mask)
    if agg == "seq_mean":
        if segments is None:
            row_mean = masked_mean(per_token, mask, axis=-1)
            return masked_mean(row_mean, as_bool_mask(mask).any(axis=-1))
        ids, num = segments
        valid = as_bool_mask(mask)
        x = jnp.where(valid, per_token.astype(jnp.float32), 0.0)
        row_sum = jax.ops.segment_sum(x, ids, num + 1)[:num]  # id m: unused slots, dropped
        row_count = jax.ops.segment_sum(valid.astype(jnp.float32), ids, num + 1)[:num]
        row_mean = row_sum / jnp.maximum(row_count, 1.0)
        return masked_mean(row_mean, row_count > 0)
    raise ValueError(f"unknown aggregation {agg!r}; expected 'token_mean' or 'seq_mean'")


def _valid_f32(
    x: Float[Array, "*tokens"], valid: Shaped[Array, "*tokens"]
) -> Float[Array, "*tokens"]:
    # Zeroing padding before any exp/square keeps NaN/inf out of both values and gradients.
    return jnp.where(valid, x.astype(jnp.float32), 0.0)


def policy_loss(
    logp: Float[Array, "*tokens"],
    old_logp: Float[Array, "*tokens"],
    advantages: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    cliprange: Scalar,
    agg: Aggregation = "token_mean",
    behaviour_logp: Float[Array, "*tokens"] | None = None,
    is_clip: float | None = None,
    segments: Segments | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Clipped PPO surrogate, optionally with a truncated importance weight (decoupled PPO).

    With r = exp(logp − old_logp) and ε = cliprange:
        ℓ_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − ε, 1 + ε))
        loss = agg(w_t · ℓ_t)
    where w_t = 1, or, when both `behaviour_logp` and `is_clip` are given,
        w_t = stop_gradient(min(exp(old_logp − behaviour_logp), is_clip))
    corrects for tokens sampled by an older (behaviour) policy than the proximal `old_logp`.

    Returns:
        (loss, aux) with aux (masked token means, no gradient):
        clipfrac = mean(|r − 1| > ε), approx_kl = mean(½ (logp − old_logp)²),
        ratio_mean = mean(r), and is_weight_mean = mean(w) when the correction is on.
    """
    valid = as_bool_mask(mask)
    log_ratio = _valid_f32(logp, valid) - _valid_f32(old_logp, valid)
    ratio = jnp.exp(log_ratio)
    adv = _valid_f32(advantages, valid)
    eps = jnp.asarray(cliprange, jnp.float32)
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - eps, 1.0 + eps))

    aux = {}
    if behaviour_logp is not None and is_clip is not None:
        stale = _valid_f32(old_logp, valid) - _valid_f32(behaviour_logp, valid)
        weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(stale), is_clip))
        per_token = weight * per_token
        aux["is_weight_mean"] = masked_mean(weight, mask)

    loss = aggregate(per_token, mask, agg, segments)
    ratio_sg = jax.lax.stop_gradient(ratio)
    aux["clipfrac"] = masked_mean((jnp.abs(ratio_sg - 1.0) > eps).astype(jnp.float32), mask)
    aux["approx_kl"] = masked_mean(0.5 * jnp.square(jax.lax.stop_gradient(log_ratio)), mask)
    aux["ratio_mean"] = masked_mean(ratio_sg, mask)
    return loss, aux


def value_loss(
    values: Float[Array, "*tokens"],
    old_values: Float[Array, "*tokens"],
    returns: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    cliprange_value: Scalar,
    agg: Aggregation = "token_mean",
    segments: Segments | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Clipped value loss.

    With ε_v = cliprange_value and V_clip = V_old + clip(V − V_old, −ε_v, ε_v):
        loss = ½ · agg(max((V − R)², (V_clip − R)²))

    Returns:
        (loss, aux) with aux vf_clipfrac = masked mean of 1[(V_clip − R)² > (V − R)²], the
        fraction of tokens where the clipped branch is the one used (as TRL reports it).
    """
    valid = as_bool_mask(mask)
    v = _valid_f32(values, valid)
    v_old = _valid_f32(old_values, valid)
    ret = _valid_f32(returns, valid)
    eps = jnp.asarray(cliprange_value, jnp.float32)
    v_clipped = v_old + jnp.clip(v - v_old, -eps, eps)
    unclipped = jnp.square(v - ret)
    clipped = jnp.square(v_clipped - ret)
    loss = 0.5 * aggregate(jnp.maximum(unclipped, clipped), mask, agg, segments)
    clip_used = jax.lax.stop_gradient(clipped > unclipped).astype(jnp.float32)
    return loss, {"vf_clipfrac": masked_mean(clip_used, mask)}


def entropy_from_logits(
    logits: Float[Array, "B T V"], mask: Shaped[Array, "B T"], agg: Aggregation = "token_mean"
) -> tuple[Float[Array, "B T"], Float[Array, ""]]:
    """Entropy of the next-token distribution: H_t = −Σ_v p_v log p_v, p = softmax(logits_t).

    Returns:
        (entropy [B, T] float32, 0 where mask is 0; its aggregate under `agg`).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    # p · log p → 0 as p → 0; guard the -inf·0 of masked-out vocabulary entries.
    entropy = -jnp.sum(jnp.where(p > 0.0, p * logp, 0.0), axis=-1)
    entropy = jnp.where(as_bool_mask(mask), entropy, 0.0)
    return entropy, aggregate(entropy, mask, agg)
