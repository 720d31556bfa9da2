"""Advantage estimators by name (``ppo.advantage``). Each says which models a run trains, and
so whether a critic exists anywhere (GAE needs its values; the GRPO family needs none), and
turns a batch's per-token rewards into advantages and returns. The rest of the run asks the
chosen one (``estimator(ppo)``), as Tunix's and verl's trainers ask theirs, instead of
checking for a critic; the update loops over ``UpdateSpec.trained``.

    gae:                             rewards (whitened if ``ppo.whiten_rewards``) -> GAE over
                                     the critic's values -> advantages whitened over the batch
    grpo | rloo | reinforce_pp:      Σ_t r_t per sequence (the score, less β·Σ_t KL_t when the
                                     KL is in the reward) -> ``group_advantages.token_advantages``
                                     over groups of G rows; returns 0 (no critic to fit)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from oppo_jax.config.schema import PPOConfig
from oppo_jax.ppo.advantages import gae, whiten_advantages, whiten_rewards
from oppo_jax.ppo.group_advantages import GROUP_ESTIMATORS, token_advantages


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
