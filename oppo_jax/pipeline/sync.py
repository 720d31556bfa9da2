"""The sync baseline (TRL's pipeline): generate all B responses, then score, then update."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.pipeline.kernels import Kernels


@dataclasses.dataclass
class PromptBatch:
    """B prompts right-padded to the rollout's prompt width, with their ids."""

    tokens: np.ndarray  # [B, P] int32
    lengths: np.ndarray  # [B] int32
    prompt_ids: np.ndarray  # [B] int64, unique per (epoch, prompt)

    @classmethod
    def from_pairs(cls, pairs, width: int, pad_id: int = 0) -> PromptBatch:
        tokens = np.full((len(pairs), width), pad_id, np.int32)
        lengths = np.zeros(len(pairs), np.int32)
        for i, (_, toks) in enumerate(pairs):
            tokens[i, : len(toks)] = toks
            lengths[i] = len(toks)
        return cls(tokens, lengths, np.asarray([pid for pid, _ in pairs], np.int64))


@dataclasses.dataclass
class StepResult:
    """What one step produced: new train state, device metrics, responses, stage timings."""

    train_state: object
    metrics: dict  # device scalars: rollout stats and update metrics
    responses: np.ndarray  # [B, R] response tokens (host copy, for gold scores and logs)
    response_len: np.ndarray  # [B]
    stage_time_s: dict  # wall time per stage


def generate(kernels: Kernels, params, prompts: PromptBatch, key, chunk_size: int):
    """Decode chunk after chunk until every row is finished (one small host read per chunk)."""
    state = kernels.start(
        params,
        jnp.asarray(prompts.tokens),
        jnp.asarray(prompts.lengths),
        jnp.asarray(prompts.prompt_ids, jnp.int32),
        jnp.zeros(len(prompts.lengths), jnp.int32),
        key,
    )
    decode = kernels.decode(chunk_size)
    while not bool(jnp.all(state.finished)):
        state = decode(params, state)
    return state


def sync_step(
    kernels: Kernels,
    train_state,
    ref_params,
    reward_params,
    prompts: PromptBatch,
    sample_key,
    update_key,
    kl_coef,
    chunk_size: int,
) -> StepResult:
    """One baseline step; stages run back to back, and each is timed to its completion."""
    times = {}
    t0 = time.perf_counter()
    decoded = generate(kernels, train_state.actor_params, prompts, sample_key, chunk_size)
    times["generate"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    batch, stats = kernels.experience(
        train_state, ref_params, reward_params, decoded,
        jnp.asarray(prompts.tokens), jnp.asarray(prompts.lengths), kl_coef,
    )  # fmt: skip
    jax.block_until_ready(batch)
    times["score"] = time.perf_counter() - t1
    responses, response_len = jax.device_get((decoded.tokens, decoded.num_generated))
    t2 = time.perf_counter()
    train_state, update_metrics = kernels.update(train_state, batch, update_key, kl_coef)
    jax.block_until_ready(update_metrics)
    times["update"] = time.perf_counter() - t2
    return StepResult(
        train_state, {**stats, **update_metrics}, np.asarray(responses), np.asarray(response_len),
        times,
    )  # fmt: skip
