"""Advantage estimators by name (``ppo.advantage``). Each says which models a run trains, and
so whether a critic exists anywhere (GAE needs its values; the GRPO family needs none), and
turns a batch's per-token rewards into advantages and returns. The rest of the run asks the
chosen one (``estimator(ppo)``), as Tunix's and verl's trainers ask theirs, instead of
checking for a critic; the update loops over ``UpdateSpec.trained``.

    gae:                             rewards (whitened if ``ppo.whiten_rewards``) -> GAE over
                                     the critic's values -> advantages whitened over the batch
    grpo | rloo | reinforce_pp:      Σ_t r_t per sequence (the score, less β·Σ_t KL_t when the
                                     KL is in the reward) -> ``token_advantages`` over groups
                                     of G rows; returns 0 (no critic to fit)

GAE's pieces (per-token rewards, KL penalties, whitening; TRL's semantics) come first, then the
critic-free advantages of the GRPO family, from the scores of whole groups (G responses to one
prompt, contiguous rows of the batch): one number per sequence, spread over its tokens by
``experience.build_batch``; TRL's formulas (``tests/test_grpo_trl_parity.py``).

    grpo:          A_i = (r_i − mean_g r) / (s + 1e-4), s = the group's std (scale "group"),
                   the batch's std ("batch"), or A_i = r_i − mean_g r ("none": Dr. GRPO)
    rloo:          A_i = r_i − (Σ_{j≠i} r_j) / (G − 1)                  (leave-one-out)
    reinforce_pp:  A_i = r_i − mean_g r, then whitened over the batch's valid tokens
                   (REINFORCE++ with a group baseline; ``masked_whiten``)
Standard deviations are unbiased (Bessel), as ``torch.std`` and TRL's ``nanstd``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Shaped

from oppo_jax.config.schema import PPOConfig
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


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
STD_EPS = 1e-4  # TRL's: added to the std, not under the root


def _std(x: Float[Array, "*dims"], axis=None) -> Float[Array, "..."]:
    """Unbiased standard deviation, over ``axis`` (kept, size 1) or all of ``x`` (a scalar);
    a single value's NaN is not reachable: G >= 2."""
    return jnp.std(x, axis=axis, ddof=1, keepdims=axis is not None)


def sequence_advantages(
    rewards: Float[Array, " B"], group_size: int, estimator: str, scale: str = "group"
) -> Float[Array, " B"]:
    """One advantage per sequence; rows ``[k·G, (k+1)·G)`` are group k. ``reinforce_pp``
    returns r − group mean here; its batch whitening needs the token mask (``token_advantages``)."""
    r = rewards.astype(jnp.float32)
    grouped = r.reshape(-1, group_size)
    mean = jnp.mean(grouped, axis=1, keepdims=True)
    if estimator == "rloo":
        baseline = (jnp.sum(grouped, axis=1, keepdims=True) - grouped) / (group_size - 1)
        return (grouped - baseline).reshape(-1)
    centred = (grouped - mean).reshape(-1)
    if estimator == "reinforce_pp" or scale == "none":
        return centred
    if estimator != "grpo":
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {GROUP_ESTIMATORS}")
    if scale == "group":
        std = jnp.broadcast_to(_std(grouped, axis=1), grouped.shape).reshape(-1)
    elif scale == "batch":
        std = _std(r)
    else:
        raise ValueError(f"unknown scale_rewards {scale!r}; expected group, batch or none")
    return centred / (std + STD_EPS)


def token_advantages(
    rewards: Float[Array, " B"],
    mask: Shaped[Array, "B T"],
    group_size: int,
    estimator: str,
    scale: str = "group",
) -> Float[Array, "B T"]:
    """Each sequence's advantage on its valid tokens (0 elsewhere); ``reinforce_pp``
    whitened over the batch's valid tokens."""
    per_seq = sequence_advantages(rewards, group_size, estimator, scale)
    tokens = jnp.where(mask, per_seq[:, None], 0.0)
    if estimator == "reinforce_pp":
        return masked_whiten(tokens, mask, shift_mean=True)
    return tokens


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One advantage estimator: its name, the models it trains, and its computation."""

    name: str  # its ``ppo.advantage`` value
    trained: tuple[str, ...]  # the models the update trains, in update order (actor first)
    # (ppo, rewards [B T], values [B T], mask [B T], group_size) -> (advantages, returns) [B T]
    compute: Callable

    @property
    def needs_critic(self) -> bool:
        """Whether the run has a critic: trained by the update, scoring every step's tokens."""
        return "critic" in self.trained

    def advantages(
        self,
        ppo: PPOConfig,
        rewards: Float[Array, "B T"],
        values: Float[Array, "B T"],
        mask: Shaped[Array, "B T"],
        group_size: int,
    ) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
        """(advantages, returns) of a batch's KL-penalised per-token ``rewards``; ``values``
        are the critic's (zeros without one), rows ``[k·G, (k+1)·G)`` are group k."""
        return self.compute(ppo, rewards, values, mask, group_size)


def _gae(ppo: PPOConfig, rewards, values, mask, group_size):
    """TRL's order: optional reward whitening, GAE, advantage whitening."""
    del group_size  # each sequence is its own episode
    if ppo.whiten_rewards:
        rewards = whiten_rewards(rewards, mask)
    advantages, returns = gae(rewards, values, mask, ppo.gamma, ppo.lam)
    return whiten_advantages(advantages, mask), returns


def _group(name: str, ppo: PPOConfig, rewards, values, mask, group_size):
    """The per-token rewards summed per sequence, then each group's to advantages."""
    del values  # critic-free
    sequence_reward = jnp.sum(rewards, axis=-1)
    advantages = token_advantages(sequence_reward, mask, group_size, name, ppo.scale_rewards)
    return advantages, jnp.zeros_like(advantages)


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator("gae", ("actor", "critic"), _gae),
    **{n: Estimator(n, ("actor",), functools.partial(_group, n)) for n in GROUP_ESTIMATORS},
}


def estimator(ppo: PPOConfig) -> Estimator:
    """The estimator ``ppo.advantage`` names."""
    try:
        return ESTIMATORS[ppo.advantage]
    except KeyError:
        known = ", ".join(ESTIMATORS)
        raise ValueError(
            f"unknown ppo.advantage {ppo.advantage!r}; expected one of {known}"
        ) from None
