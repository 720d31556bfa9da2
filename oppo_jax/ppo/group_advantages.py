"""Critic-free advantages of the GRPO family, from the scores of whole groups (G responses to
one prompt, contiguous rows of the batch). Each is one number per sequence, spread over its
tokens by ``experience.build_batch``; TRL's formulas (``tests/test_grpo_trl_parity.py``).

    grpo:          A_i = (r_i − mean_g r) / (s + 1e-4), s = the group's std (scale "group"),
                   the batch's std ("batch"), or A_i = r_i − mean_g r ("none": Dr. GRPO)
    rloo:          A_i = r_i − (Σ_{j≠i} r_j) / (G − 1)                  (leave-one-out)
    reinforce_pp:  A_i = r_i − mean_g r, then whitened over the batch's valid tokens
                   (REINFORCE++ with a group baseline; ``masked_whiten``)
Standard deviations are unbiased (Bessel), as ``torch.std`` and TRL's ``nanstd``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from oppo_jax.ppo.masked import masked_whiten

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
