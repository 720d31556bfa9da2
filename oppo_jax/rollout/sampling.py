"""Token sampling: temperature, top-k, top-p, greedy, and the per-token random key.

A sampled token's key depends only on (seed, prompt id, sample index, response position), so a
prompt's response never depends on the slot it sits in, the batch it shares, or the chunk size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn; hashable so it is a static argument of compiled kernels."""

    temperature: float = 0.7  # logits are divided by this before softmax (TRL default 0.7)
    top_k: int = 0  # keep only the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set of tokens with this much probability; 1 = off
    greedy: bool = False  # argmax instead of sampling

    def __post_init__(self):
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 unless greedy")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")


def token_keys(
    base_key: jax.Array,
    prompt_id: Int[Array, " S"],
    sample_index: Int[Array, " S"],
    position: Int[Array, " S"],
) -> jax.Array:
    """One key per row: fold (prompt id, sample index, response position) into the run's key."""

    def one(pid, sid, pos):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base_key, pid), sid), pos)

    return jax.vmap(one)(prompt_id, sample_index, position)


def _filter_top_k(logits: Float[Array, "S V"], k: int) -> Float[Array, "S V"]:
    kth = jax.lax.top_k(logits, k)[0][:, -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def _filter_top_p(logits: Float[Array, "S V"], p: float) -> Float[Array, "S V"]:
    """Drop tokens outside the nucleus: those whose more-likely predecessors already hold p."""
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    sorted_logits = jnp.where(mass_before >= p, -jnp.inf, sorted_logits)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(sorted_logits, inverse, axis=-1)


def sample_tokens(
    logits: Float[Array, "S V"], keys: jax.Array, cfg: SamplingConfig
) -> tuple[Int[Array, " S"], Float[Array, " S"]]:
    """Draw one token per row; also return its log-prob under softmax(logits / temperature).

    The recorded log-prob is that of the *untruncated* tempered distribution, which is what the
    PPO update recomputes (as TRL does); top-k/top-p only shape which token is drawn.
    """
    logits = logits.astype(jnp.float32)
    tempered = logits / (cfg.temperature if cfg.temperature > 0 else 1.0)
    if cfg.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        filtered = tempered
        if cfg.top_k > 0:
            filtered = _filter_top_k(filtered, min(cfg.top_k, logits.shape[-1]))
        if cfg.top_p < 1.0:
            filtered = _filter_top_p(filtered, cfg.top_p)
        tokens = jax.vmap(jax.random.categorical)(keys, filtered)
    logprobs = jax.nn.log_softmax(tempered, axis=-1)
    token_logprob = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), token_logprob
