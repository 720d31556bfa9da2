"""From scored rollouts to a PPOBatch: KL-penalised rewards, GAE and whitening (TRL's order)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from oppo_jax.config import PPOConfig
from oppo_jax.ppo.advantages import (
    apply_missing_eos_penalty,
    gae,
    penalized_rewards,
    whiten_advantages,
    whiten_rewards,
)
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.masked import masked_mean, masked_sum


def build_batch(
    ppo: PPOConfig,
    tokens: Int[Array, "B L"],
    prompt_len: Int[Array, " B"],
    mask: Bool[Array, "B R"],
    scores: Float[Array, " B"],
    ended_with_eos: Bool[Array, " B"],
    old_logp: Float[Array, "B R"],
    behaviour_logp: Float[Array, "B R"],
    ref_logp: Float[Array, "B R"],
    values: Float[Array, "B R"],
    kl_coef: Float[Array, ""],
) -> tuple[PPOBatch, dict[str, Float[Array, ""]]]:
    """Rewards with the KL penalty -> (optional reward whitening) -> GAE -> advantage whitening.

    Returns the batch and rollout statistics: mean score, mean sequence KL (Σ_t KL_t,
    averaged over sequences), mean non-score reward, and the mean value.
    """
    scores = apply_missing_eos_penalty(scores, ended_with_eos, ppo.missing_eos_penalty)
    rewards, kl = penalized_rewards(
        scores, old_logp, ref_logp, mask, kl_coef, ppo.kl_estimator, ppo.kl_in_reward
    )
    if ppo.whiten_rewards:
        rewards = whiten_rewards(rewards, mask)
    advantages, returns = gae(rewards, values, mask, ppo.gamma, ppo.lam)
    advantages = whiten_advantages(advantages, mask)
    batch = PPOBatch(
        tokens=tokens,
        prompt_len=prompt_len,
        mask=mask,
        old_logp=jnp.where(mask, old_logp, 0.0),
        behaviour_logp=jnp.where(mask, behaviour_logp, 0.0),
        old_values=jnp.where(mask, values, 0.0),
        advantages=advantages,
        returns=returns,
        ref_logp=jnp.where(mask, ref_logp, 0.0),
        scores=scores,
    )
    stats = {
        "score": jnp.mean(scores),
        "kl": jnp.mean(masked_sum(kl, mask, axis=-1)),
        "non_score_reward": jnp.mean(masked_sum(-kl_coef * kl, mask, axis=-1)),
        "value_mean": masked_mean(values, mask),
    }
    return batch, stats
