"""The compiled kernels every schedule dispatches, built once per run from static specs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from oppo_jax.pipeline.sequences import assemble_sequences, response_mask
from oppo_jax.ppo.batch import critic_values, policy_logprobs
from oppo_jax.ppo.experience import build_batch
from oppo_jax.ppo.update import UpdateSpec, ppo_update
from oppo_jax.rollout.decode import DecodeState, make_decode_chunk, make_start_decode
from oppo_jax.rollout.sampling import SamplingConfig

# reward_fn(reward_params, tokens [B, L], prompt_len [B], seq_len [B]) -> scores [B]; jittable.
RewardFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Static shape and sampling settings of the rollout."""

    sampling: SamplingConfig
    prompt_width: int  # P, prompts are right-padded to this many tokens (one compiled shape)
    max_response_len: int  # R, response capacity in tokens
    eos_ids: tuple[int, ...]  # token ids that end a response
    pad_id: int = 0  # padding token id


def full_experience(
    spec: UpdateSpec,
    rollout: RolloutSpec,
    reward_fn: RewardFn,
    state,
    ref_params,
    reward_params,
    decoded: DecodeState,
    prompts: jax.Array,
    prompt_len: jax.Array,
    kl_coef: jax.Array,
):
    """Score finished rollouts with full forward passes and build the PPO batch (sync path)."""
    width = rollout.max_response_len
    resp_len = decoded.num_generated
    tokens = assemble_sequences(prompts, prompt_len, decoded.tokens, resp_len, rollout.pad_id)
    mask = response_mask(resp_len, width)
    temp = spec.temperature
    old_logp, _ = policy_logprobs(spec.actor, state.actor_params, tokens, prompt_len, width, temp)
    ref_logp, _ = policy_logprobs(spec.actor, ref_params, tokens, prompt_len, width, temp)
    values = critic_values(spec.critic, state.critic_params, tokens, prompt_len, width)
    scores = reward_fn(reward_params, tokens, prompt_len, prompt_len + resp_len)
    last = jnp.take_along_axis(decoded.tokens, jnp.maximum(resp_len - 1, 0)[:, None], axis=1)
    ended_with_eos = (resp_len > 0) & jnp.isin(last[:, 0], jnp.asarray(rollout.eos_ids))
    batch, stats = build_batch(
        spec.ppo, tokens, prompt_len, mask, scores, ended_with_eos,
        old_logp=old_logp, behaviour_logp=decoded.logprobs, ref_logp=ref_logp, values=values,
        kl_coef=kl_coef,
    )  # fmt: skip
    return batch, {**stats, "reward": jnp.mean(scores)}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Jitted functions of one run: start a rollout, decode a chunk, score, update."""

    spec: UpdateSpec
    rollout: RolloutSpec
    start: Callable
    experience: Callable
    update: Callable

    def decode(self, chunk_size: int) -> Callable:
        """``decode_chunk`` for this chunk size (compiled on first use, then cached)."""
        return make_decode_chunk(self.spec.actor, self.rollout.sampling, chunk_size)


def build_kernels(
    spec: UpdateSpec, rollout: RolloutSpec, reward_fn: RewardFn, update: Callable | None = None
) -> Kernels:
    """Compile-once kernels; ``update`` defaults to a plain jit of ``ppo_update`` (one device)."""
    start = make_start_decode(spec.actor, rollout.max_response_len, rollout.eos_ids, rollout.pad_id)
    experience = jax.jit(functools.partial(full_experience, spec, rollout, reward_fn))
    if update is None:
        update = jax.jit(functools.partial(ppo_update, spec), donate_argnums=(0,))
    return Kernels(spec, rollout, start, experience, update)
