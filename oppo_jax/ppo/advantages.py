"""Per-token rewards, KL penalties and GAE advantages for PPO-RLHF (TRL semantics)."""

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Shaped

from oppo_jax.ppo.masked import Scalar, as_bool_mask, last_valid_index, masked_whiten

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(
    logp: Float[Array, "*dims"], ref_logp: Float[Array, "*dims"], estimator: KLEstimator
) -> Float[Array, "*dims"]:
    """Per-token estimate of KL(π ‖ π_ref) from log-probs of the sampled tokens.

    With d = logp − ref_logp (tokens sampled from π):
        k1 = d                                   (unbiased, can be negative)
        k2 = ½ d²                                (biased, low variance, ≥ 0)
        k3 = exp(−d) − 1 + d                     (unbiased, ≥ 0; Schulman's estimator)
    k3 is written exp(ref_logp − logp) − 1 − (ref_logp − logp) elsewhere.
    """
    d = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * jnp.square(d)
    if estimator == "k3":
        # expm1 keeps precision when d is small, which is the usual case.
        return jnp.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


def penalized_rewards(
    scores: Float[Array, " B"],
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    kl_coef: Scalar,
    estimator: KLEstimator = "k1",
    kl_in_reward: bool = True,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Per-token rewards r_t = −β·KL_t + 1[t = last valid]·score, and the per-token KL.

    Args:
        scores: reward-model score of each response.
        logp, ref_logp: log-probs of the response tokens under the policy and reference.
        mask: valid response tokens (nonzero = valid).
        kl_coef: β.
        estimator: which KL estimator (see `kl_estimate`).
        kl_in_reward: if False the KL term is left out of the reward (e.g. when it is a loss
            term instead); the KL is still returned.

    Returns:
        (rewards, kl), both [B, T] float32 and 0 where mask is 0. A row without valid tokens
        receives no score.
    """
    valid = as_bool_mask(mask)
    # Zero padded inputs first so garbage there (e.g. -inf log-probs) cannot leak in.
    kl = kl_estimate(jnp.where(valid, logp, 0.0), jnp.where(valid, ref_logp, 0.0), estimator)
    kl = jnp.where(valid, kl, 0.0)
    rewards = -jnp.asarray(kl_coef, jnp.float32) * kl if kl_in_reward else jnp.zeros_like(kl)
    at_last = jax.nn.one_hot(last_valid_index(mask), mask.shape[-1], dtype=jnp.float32)
    row_score = jnp.where(valid.any(axis=-1), scores.astype(jnp.float32), 0.0)
    return rewards + at_last * row_score[:, None], kl


def apply_missing_eos_penalty(
    scores: Float[Array, " B"], ended_with_eos: Bool[Array, " B"], penalty: float | None
) -> Float[Array, " B"]:
    """score − penalty for responses that did not end with EOS; unchanged if `penalty` is None."""
    scores = scores.astype(jnp.float32)
    if penalty is None:
        return scores
    return jnp.where(ended_with_eos, scores, scores - penalty)


def gae(
    rewards: Float[Array, "B T"],
    values: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    gamma: Scalar,
    lam: Scalar,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Generalised advantage estimation as a reverse `lax.scan` over time.

    With m_t the mask and V_T = A_T = m_T = 0:
        δ_t = r_t + γ · m_{t+1} · V_{t+1} − V_t
        A_t = m_t · (δ_t + γλ · m_{t+1} · A_{t+1})
        R_t = m_t · (A_t + V_t)
    so the value after the last valid token counts as zero (the episode ends there).

    Assumes each row's valid tokens are a prefix (right padding). A hole in the mask would
    act as an episode end, and tokens after it would start a new episode.

    Returns:
        (advantages, returns), [B, T] float32, 0 where mask is 0.
    """
    valid = as_bool_mask(mask)
    m = valid.astype(jnp.float32)
    r = jnp.where(valid, rewards.astype(jnp.float32), 0.0)
    v = jnp.where(valid, values.astype(jnp.float32), 0.0)
    gamma = jnp.asarray(gamma, jnp.float32)
    lam = jnp.asarray(lam, jnp.float32)

    def step(carry, xs):
        next_adv, next_value, next_m = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_m * next_value - v_t
        adv = m_t * (delta + gamma * lam * next_m * next_adv)
        return (adv, v_t, m_t), adv

    zeros = jnp.zeros(r.shape[:1], jnp.float32)
    _, adv_tb = jax.lax.scan(step, (zeros, zeros, zeros), (r.T, v.T, m.T), reverse=True)
    advantages = adv_tb.T
    returns = jnp.where(valid, advantages + v, 0.0)
    return advantages, returns


def whiten_advantages(
    advantages: Float[Array, "B T"], mask: Shaped[Array, "B T"]
) -> Float[Array, "B T"]:
    """(A − μ) · rsqrt(σ² + 1e-8) over valid tokens; 0 where mask is 0."""
    return masked_whiten(advantages, mask, shift_mean=True)


def whiten_rewards(rewards: Float[Array, "B T"], mask: Shaped[Array, "B T"]) -> Float[Array, "B T"]:
    """(r − μ) · rsqrt(σ² + 1e-8) + μ over valid tokens, as TRL's whiten_rewards; 0 if padded."""
    return masked_whiten(rewards, mask, shift_mean=False)
