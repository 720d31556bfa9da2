"""Streamed scoring at real widths: each chunk's new tokens packed, finished slots skipped.

``stream.score_chunk`` feeds a chunk as one [S, C] call, so a slot that has finished, and
every column past a slot's count, costs a scorer as much as a real token. Here the host,
which reads the chunk's counts [S] (one small transfer beside the loop's one flag), deals the
slots with new tokens to calls of one fixed budget (``shapes.chunk_groups``: N rows, M
tokens, ``shapes.chunk_budget``) and plans each call's ``ChunkLayout`` (``plan_chunk``): its
slots' tokens packed end to end into M, its slots the first of its N rows. Every token-wise
layer runs over the M packed tokens; attention runs over the N rows, each reading its own
slot's cache prefix and writing its new keys at that slot's positions
(``models.chunk_layout``). The quantities are scattered back per slot, so the state, and every
score, is what the [S, C] call leaves, up to float rounding; other slots are untouched.

One program per scorer, chunk size and live width: a chunk whose slots all decode runs about
``shapes.CHUNK_SPLIT`` calls, the long tail's few live slots one, and at most one call's
budget per chunk is padding.

Dimension letters: S slots, N rows, C chunk width, M packed tokens, D model width.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from oppo_jax.base.shapes import chunk_budget, chunk_groups
from oppo_jax.models.chunk_layout import ChunkLayout
from oppo_jax.models.transformer import packed_chunk_hidden
from oppo_jax.parallel.sharding import constrain_slots
from oppo_jax.rollout.decode import ChunkTokens
from oppo_jax.scoring.stream import ScorerSpec, ScorerState, per_token_quantity, sequence_score


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
