"""PPO policy, value and entropy losses as pure float32 functions of masked per-token arrays:
padded [B, T] rows, or the packed update's [N] response slots (with ``TokenWeights``). The
policy ratio is per token (``policy_loss``) or one per sequence (``sequence_policy_loss``:
GSPO's, and TRL RLOOTrainer's)."""

from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from oppo_jax.ppo.masked import Scalar, as_bool_mask, masked_mean

Aggregation = Literal["token_mean", "seq_mean", "dr_grpo", "dapo"]
AGGREGATIONS = ("token_mean", "seq_mean", "dr_grpo", "dapo")
# ``ppo.importance_sampling_level``: the policy ratio's level
RatioLevel = Literal["token", "sequence", "sequence_sum"]


@flax.struct.dataclass
class TokenWeights:
    """The packed update's per-token weights [N] (``oppo_jax.ppo.packing``): a packed chunk
    holds tokens of several microbatches, so each reduction is a weighted sum whose weights
    the host computed from the lengths, equal to what the padded update's per-microbatch
    means give each token (0 on unused slots)."""

    loss: Float[Array, " N"]  # the loss aggregation's (``packing.token_weights``)
    mean: Float[Array, " N"]  # a masked token mean's (the metrics)
    # A sequence-level ratio's: each slot's sequence, an id < num_segments (the packed update's
    # ``PackIndices.resp_seg``); None where the ratio is per token.
    segments: Int[Array, " N"] | None = None
    num_segments: int = flax.struct.field(pytree_node=False, default=0)


def _mean(x, mask, weights: TokenWeights | None) -> Float[Array, ""]:
    """``masked_mean(x, mask)``, or its packed form: Σ weights.mean · x over valid tokens."""
    if weights is None:
        return masked_mean(x, mask)
    return jnp.sum(jnp.where(as_bool_mask(mask), weights.mean * x.astype(jnp.float32), 0.0))


def aggregate(
    per_token: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    agg: Aggregation,
    weights: TokenWeights | None = None,
) -> Float[Array, ""]:
    """Reduce a per-token loss to a scalar.

    token_mean: Σ_{b,t} m·ℓ / Σ_{b,t} m                (every valid token weighs the same)
    seq_mean:   mean over sequences with ≥ 1 valid token of (Σ_t m·ℓ / Σ_t m)
    dr_grpo:    Σ_{b,t} m·ℓ / (B · T)                   (a constant: Dr. GRPO)
    dapo:       Σ_{b,t} m·ℓ / Σ_{b,t} m over the whole minibatch (here: these rows)
    A sequence is a row of [B, T] arrays. With ``weights`` (the packed layout) the same
    reduction is Σ weights.loss · ℓ over valid tokens: the host folded the counts in.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; expected one of {AGGREGATIONS}")
    if weights is not None:
        valid = as_bool_mask(mask)
        return jnp.sum(jnp.where(valid, weights.loss * per_token.astype(jnp.float32), 0.0))
    if agg in ("token_mean", "dapo"):
        return masked_mean(per_token, mask)
    if agg == "dr_grpo":
        valid = as_bool_mask(mask)
        return jnp.sum(jnp.where(valid, per_token.astype(jnp.float32), 0.0)) / valid.size
    row_mean = masked_mean(per_token, mask, axis=-1)
    return masked_mean(row_mean, as_bool_mask(mask).any(axis=-1))


def _valid_f32(
    x: Float[Array, "*tokens"], valid: Shaped[Array, "*tokens"]
) -> Float[Array, "*tokens"]:
    # Zeroing padding before any exp/square keeps NaN/inf out of both values and gradients.
    return jnp.where(valid, x.astype(jnp.float32), 0.0)


def _clip_bounds(cliprange: Scalar | tuple[Scalar, Scalar]):
    """(ε_low, ε_high) as float32 scalars from ε or (ε_low, ε_high)."""
    low, high = cliprange if isinstance(cliprange, tuple) else (cliprange, cliprange)
    return jnp.asarray(low, jnp.float32), jnp.asarray(high, jnp.float32)


def _surrogate(ratio, adv, cliprange) -> Float[Array, "*tokens"]:
    """PPO's clipped per-token loss max(−A · r, −A · clip(r, 1 − ε_low, 1 + ε_high))."""
    low, high = _clip_bounds(cliprange)
    return jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high))


def _ratio_metrics(ratio, log_ratio, cliprange, mask, weights) -> dict[str, Float[Array, ""]]:
    """clipfrac, approx_kl and ratio_mean of ``policy_loss`` (masked token means, no gradient)."""
    low, high = _clip_bounds(cliprange)
    ratio_sg = jax.lax.stop_gradient(ratio)
    if isinstance(cliprange, tuple):
        outside = (ratio_sg < 1.0 - low) | (ratio_sg > 1.0 + high)
    else:  # PPO's symmetric range, as it always read
        outside = jnp.abs(ratio_sg - 1.0) > low
    clipped = outside.astype(jnp.float32)
    return {
        "clipfrac": _mean(clipped, mask, weights),
        "approx_kl": _mean(0.5 * jnp.square(jax.lax.stop_gradient(log_ratio)), mask, weights),
        "ratio_mean": _mean(ratio_sg, mask, weights),
    }


def policy_loss(
    logp: Float[Array, "*tokens"],
    old_logp: Float[Array, "*tokens"],
    advantages: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    cliprange: Scalar | tuple[Scalar, Scalar],
    agg: Aggregation = "token_mean",
    is_weight: Float[Array, "*tokens"] | None = None,
    weights: TokenWeights | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Clipped PPO surrogate, optionally weighted per token by an off-policy correction.

    With r = exp(logp − old_logp) and cliprange ε or (ε_low, ε_high) (DAPO's clip-higher):
        ℓ_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − ε_low, 1 + ε_high))
        loss = agg(w_t · ℓ_t)
    where w_t = 1, or ``is_weight`` (constant: ``off_policy.correction_weight``, which corrects
    for tokens sampled by an older, behaviour, policy than the proximal ``old_logp``). The
    aggregation's normaliser is the same with or without it (TRL's convention).

    Returns:
        (loss, aux) with aux (masked token means, no gradient):
        clipfrac = mean(r outside [1 − ε_low, 1 + ε_high]), approx_kl = mean(½ (logp − old_logp)²),
        ratio_mean = mean(r).
    """
    valid = as_bool_mask(mask)
    log_ratio = _valid_f32(logp, valid) - _valid_f32(old_logp, valid)
    ratio = jnp.exp(log_ratio)
    per_token = _surrogate(ratio, _valid_f32(advantages, valid), cliprange)
    if is_weight is not None:
        per_token = is_weight * per_token
    loss = aggregate(per_token, mask, agg, weights)
    return loss, _ratio_metrics(ratio, log_ratio, cliprange, mask, weights)


def sequence_log_ratio(
    log_ratio: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    level: RatioLevel,
    weights: TokenWeights | None = None,
) -> Float[Array, "*tokens"]:
    """Each valid token's log of its sequence's ratio (0 on padding):

    sequence:      Σ_t m_t · δ_t / max(Σ_t m_t, 1)   (GSPO: TRL's importance_sampling_level
                                                      "sequence", the length-normalised ratio)
    sequence_sum:  Σ_t m_t · δ_t                     (TRL RLOOTrainer's: the summed log-ratio)
    with δ_t = logp_t − old_logp_t (``log_ratio``). A sequence is a row of [B, T] arrays, or,
    packed (``weights``), the slots sharing a ``weights.segments`` id, wherever they sit.

    Example, one row [0.1, 0.3, 0.2, pad]: sequence → [0.2, 0.2, 0.2, 0];
    sequence_sum → [0.6, 0.6, 0.6, 0].
    """
    if level not in ("sequence", "sequence_sum"):
        raise ValueError(f"unknown sequence-level ratio {level!r}; expected sequence|sequence_sum")
    valid = as_bool_mask(mask)
    delta = _valid_f32(log_ratio, valid)
    count = valid.astype(jnp.float32)
    if weights is None:  # a row is a sequence
        total = jnp.sum(delta, axis=-1, keepdims=True)
        count = jnp.sum(count, axis=-1, keepdims=True)
    else:  # a segment sum over each sequence's slots, read back at every slot
        if weights.segments is None:
            raise ValueError("a packed sequence-level ratio needs weights.segments (each slot's)")
        seg, n = weights.segments, weights.num_segments
        total = jax.ops.segment_sum(delta, seg, num_segments=n)[seg]
        count = jax.ops.segment_sum(count, seg, num_segments=n)[seg]
    if level == "sequence":
        total = total / jnp.maximum(count, 1.0)
    return jnp.where(valid, total, 0.0)


def sequence_policy_loss(
    logp: Float[Array, "*tokens"],
    old_logp: Float[Array, "*tokens"],
    advantages: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    cliprange: Scalar | tuple[Scalar, Scalar],
    agg: Aggregation,
    level: RatioLevel,
    weights: TokenWeights | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Clipped surrogate with one ratio per sequence, on each of its tokens.

    With s_i = exp(``sequence_log_ratio``) of sequence i (differentiated through its sum):
        ℓ_t = max(−A_t · s_i, −A_t · clip(s_i, 1 − ε_low, 1 + ε_high))   for t in sequence i
        loss = agg(ℓ_t)
    The critic-free advantages are one per sequence, so ℓ_t = ℓ_i: with agg seq_mean the loss
    is mean_i ℓ_i, TRL's GSPO (loss_type "grpo") for ``sequence`` and TRL RLOOTrainer's loss
    for ``sequence_sum``; token_mean, dr_grpo and dapo weigh ℓ_i by the sequence's tokens, as
    TRL's bnpo, dr_grpo and dapo do with importance_sampling_level "sequence".

    Returns:
        (loss, aux) as ``policy_loss``'s, with r the sequence's ratio s_i on each token
        (approx_kl stays the per-token ½ (logp − old_logp)²).
    """
    valid = as_bool_mask(mask)
    token_log_ratio = _valid_f32(logp, valid) - _valid_f32(old_logp, valid)
    ratio = jnp.exp(sequence_log_ratio(token_log_ratio, mask, level, weights))
    per_token = _surrogate(ratio, _valid_f32(advantages, valid), cliprange)
    loss = aggregate(per_token, mask, agg, weights)
    return loss, _ratio_metrics(ratio, token_log_ratio, cliprange, mask, weights)


def value_loss(
    values: Float[Array, "*tokens"],
    old_values: Float[Array, "*tokens"],
    returns: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    cliprange_value: Scalar,
    agg: Aggregation = "token_mean",
    weights: TokenWeights | None = None,
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
    loss = 0.5 * aggregate(jnp.maximum(unclipped, clipped), mask, agg, weights)
    clip_used = jax.lax.stop_gradient(clipped > unclipped).astype(jnp.float32)
    return loss, {"vf_clipfrac": _mean(clip_used, mask, weights)}


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
