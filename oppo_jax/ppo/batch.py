"""The PPO batch: what the experience kernel hands the update.

Rows and response-aligned columns follow ``oppo_jax.rollout.layout``.
"""

from __future__ import annotations

import flax.struct
from jaxtyping import Array, Bool, Float, Int


@flax.struct.dataclass
class PPOBatch:
    """B sequences ready for the update: tokens, rollout-time quantities and advantages."""

    tokens: Int[Array, "B L"]  # prompt + response + padding, per row contiguous
    prompt_len: Int[Array, " B"]  # prompt tokens at the start of each row
    mask: Bool[Array, "B R"]  # valid response tokens (a prefix of each row)
    old_logp: Float[Array, "B R"]  # log π_old(token) at rollout time (the proximal policy)
    behaviour_logp: Float[Array, "B R"]  # log-prob recorded when the token was sampled
    old_values: Float[Array, "B R"]  # critic values at rollout time
    advantages: Float[Array, "B R"]  # GAE advantages (whitened)
    returns: Float[Array, "B R"]  # advantages + values
    ref_logp: Float[Array, "B R"]  # reference log-probs (for a KL term in the loss)
    scores: Float[Array, " B"]  # sequence scores (after any missing-EOS penalty), for logs

    __no_type_check__ = True  # rebuilt with non-array leaves by tree maps (shardings, shapes)

    @property
    def response_len(self) -> int:
        return self.mask.shape[1]
