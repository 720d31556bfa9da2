"""Streamed scoring at real widths: each chunk's new tokens packed, finished slots skipped.

``stream.score_chunk`` feeds a chunk as one [S, C] call, so a slot that has finished, and
every column past a slot's count, costs a scorer as much as a real token. Here the host,
which reads the chunk's counts [S] (one small transfer beside the loop's one flag), plans a
``ChunkLayout`` (``plan_chunk``): the chunk's tokens are packed end to end into M (bucketed
at 2^k·{1, 1.125, ..., 1.875}, ``ppo.packing.bucket_up``: under a ninth of M is padding) and
the slots with new tokens become the first of N = min(S, M) rows.
Every token-wise layer runs over the M packed tokens; attention runs over the N rows, each
reading its own slot's cache prefix and writing its new keys at that slot's positions
(``models.chunk_layout``). The quantities are scattered back per slot, so the state, and
every score, is what the [S, C] call leaves, up to float rounding; other slots are untouched.

A scorer compiles at most ``bucket_steps()``·``PACKED_LEVELS`` packed programs per live width
beside the [S, C] one (``chunk_shapes`` lists them: what a warm-up compiles), which a chunk too
full to gain keeps. Sizes at powers of two alone leave a quarter of M empty on average; four
sizes per doubling (a CPU's) cut that to under a tenth, eight (an accelerator's) to about 6%.
Attention still runs over N rows of C queries; at N = S (M >= S) it costs what the [S, C]
call's does, the token-wise layers (most of a large model's work) cost M.

Dimension letters: S slots, N rows, C chunk width, M packed tokens, D model width.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from oppo_jax.models.chunk_layout import ChunkLayout
from oppo_jax.models.transformer import packed_chunk_hidden
from oppo_jax.ppo.packing import bucket_up
from oppo_jax.rollout.compaction import slot_bucket
from oppo_jax.rollout.decode import ChunkTokens
from oppo_jax.scoring.stream import ScorerSpec, ScorerState, per_token_quantity, sequence_score
from oppo_jax.sharding import constrain_slots

PACKED_LEVELS = 4  # doublings of packed sizes below the chunk: down to pow2(S·C)/16


def chunk_shape(counts: np.ndarray, width: int) -> tuple[int, int] | None:
    """(N, M) a chunk with these per-slot ``counts`` (of ``width`` columns) is scored at: M
    the ``bucket_up`` size (2^k·{1, 1.125, ..., 1.875}) holding its tokens, at least
    pow2(S·C) / 16; N = min(S, M) rows, which hold every slot with a token (each has at least
    one). None when M would not be below S·C (score it [S, C]).

    Example (eight sizes per doubling): S 24, C 8 (S·C 192, floor 16): 30 tokens -> (24, 30);
    70 -> (24, 72); 5 -> (16, 16); 180 -> None; with four: 30 -> (24, 32), 70 -> (24, 80).
    """
    counts = np.asarray(counts)
    slots, total = counts.shape[0], int(counts.sum())
    whole = slots * width
    tokens = _packed_size(total, whole)
    return None if tokens >= whole else (min(slots, tokens), tokens)


def chunk_shapes(slots: int, width: int) -> list[tuple[int, int]]:
    """Every (N, M) ``chunk_shape`` can pick for ``slots`` slots and chunks of ``width``: at
    most ``bucket_steps()``·``PACKED_LEVELS`` per live width (what a warm-up compiles, per
    scorer).

    Example (eight sizes per doubling): 24 slots, C 8 -> [(16, 16), (18, 18), (20, 20),
    (22, 22), (24, 24), (24, 26), ..., (24, 160), (24, 176)]: 28 shapes; with four, 14.
    """
    whole = slots * width
    tokens = {_packed_size(n, whole) for n in range(whole)}
    return sorted((min(slots, m), m) for m in tokens if m < whole)


def _packed_size(total: int, whole: int) -> int:
    """M for ``total`` tokens of a chunk of ``whole`` = S·C token places (>= whole: unpacked)."""
    return max(bucket_up(total), slot_bucket(whole) >> PACKED_LEVELS, 1)


def plan_chunk(counts: np.ndarray, width: int) -> dict[str, np.ndarray] | None:
    """The host arrays of a ``ChunkLayout`` for a chunk with these ``counts`` (None: score it
    [S, C]; padding rows name slot S, padding tokens row N). Example: counts [0, 3, 0, 1],
    C 4 (M 4, N 4) -> rows [1, 3, 4, 4], count [3, 1, 0, 0], token_row [0, 0, 0, 1],
    token_col [0, 1, 2, 0]."""
    shape = chunk_shape(counts, width)
    if shape is None:
        return None
    (n, m), counts = shape, np.asarray(counts, np.int32)
    live = np.flatnonzero(counts > 0).astype(np.int32)
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
    return {"rows": rows, "count": count, "token_row": token_row, "token_col": token_col}


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
