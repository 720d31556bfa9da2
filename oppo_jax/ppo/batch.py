"""The PPO batch, and log-probs / values of response tokens from full sequences.

Rows and response-aligned columns follow ``oppo_jax.rollout.layout``.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from oppo_jax.models.heads import VOCAB_BLOCK, apply_head, token_logprobs_and_entropy
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


def _hidden(cfg: ModelConfig, params, tokens, prompt_len, response_len: int) -> Array:
    """Final-normed hidden states at the positions whose outputs belong to response tokens."""
    hidden, _ = Transformer(cfg).apply({"params": params}, tokens, return_hidden=True)
    return gather_response(hidden, prompt_len, response_len)


def policy_logprobs(
    cfg: ModelConfig,
    params,
    tokens: Int[Array, "B L"],
    prompt_len: Int[Array, " B"],
    response_len: int,
    temperature: float,
    block: int = VOCAB_BLOCK,
) -> tuple[Float[Array, "B R"], Float[Array, "B R"]]:
    """log π(response token) under logits / temperature, and the per-token entropy (float32).

    The LM head runs at the B x R response positions only, in vocabulary blocks of ``block``
    columns: no [B, L, V] (or [B, R, V]) logits tensor exists, forward or backward.
    """
    hidden = _hidden(cfg, params, tokens, prompt_len, response_len)
    targets = response_tokens(tokens, prompt_len, response_len)
    rows = hidden.shape[0] * hidden.shape[1]
    logp, entropy = token_logprobs_and_entropy(
        cfg, params, hidden.reshape(rows, -1), targets.reshape(rows), temperature, block
    )
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)


def critic_values(
    cfg: ModelConfig, params, tokens: Int[Array, "B L"], prompt_len, response_len: int
) -> Float[Array, "B R"]:
    """V(state before each response token) from a score-head model (float32), with the score
    head applied at the response positions only."""
    hidden = _hidden(cfg, params, tokens, prompt_len, response_len)
    return apply_head(cfg, params, hidden)[..., 0].astype(jnp.float32)
