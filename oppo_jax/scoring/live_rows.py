"""Streamed scoring at real widths: a chunk is scored over the slots that have tokens in it.

``stream.score_chunk`` feeds a chunk as one [S, C] call over every slot, so a slot that has
finished keeps costing a scorer C tokens per chunk. Here the slots with new tokens
(``count > 0``) are gathered, in slot order, into N rows (N a bucket from the host's bound on
the running slots, ``live_row_bucket``); padding rows name slot S, which the model's
writes drop. Each row reads its own slot's cache prefix and writes its new keys at that
slot's positions (``Transformer``'s ``cache_rows``), and its quantities are scattered back
to that slot, so the state, and every score, is what the [S, C] call leaves (up to float
rounding): the other slots' caches and outputs are not touched at all.

Which N: the host knows, one chunk late, how many slots were still running when the chunk
began (``ChunkTokens.running`` of the chunk before; every slot with tokens in this chunk is
one of them), and rounds it up to a power of two, capped at S (S itself: the [S, C] call).
A scorer therefore compiles at most ``len(live_row_buckets(S))`` chunk shapes per live width.

Dimension letters: S slots, N rows scored, C chunk width, D model width, R response capacity.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int

from oppo_jax.models.heads import gather_rows
from oppo_jax.models.transformer import cached_hidden
from oppo_jax.rollout.compaction import slot_bucket
from oppo_jax.rollout.decode import ChunkTokens
from oppo_jax.scoring.stream import ScorerSpec, ScorerState, per_token_quantity, sequence_score
from oppo_jax.sharding import constrain_slots


def live_row_bucket(running: int, slots: int) -> int | None:
    """Rows to score a chunk over when at most ``running`` of the ``slots`` have tokens in
    it: the power of two that holds them; None when that is not fewer than ``slots`` (the
    [S, C] call then costs the same).

    Example: 24 slots: 3 running -> 4, 9 -> 16, 17 -> None; 0 running -> 1.
    """
    bucket = slot_bucket(running)
    return bucket if bucket < slots else None


def live_row_buckets(slots: int) -> tuple[int, ...]:
    """Every N ``live_row_bucket`` can return for ``slots`` (what a warm-up compiles).

    Example: 24 -> (1, 2, 4, 8, 16); 8 -> (1, 2, 4).
    """
    return tuple(1 << i for i in range(max(slots - 1, 0).bit_length()))


def live_rows(count: Int[Array, " S"], num_rows: int) -> Int[Array, " N"]:
    """The slots with tokens in the chunk, ascending, padded with S to ``num_rows``.

    Example: count [0, 3, 0, 1], 4 rows -> [1, 3, 4, 4].
    """
    slots = count.shape[0]
    (rows,) = jnp.nonzero(count > 0, size=num_rows, fill_value=slots)
    return rows.astype(jnp.int32)


def score_live_chunk(
    spec: ScorerSpec,
    params,
    state: ScorerState,
    chunk: ChunkTokens,
    num_rows: int,
    kv_width: int | None = None,
) -> ScorerState:
    """``stream.score_chunk`` over the ``num_rows`` rows of the slots with tokens in the
    chunk (there must be at most that many); attention reads the cache's first ``kv_width``
    columns (None: all)."""
    rows = live_rows(chunk.count, num_rows)
    width = chunk.tokens.shape[1]
    tokens = jnp.take(chunk.tokens, rows, axis=0, mode="clip")
    count = jnp.take(chunk.count, rows, mode="fill", fill_value=0)  # padding rows: none
    num_fed = jnp.take(state.num_fed, rows, mode="clip")
    hidden, cache = cached_hidden(spec.model, params, state.cache, tokens, count, kv_width, rows)
    per_token = state.per_token
    if spec.kind != "score":
        last = jnp.take(state.last_hidden, rows, axis=0, mode="clip")
        before = jnp.concatenate([last[:, None], hidden[:, :-1]], axis=1)
        offsets = jnp.arange(width)[None, :]
        at = jnp.where(offsets < count[:, None], num_fed[:, None] + offsets, spec.response_len)
        quantities = per_token_quantity(spec, params, before, tokens)
        per_token = per_token.at[rows[:, None], at].set(quantities, mode="drop")
    # Every gathered slot has tokens (padding rows name slot S): each takes its newest state.
    newest = gather_rows(hidden, jnp.maximum(count - 1, 0)[:, None])[:, 0]
    new = ScorerState(
        cache=cache,
        last_hidden=state.last_hidden.at[rows].set(newest, mode="drop"),
        per_token=per_token,
        num_fed=state.num_fed.at[rows].add(count, mode="drop"),
        score=state.score.at[rows].set(sequence_score(spec, params, newest), mode="drop"),
    )
    return constrain_slots(new, spec.mesh)
