"""Synthetic response lengths: a benchmarking device that fixes each response's length.

With ``rollout.length_sampler: lognormal`` every response gets a target length drawn from a
log-normal distribution, a pure function of (seed, prompt id, sample index): never of the
slot, the batch, the step or the chunk size, so chunk-size independence, Δ = 0 ``oppo`` =
``sync`` and exact resume all hold (a carried sequence gets the same target back because its
prompt id and sample index come back). The tokens are still sampled from the policy; only
EOS is steered: withheld before the target (its logits masked when sampling) and forced at
it. This lets a benchmark choose its regime (how long-tailed, how generation-bound) with any
model, trained or random. It is not a training method: the policy does not learn when to
stop, and the recorded behaviour log-prob of every token, EOS included, is the policy's own,
unmasked log-prob, which is exactly what the PPO update recomputes.

Parameterisation: median m and 99th percentile q give mu = ln m and
sigma = (ln q - ln m) / z_0.99 with z_0.99 = 2.3263; a draw is exp(mu + sigma * N(0, 1)),
rounded and clipped to [1, R].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from oppo_jax.rollout.sampling import SamplingConfig, sample_tokens

Z99 = 2.3263478740408408  # 99th percentile of the standard normal
# Folded into the run's sampling key before the prompt id, so the length draws have a stream
# of their own (token keys fold the prompt id first; prompt ids never reach this value).
LENGTH_STREAM = 0x7FFF_FFF1
NO_TARGET = 0  # target length of a slot whose EOS is left to the policy


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    """A log-normal length distribution by its median and 99th percentile, in tokens."""

    median: float  # median response length, tokens
    p99: float  # 99th-percentile response length, tokens (>= median)

    def __post_init__(self):
        if not 0 < self.median <= self.p99:
            raise ValueError(f"need 0 < median ({self.median}) <= p99 ({self.p99})")

    @property
    def mu(self) -> float:
        """Mean of the length's logarithm."""
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        """Standard deviation of the length's logarithm."""
        return (math.log(self.p99) - math.log(self.median)) / Z99


def target_lengths(
    spec: LengthSpec,
    base_key: jax.Array,
    prompt_id: Int[Array, " S"],
    sample_index: Int[Array, " S"],
    max_len: int,
) -> Int[Array, " S"]:
    """Each response's length in tokens (EOS included), in [1, ``max_len``].

    Example: median 48, p99 320, R = 512: about half the draws are <= 48, one in a hundred
    > 320, and none > 512 (the cap takes the rest of the tail).
    """
    stream = jax.random.fold_in(base_key, LENGTH_STREAM)

    def one(pid, sid):
        key = jax.random.fold_in(jax.random.fold_in(stream, pid), sid)
        return jax.random.normal(key, (), jnp.float32)

    z = jax.vmap(one)(prompt_id, sample_index)
    length = jnp.round(jnp.exp(spec.mu + spec.sigma * z))
    return jnp.clip(length, 1, max_len).astype(jnp.int32)


def sample_to_length(
    logits: Float[Array, "S V"],
    keys: jax.Array,
    sampling: SamplingConfig,
    target: Int[Array, " S"],
    position: Int[Array, " S"],
    eos_ids: tuple[int, ...],
) -> tuple[Int[Array, " S"], Float[Array, " S"]]:
    """Sample the token at response index ``position`` so the response ends at ``target``.

    Before the target the EOS logits are masked; at it (``position + 1 == target``) the token
    is the first EOS id. A slot with target ``NO_TARGET`` samples as the policy would. The
    returned log-prob is the policy's own, unmasked log-prob of the chosen token under
    softmax(logits / temperature): the behaviour log-prob the update recomputes.

    Example: target 3, eos (1,): positions 0 and 1 never sample 1, position 2 is 1.
    """
    logits = logits.astype(jnp.float32)
    eos = jnp.asarray(eos_ids, jnp.int32)
    is_eos = jnp.isin(jnp.arange(logits.shape[-1]), eos)[None, :]
    steered = target != NO_TARGET
    withhold = (steered & (position + 1 < target))[:, None] & is_eos
    token, _ = sample_tokens(jnp.where(withhold, -jnp.inf, logits), keys, sampling)
    token = jnp.where(steered & (position + 1 >= target), eos[0], token)
    scale = sampling.temperature if sampling.temperature > 0 else 1.0
    logprobs = jax.nn.log_softmax(logits / scale, axis=-1)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
