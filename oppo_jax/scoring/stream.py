"""Streaming scorers: each keeps its own KV cache and prefills the actor's tokens chunk by chunk.

Three kinds of consumer share one mechanism. A model output at sequence position p belongs to
the token at p + 1, so each scorer keeps the output at the last position it has fed
(``last_out``); when a chunk of new tokens arrives, token i's quantity comes from the output
before it:
    logprob (reference):  log softmax(out / temperature)[token]   per response token
    value   (critic):     out[0]                                  per response token
    score   (reward):     out[0] at the last fed token            per sequence
Because every scorer is a causal decoder, chunked prefill equals one full forward pass, so the
streamed quantities equal those of the sync path (up to float rounding).

A spec with a ``mesh`` keeps the scorer's state (cache included) sharded along the slots over
that mesh's batch axes, like the actor's decode state (``oppo_jax.sharding.slot_shardings``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from oppo_jax.models.kv_cache import KVCache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.rollout.decode import ChunkTokens, admission_prefill, prefill
from oppo_jax.sharding import constrain_slots

ScorerKind = Literal["logprob", "value", "score"]


@dataclasses.dataclass(frozen=True)
class ScorerSpec:
    """Static description of one streaming scorer."""

    model: ModelConfig
    kind: ScorerKind
    response_len: int  # R, response capacity in tokens
    temperature: float = 1.0  # logits are divided by this (reference log-probs only)
    mesh: Mesh | None = None  # the scoring group's mesh: state sharded along the slots


@flax.struct.dataclass
class ScorerState:
    """A scorer's cache and what it has produced so far, for S slots."""

    cache: KVCache  # prompt + fed response tokens
    last_out: Float[Array, "S O"]  # head output at each slot's last fed position (float32)
    per_token: Float[Array, "S R"]  # log-prob or value per response token fed so far
    num_fed: Int[Array, " S"]  # response tokens consumed

    @property
    def score(self) -> Float[Array, " S"]:
        """The sequence score: the output at the last fed (last valid) token."""
        return self.last_out[:, 0]


def scorer_start(
    spec: ScorerSpec, params, prompts: Int[Array, "S P"], prompt_lens: Int[Array, " S"]
) -> ScorerState:
    """Prefill the prompts into a fresh cache sized for prompt + response."""
    none = jnp.zeros((prompts.shape[0],), jnp.int32)
    return scorer_admit(spec, params, prompts, prompt_lens, none, prompts.shape[1], 0)


def scorer_admit(
    spec: ScorerSpec,
    params,
    context: Int[Array, "S W"],
    prompt_lens: Int[Array, " S"],
    prefix_len: Int[Array, " S"],
    prompt_width: int,
    carried_rows: int | None = None,
) -> ScorerState:
    """Prefill prompt + carried partial response; the prefix's quantities come out at once.

    Only the first ``carried_rows`` slots may carry a prefix (None: any); the others are
    prefilled at the prompt width alone (see ``admission_prefill``).
    """
    cache, last_out, per_token = admission_prefill(
        spec.model, params, context, prompt_lens, prefix_len,
        functools.partial(_per_token, spec), prompt_width=prompt_width,
        response_len=spec.response_len, carried_rows=carried_rows, mesh=spec.mesh,
    )  # fmt: skip
    state = ScorerState(
        cache=cache, last_out=last_out, per_token=per_token, num_fed=prefix_len.astype(jnp.int32)
    )
    return constrain_slots(state, spec.mesh)


def _per_token(spec: ScorerSpec, before: Float[Array, "S C O"], tokens: Int[Array, "S C"]):
    if spec.kind == "logprob":
        logprobs = jax.nn.log_softmax(before / spec.temperature, axis=-1)
        return jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    return before[..., 0]


def score_chunk(spec: ScorerSpec, params, state: ScorerState, chunk: ChunkTokens) -> ScorerState:
    """Append one chunk of each slot's new tokens to the cache and record their quantities."""
    width = chunk.tokens.shape[1]
    out, cache = prefill(spec.model, params, state.cache, chunk.tokens, chunk.count)
    before = jnp.concatenate([state.last_out[:, None], out[:, :-1]], axis=1)
    rows = jnp.arange(chunk.tokens.shape[0])[:, None]
    offsets = jnp.arange(width)[None, :]
    at = jnp.where(
        offsets < chunk.count[:, None], state.num_fed[:, None] + offsets, spec.response_len
    )
    per_token = state.per_token
    if spec.kind != "score":
        per_token = per_token.at[rows, at].set(_per_token(spec, before, chunk.tokens), mode="drop")
    last = jnp.maximum(chunk.count - 1, 0)
    newest = jnp.take_along_axis(out, last[:, None, None], axis=1)[:, 0]
    new = ScorerState(
        cache=cache,
        last_out=jnp.where(chunk.count[:, None] > 0, newest, state.last_out),
        per_token=per_token,
        num_fed=state.num_fed + chunk.count,
    )
    return constrain_slots(new, spec.mesh)


@functools.cache
def make_scorer_kernels(spec: ScorerSpec):
    """(start, chunk) jitted for one scorer. ``chunk`` donates the state it replaces. Both
    also return a tiny fresh array that completes with them, so a timeline can wait on it
    after the state itself has been donated to the next call."""

    def start_with_marker(params, prompts, prompt_lens):
        state = scorer_start(spec, params, prompts, prompt_lens)
        return state, jnp.sum(state.last_out)

    def chunk_with_marker(params, state, chunk):
        new = score_chunk(spec, params, state, chunk)
        return new, jnp.sum(new.num_fed)

    return jax.jit(start_with_marker), jax.jit(chunk_with_marker, donate_argnums=(1,))


@functools.cache
def make_scorer_admit(spec: ScorerSpec, prompt_width: int):
    """``scorer_admit`` jitted, returning (state, marker) like the other scorer kernels;
    ``carried_rows`` is static (one compilation per bucket)."""

    def admit_with_marker(params, context, prompt_lens, prefix_len, carried_rows=None):
        state = scorer_admit(
            spec, params, context, prompt_lens, prefix_len, prompt_width, carried_rows
        )
        return state, jnp.sum(state.last_out)

    return jax.jit(admit_with_marker, static_argnames=("carried_rows",))
