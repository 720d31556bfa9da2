"""The PPO batch, and log-probs / values of response tokens from full sequences.

Rows and response-aligned columns follow ``oppo_jax.rollout.layout``.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer
from oppo_jax.rollout.layout import gather_response, response_tokens


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


def policy_logprobs(
    cfg: ModelConfig,
    params,
    tokens: Int[Array, "B L"],
    prompt_len: Int[Array, " B"],
    response_len: int,
    temperature: float,
) -> tuple[Float[Array, "B R"], Float[Array, "B R"]]:
    """log π(response token) under logits / temperature, and the per-token entropy (float32)."""
    logits, _ = Transformer(cfg).apply({"params": params}, tokens)
    logits = gather_response(logits, prompt_len, response_len).astype(jnp.float32) / temperature
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    targets = response_tokens(tokens, prompt_len, response_len)
    token_logp = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logprobs) * logprobs, axis=-1)
    return token_logp, entropy


def critic_values(
    cfg: ModelConfig, params, tokens: Int[Array, "B L"], prompt_len, response_len: int
) -> Float[Array, "B R"]:
    """V(state before each response token) from a score-head model (float32)."""
    out, _ = Transformer(cfg).apply({"params": params}, tokens)
    return gather_response(out[..., 0], prompt_len, response_len).astype(jnp.float32)
