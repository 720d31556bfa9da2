"""Streaming scorers: each keeps its own KV cache and prefills the actor's tokens chunk by chunk.

Three kinds of consumer share one mechanism. A model output at sequence position p belongs to
the token at p + 1, so each scorer keeps the final hidden state at the last position it has
fed (``last_hidden``); when a chunk of new tokens arrives, token i's quantity comes from the
hidden state h before it, with the head applied only there (``oppo_jax.models.heads``):
    logprob (reference):  log softmax(head(h) / temperature)[token]   per response token,
                          over the vocabulary in blocks (no [S, C, V] logits)
    value   (critic):     head(h)[0]                                  per response token
    score   (reward):     head(h)[0] at the last fed token            per sequence
Because every scorer is a causal decoder, chunked prefill equals one full forward pass, so the
streamed quantities equal those of the sync path (up to float rounding).

A spec with a ``mesh`` keeps the scorer's state (cache included) sharded along the slots over
that mesh's batch axes, like the actor's decode state (``parallel.sharding.slot_shardings``).

At real widths (``score_packed_chunk``): ``score_chunk`` feeds a chunk as one [S, C] call, so a
finished slot, and every column past a slot's count, costs as much as a real token. Instead the
host, which reads the chunk's counts [S] (one small transfer beside the decode loop's one flag),
deals the slots with new tokens to calls of one fixed budget (``shapes.chunk_groups``: N rows,
M tokens, ``shapes.chunk_budget``) and plans each call's ``ChunkLayout`` (``plan_chunk``): its
slots' tokens packed end to end into M, its slots the first of its N rows. Every token-wise
layer runs over the M packed tokens; attention runs over the N rows, each reading its own
slot's cache prefix and writing its new keys at that slot's positions
(``models.chunk_layout``). The quantities are scattered back per slot, so the state, and every
score, is what the [S, C] call leaves, up to float rounding; other slots are untouched. One
program per scorer, chunk size and live width: a chunk whose slots all decode runs about
``shapes.CHUNK_SPLIT`` calls, the long tail's few live slots one, and at most one call's
budget per chunk is padding. Dimension letters: S slots, N rows, C chunk width, M packed
tokens, D model width.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import flax.struct
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from oppo_jax.base.shapes import chunk_budget, chunk_groups
from oppo_jax.models.chunk_layout import ChunkLayout
from oppo_jax.models.heads import gather_rows, logprobs_at, scores_at
from oppo_jax.models.kv_cache import KVCache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import cached_hidden, packed_chunk_hidden
from oppo_jax.parallel.sharding import constrain_slots
from oppo_jax.rollout.admission import Admission, prompt_prefill
from oppo_jax.rollout.decode import ChunkTokens

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
    last_hidden: Float[Array, "S D"]  # final hidden state at each slot's last fed position
    per_token: Float[Array, "S R"]  # log-prob or value per response token fed so far
    num_fed: Int[Array, " S"]  # response tokens consumed
    score: Float[Array, " S"]  # score-head output at the last fed token ("score" kind; else 0)


ROLES = ("reference", "critic", "reward")  # the scorers of a PPO step, in dispatch order


@dataclasses.dataclass(frozen=True)
class ScorerSpecs:
    """The streaming consumers of the actor's tokens, by role; a role without a model is
    None: the reference when no KL term needs it (β = 0), the critic with a critic-free
    estimator, the reward model when reward functions score instead."""

    reference: ScorerSpec | None  # log-probs of the frozen reference policy
    critic: ScorerSpec | None  # values of the critic (this step's parameters)
    reward: ScorerSpec | None  # the reward model's score

    def present(self) -> tuple[str, ...]:
        """The roles that have a model, in dispatch order."""
        return tuple(role for role in ROLES if getattr(self, role) is not None)


@flax.struct.dataclass
class ScorerOutputs:
    """What the scorers produced for every slot, read after the rollout."""

    ref_logp: Float[Array, "S R"] | None  # reference log-prob of each response token
    values: Float[Array, "S R"] | None  # critic value before each response token
    scores: Float[Array, " S"] | None  # reward-model score at the last token (None: no model)


@flax.struct.dataclass
class ScorerParams:
    """Each role's parameters, where its scorer runs (the same roles as its ``ScorerSpecs``)."""

    reference: dict | None
    critic: dict | None
    reward: dict | None = None


@flax.struct.dataclass
class ScorerStates:
    """Each role's streaming state (the same roles as its ``ScorerSpecs``)."""

    reference: ScorerState | None = None
    critic: ScorerState | None = None
    reward: ScorerState | None = None

    def outputs(self) -> ScorerOutputs:
        ref, critic, reward = self.reference, self.critic, self.reward
        return ScorerOutputs(
            None if ref is None else ref.per_token,
            None if critic is None else critic.per_token,
            None if reward is None else reward.score,
        )


def scorer_admit(
    spec: ScorerSpec, params, admission: Admission, prompt_width: int, group_size: int = 1
) -> ScorerState:
    """Prefill every slot's prompt (each group's once: ``admission.prompt_prefill``'s
    ``group_size``); no response token is fed yet (``num_fed`` 0). A carried
    prefix is fed afterwards, replayed in chunks (``scoring.carried``), or its kept state is
    restored (``scoring.carried``)."""
    shape = (prompt_width, spec.response_len)
    cache, last_hidden = prompt_prefill(spec.model, params, admission, shape, spec.mesh, group_size)
    slots = admission.num_slots
    state = ScorerState(
        cache=cache,
        last_hidden=last_hidden,
        per_token=jnp.zeros((slots, spec.response_len), jnp.float32),
        num_fed=jnp.zeros((slots,), jnp.int32),
        score=sequence_score(spec, params, last_hidden),
    )
    return constrain_slots(state, spec.mesh)


def per_token_quantity(
    spec: ScorerSpec, params, before: Float[Array, "S C D"], tokens: Int[Array, "S C"]
):
    """Token i's quantity from the hidden state before it: a log-prob or a value."""
    if spec.kind == "logprob":
        return logprobs_at(spec.model, params, before, tokens, spec.temperature)
    return scores_at(spec.model, params, before)


def sequence_score(
    spec: ScorerSpec, params, last_hidden: Float[Array, "S D"]
) -> Float[Array, " S"]:
    """The sequence score at the last fed token (a score head at one position per slot)."""
    if spec.kind != "score":
        return jnp.zeros(last_hidden.shape[:1], jnp.float32)
    return scores_at(spec.model, params, last_hidden)


def score_chunk(
    spec: ScorerSpec, params, state: ScorerState, chunk: ChunkTokens, kv_width: int | None = None
) -> ScorerState:
    """Append one chunk of each slot's new tokens to the cache and record their quantities;
    attention reads the cache's first ``kv_width`` columns (the live prefix; None: all)."""
    width = chunk.tokens.shape[1]
    tokens, count = chunk.tokens, chunk.count
    hidden, cache = cached_hidden(spec.model, params, state.cache, tokens, count, kv_width)
    rows = jnp.arange(chunk.tokens.shape[0])[:, None]
    offsets = jnp.arange(width)[None, :]
    at = jnp.where(
        offsets < chunk.count[:, None], state.num_fed[:, None] + offsets, spec.response_len
    )
    per_token = state.per_token
    if spec.kind != "score":
        before = jnp.concatenate([state.last_hidden[:, None], hidden[:, :-1]], axis=1)
        quantities = per_token_quantity(spec, params, before, chunk.tokens)
        per_token = per_token.at[rows, at].set(quantities, mode="drop")
    fed = chunk.count > 0
    newest = gather_rows(hidden, jnp.maximum(chunk.count - 1, 0)[:, None])[:, 0]
    last_hidden = jnp.where(fed[:, None], newest, state.last_hidden)
    new = ScorerState(
        cache=cache,
        last_hidden=last_hidden,
        per_token=per_token,
        num_fed=state.num_fed + chunk.count,
        score=jnp.where(fed, sequence_score(spec, params, last_hidden), state.score),
    )
    return constrain_slots(new, spec.mesh)


def plan_chunk(counts: np.ndarray, width: int) -> list[dict[str, np.ndarray]]:
    """The host arrays of each packed call's ``ChunkLayout`` for a chunk with these ``counts``
    [S] (``shapes.chunk_groups``; [] when no slot has a token). Padding rows name slot S,
    padding tokens row N.

    Example: counts [0, 3, 0, 1], C 4 (budget (4, 4)) -> one call: rows [1, 3, 4, 4], count
    [3, 1, 0, 0], token_row [0, 0, 0, 1], token_col [0, 1, 2, 0].
    """
    counts = np.asarray(counts, np.int32)
    n, m = chunk_budget(counts.shape[0], width)
    plans = []
    for group in chunk_groups(counts, width):
        live = np.asarray(group, np.int32)
        rows = np.full(n, counts.shape[0], np.int32)
        rows[: live.size] = live
        count = np.zeros(n, np.int32)
        count[: live.size] = counts[live]
        token_row = np.full(m, n, np.int32)
        token_col = np.zeros(m, np.int32)
        total = int(count.sum())
        token_row[:total] = np.repeat(np.arange(n, dtype=np.int32), count)
        starts = np.cumsum(count) - count
        token_col[:total] = np.arange(total, dtype=np.int32) - np.repeat(starts, count)
        plans.append({"rows": rows, "count": count, "token_row": token_row, "token_col": token_col})
    return plans


def padding_plan(shape: tuple[int, int], slots: int) -> dict[str, np.ndarray]:
    """A plan of ``shape`` = (N, M) that packs no token (every row and token padding): scoring
    it compiles that shape and leaves a state as it was (a warm-up's input)."""
    n, m = shape
    rows, none = np.full(n, slots, np.int32), np.zeros(n, np.int32)
    tokens = {"token_row": np.full(m, n, np.int32), "token_col": np.zeros(m, np.int32)}
    return {"rows": rows, "count": none, **tokens}


def score_packed_chunk(
    spec: ScorerSpec,
    params,
    state: ScorerState,
    chunk: ChunkTokens,
    plan: dict[str, Array],
    kv_width: int | None = None,
) -> ScorerState:
    """``stream.score_chunk`` over the chunk's tokens packed by ``plan`` (``plan_chunk``'s
    arrays, on the device); attention reads the cache's first ``kv_width`` columns."""
    slots, width = chunk.tokens.shape
    layout = ChunkLayout(**plan, width=width)
    slot = layout.token_slots(slots)  # [M]; S for padding
    col = layout.token_col
    tokens = chunk.tokens[jnp.minimum(slot, slots - 1), col]
    hidden, cache = packed_chunk_hidden(spec.model, params, state.cache, tokens, layout, kv_width)
    per_token = state.per_token
    if spec.kind != "score":
        # Token m's quantity comes from the hidden state before it: its slot's last one for a
        # row's first token, else token m - 1 (a row's tokens are packed in order).
        last = jnp.take(state.last_hidden, slot, axis=0, mode="clip")
        previous = jnp.concatenate([last[:1], hidden[:-1]], axis=0)
        before = jnp.where((col == 0)[:, None], last, previous)
        quantities = per_token_quantity(spec, params, before[None], tokens[None])[0]
        at = jnp.take(state.num_fed, slot, mode="clip") + col
        per_token = per_token.at[slot, at].set(quantities, mode="drop")
    newest = jnp.where(layout.is_last(), slot, slots)  # each row's last token updates its slot
    new = ScorerState(
        cache=cache,
        last_hidden=state.last_hidden.at[newest].set(hidden, mode="drop"),
        per_token=per_token,
        num_fed=state.num_fed.at[layout.rows].add(layout.count, mode="drop"),
        score=state.score.at[newest].set(sequence_score(spec, params, hidden), mode="drop"),
    )
    return constrain_slots(new, spec.mesh)
