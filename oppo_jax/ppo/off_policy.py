"""Off-policy corrections (``ppo.off_policy_correction``): tokens a carried sequence sampled
under an older policy weigh in the policy loss by their ratio ρ_t = π_old(t) / π_behaviour(t),
with π_old this step's log-probs and π_behaviour those recorded at sampling. Fresh tokens have
ρ_t = 1 exactly (their old log-prob is the sampling one). docs/NUMERICS.md maps the options to
verl's and TRL's names.

    none: w_t = 1
    tis:  w_t = min(ρ_t, importance_clip)                     token-level truncated IS
    mis:  w_t = 1[mis_lower <= ρ_i <= mis_upper]               sequence-level masked IS, with
          ρ_i = exp(clip(mean_{t in i} log ρ_t, -20, 20))      the geometric-mean sequence ratio
                                                               (verl's rollout_rs "geometric")

The weight is a constant (no gradient) on each token's clipped surrogate; the loss's
normaliser is unchanged (a masked sequence's tokens still count in it, as TRL's
``importance_sampling_ratio`` does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from oppo_jax.config.schema import PPOConfig
from oppo_jax.ppo.losses import TokenWeights, sequence_log_ratio
from oppo_jax.ppo.masked import as_bool_mask

CORRECTIONS = ("none", "tis", "mis")
# verl's bound on a log-ratio before exp (its SAFETY_BOUND): the sequence ratio stays finite.
LOG_RATIO_BOUND = 20.0


def correction_weight(
    ppo: PPOConfig,
    old_logp: Float[Array, "*tokens"],
    behaviour_logp: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    weights: TokenWeights | None = None,
) -> Float[Array, "*tokens"] | None:
    """Each token's weight w_t on the policy loss (module docstring; 0 on padding), or None
    for ``none``. A sequence is a row of [B, R] arrays or, packed (``weights``), the slots
    sharing a ``weights.segments`` id (``losses.sequence_log_ratio``).

    Example, one row with old − behaviour = [-0.9, -0.9, 0, pad] (two stale tokens, one fresh):
    tis at clip 2 -> [0.41, 0.41, 1, 0]; mis in [0.5, 2]: exp(-0.6) = 0.55 -> [1, 1, 1, 0].
    """
    correction = ppo.off_policy_correction
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {correction!r}; one of {CORRECTIONS}")
    if correction == "none":
        return None
    valid = as_bool_mask(mask)
    f32 = jnp.float32
    stale = jnp.where(valid, old_logp.astype(f32), 0.0) - jnp.where(
        valid, behaviour_logp.astype(f32), 0.0
    )  # log ρ_t
    if correction == "tis":
        weight = jnp.minimum(jnp.exp(stale), ppo.importance_clip)
    else:
        log_seq = sequence_log_ratio(stale, mask, "sequence", weights)  # mean over its tokens
        ratio = jnp.exp(jnp.clip(log_seq, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        weight = ((ratio >= ppo.mis_lower) & (ratio <= ppo.mis_upper)).astype(f32)
    return jax.lax.stop_gradient(jnp.where(valid, weight, 0.0))


# The counts' names among an update's metrics (``correction_counts``: the update's forward
# is π_old, so its chunks count them; ``finish_correction`` turns them into the metrics)
COUNT_PREFIX = "is_count/"


def correction_counts(
    ppo: PPOConfig,
    weight: Float[Array, "*tokens"],
    mask: Shaped[Array, "*tokens"],
    weights: TokenWeights | None = None,
) -> dict[str, Float[Array, ""]]:
    """The sums the correction's metrics are ratios of, over these tokens, each named
    ``COUNT_PREFIX`` + what it counts (none without a correction): valid tokens, their
    weights' sum and, for mis, the masked tokens, the sequences with a token and those with a
    masked token. A sequence is a row of [B, R] arrays, or in the packed layout a segment of
    ``weights.segments`` (mis sets them; a sequence's slots all sit in one chunk, so the
    chunks' sums add up)."""
    if ppo.off_policy_correction == "none":
        return {}
    f32, valid = jnp.float32, as_bool_mask(mask)
    counts = {"tokens": jnp.sum(valid, dtype=f32), "weight": jnp.sum(jnp.where(valid, weight, 0.0))}
    if ppo.off_policy_correction == "mis":
        masked = (weight == 0.0) & valid
        if weights is None or weights.segments is None:
            seq_masked, seq_has = masked.any(axis=-1), valid.any(axis=-1)
        else:
            ids, n = weights.segments, weights.num_segments
            seq_masked = jax.ops.segment_sum(masked.astype(f32), ids, n) > 0
            seq_has = jax.ops.segment_sum(valid.astype(f32), ids, n) > 0
        counts["masked_tokens"] = jnp.sum(masked, dtype=f32)
        counts["masked_seqs"] = jnp.sum(seq_masked, dtype=f32)
        counts["seqs"] = jnp.sum(seq_has, dtype=f32)
    return {COUNT_PREFIX + k: v.astype(f32) for k, v in counts.items()}


def counts_to_metrics(ppo: PPOConfig, counts: dict) -> dict[str, Float[Array, ""]]:
    """The correction's metrics from ``correction_counts`` (summed, or scaled alike):
    is_weight_mean = mean_t w_t over valid tokens; mis also is_masked_token_frac (tokens with
    w_t = 0) and is_masked_seq_frac (sequences with a token, masked). 0 over no token."""
    if not counts:
        return {}
    c = {k.removeprefix(COUNT_PREFIX): v for k, v in counts.items()}

    def ratio(num: str, den: str):  # 0 over nothing, as ``masked_mean``
        some = c[den] > 0
        return jnp.where(some, c[num] / jnp.where(some, c[den], 1.0), 0.0)

    metrics = {"is_weight_mean": ratio("weight", "tokens")}
    if ppo.off_policy_correction == "mis":
        metrics["is_masked_token_frac"] = ratio("masked_tokens", "tokens")
        metrics["is_masked_seq_frac"] = ratio("masked_seqs", "seqs")
    return metrics


def correction_metrics(
    ppo: PPOConfig,
    old_logp: Float[Array, "B R"],
    behaviour_logp: Float[Array, "B R"],
    mask: Shaped[Array, "B R"],
) -> dict[str, Float[Array, ""]]:
    """The correction's metrics over a batch's trained tokens (none: no metrics), with π_old
    the batch's ``old_logp`` (``counts_to_metrics``)."""
    weight = correction_weight(ppo, old_logp, behaviour_logp, mask)
    if weight is None:
        return {}
    return counts_to_metrics(ppo, correction_counts(ppo, weight, mask))


def finish_correction(ppo: PPOConfig, metrics: dict, batch) -> dict:
    """An update's ``metrics`` with the correction's: from the counts its chunks summed where
    its own forward is π_old (``PPOConfig.old_is_first_forward``: one optimizer step, so the
    counts are that step's sums, all scaled alike), else from the batch's ``old_logp``."""
    counts = {k: metrics.pop(k) for k in list(metrics) if k.startswith(COUNT_PREFIX)}
    if ppo.old_is_first_forward:
        return metrics | counts_to_metrics(ppo, counts)
    return metrics | correction_metrics(ppo, batch.old_logp, batch.behaviour_logp, batch.mask)
