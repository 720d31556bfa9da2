"""From scored rollouts to a PPOBatch: KL-penalised rewards, then the advantages of the run's
estimator (``ppo.estimators``: GAE and whitening in TRL's order, or, critic-free, each
group's scores to advantages)."""

from __future__ import annotations

import functools

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from oppo_jax.config.schema import PPOConfig
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.estimators import apply_missing_eos_penalty, estimator, penalized_rewards
from oppo_jax.ppo.masked import masked_mean, masked_sum
from oppo_jax.ppo.update import UpdateSpec
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import Responses
from oppo_jax.rollout.layout import assemble_sequences, response_mask
from oppo_jax.rollout.spec import RolloutSpec
from oppo_jax.scoring.stream import ScorerOutputs


@flax.struct.dataclass
class ScoredRollout:
    """B finished sequences with everything the rollout measured of them (the batch's inputs)."""

    tokens: Int[Array, "B L"]  # prompt + response + padding, per row contiguous
    prompt_len: Int[Array, " B"]
    mask: Bool[Array, "B R"]  # valid response tokens
    scores: Float[Array, " B"]  # reward-model (or reward-function) score per sequence
    ended_with_eos: Bool[Array, " B"]  # False: the response hit the length cap
    old_logp: Float[Array, "B R"]  # log π_old of each token under this step's parameters
    behaviour_logp: Float[Array, "B R"]  # log-prob recorded when the token was sampled
    ref_logp: Float[Array, "B R"]  # reference log-probs (old_logp without a reference: KL 0)
    values: Float[Array, "B R"]  # critic values before each token (zeros without a critic)


def build_batch(
    ppo: PPOConfig, rollout: ScoredRollout, kl_coef: Float[Array, ""], group_size: int = 1
) -> tuple[PPOBatch, dict[str, Float[Array, ""]]]:
    """Rewards with the KL penalty -> the ``ppo.advantage`` estimator's advantages and returns
    (``estimators``): gae: (optional reward whitening) -> GAE -> advantage whitening; a group
    estimator: the score (less β·Σ_t KL_t when ``kl_in_reward``, as TRL's RLOO) ->
    ``estimators.token_advantages`` over groups of ``group_size`` rows.

    Returns the batch and rollout statistics: mean score, mean sequence KL (Σ_t KL_t,
    averaged over sequences), mean non-score reward, and the mean value.
    """
    r, mask = rollout, rollout.mask
    old_logp, ref_logp, values = r.old_logp, r.ref_logp, r.values
    scores = apply_missing_eos_penalty(r.scores, r.ended_with_eos, ppo.missing_eos_penalty)
    rewards, kl = penalized_rewards(
        scores, old_logp, ref_logp, mask, kl_coef, ppo.kl_estimator, ppo.kl_in_reward
    )
    advantages, returns = estimator(ppo).advantages(ppo, rewards, values, mask, group_size)
    batch = PPOBatch(
        tokens=r.tokens,
        prompt_len=r.prompt_len,
        mask=mask,
        old_logp=jnp.where(mask, old_logp, 0.0),
        behaviour_logp=jnp.where(mask, r.behaviour_logp, 0.0),
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


def batch_from_rollout(
    spec: UpdateSpec,
    rollout: RolloutSpec,
    decoded: Responses,
    rows: Int[Array, " B"],
    admission: Admission,
    scored: ScorerOutputs,
    kl_coef: Float[Array, ""],
) -> tuple[PPOBatch, dict[str, Float[Array, ""]]]:
    """Build the PPO batch from the selected slots ``rows`` [B] of a rollout.

    ``old_logp`` is each token's log-prob under this step's parameters: recorded when it was
    sampled this step, or recomputed by the admission prefill for a carried prefix (the
    quantity TRL recomputes after generation, without a second actor pass). The behaviour
    log-prob is the one recorded when the token was actually sampled, possibly steps ago.
    Only the prompt columns of ``admission.context`` are read.
    """
    take = functools.partial(jnp.take, indices=rows, axis=0)
    response, logprobs, resp_len = map(
        take, (decoded.tokens, decoded.logprobs, decoded.num_generated)
    )
    prompt_len, prefix_len = take(admission.prompt_len), take(admission.prefix_len)
    width = rollout.max_response_len
    prompts = take(admission.context)[:, : rollout.prompt_width]
    tokens = assemble_sequences(prompts, prompt_len, response, resp_len, rollout.pad_id)
    scores = take(scored.scores)  # the reward model's and the reward functions' (combined)
    last = jnp.take_along_axis(response, jnp.maximum(resp_len - 1, 0)[:, None], axis=1)
    ended_with_eos = (resp_len > 0) & jnp.isin(last[:, 0], jnp.asarray(rollout.eos_ids))
    in_prefix = jnp.arange(width)[None, :] < prefix_len[:, None]
    behaviour = jnp.where(in_prefix, take(admission.prefix_behaviour), logprobs)
    zeros = jnp.zeros_like(logprobs)  # no critic (a critic-free estimator)
    scored_rollout = ScoredRollout(
        tokens=tokens,
        prompt_len=prompt_len,
        mask=response_mask(resp_len, width),
        scores=scores,
        ended_with_eos=ended_with_eos,
        old_logp=logprobs,
        behaviour_logp=behaviour,
        ref_logp=logprobs if scored.ref_logp is None else take(scored.ref_logp),  # KL 0
        values=zeros if scored.values is None else take(scored.values),
    )
    batch, stats = build_batch(spec.ppo, scored_rollout, kl_coef, rollout.group_size)
    return batch, {**stats, "reward": jnp.mean(scores)}
