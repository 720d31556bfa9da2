"""The tokens the built kernels compute (``engines.BUILT``), counted with the engine's own shape
rules (``oppo_jax.base.shapes``, JAX-free), not an idealised packing.

- ``update_tokens``: the packed update (``oppo_jax.ppo.packing.plan_packing``): each
  minibatch's sequences (prompt + response) first-fit-decreasing into rows of one width,
  P + R rounded up to the 16-token granule, dealt to chunks of the engine's one height
  (``oppo_jax.base.shapes.update_chunk_rows``); the chunks holding no sequence do not run
  (``UpdateGroups``: the config's epochs, minibatches, accumulation steps and shards).
- ``score_tokens``: ``sync`` scoring at real widths (``oppo_jax.scoring.packed``): the engine's
  calls of one shape (``oppo_jax.base.shapes.score_calls``); the scorers' admission prefill is
  skipped.
- ``chunk_tokens``: a streamed chunk scored packed (``oppo_jax.scoring.stream``): whole
  calls of the engine's token budget (``oppo_jax.base.shapes.chunk_budget``) over its real tokens.
  S is the admission's slots even when the decode has compacted: packing scorers stay in that
  layout (``oppo_jax.pipeline.decode_loop``).
- ``update_segment_pairs``: the query-key pairs the packed update's segment attention visits on
  a GPU (``models.segment_attention``): per first-fit row, each query block's key blocks from
  its first query's segment start to the diagonal (``row_segment_pairs``).
- ``replay_tokens``: the built engine's replay of carried prefixes after the prompt prefill
  (``oppo_jax.scoring.carried.plan_replay``): chunk j of ``REPLAY_CHUNK`` tokens runs over the
  leading row bucket (a power of two >= 4, at most S) holding every prefix longer than j·c.
- ``prefix_bucket`` / ``split_rows``: the fixed-shape engine's split admission before the
  replay (carried rows prefilled at P + pow2(longest prefix), the rest at P), which the
  recorded benches of ``docs/benchmarks`` ran.
- ``live_width``: the columns a decode chunk reads (``models.kv_cache.live_width``): the power
  of two (at least 16) over the longest context the chunk can reach, capped at P + R.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oppo_jax.base import shapes as engine_shapes
from oppo_jax.base.shapes import live_width, pow2_at_least, row_bucket  # noqa: F401

GRANULE = 16  # ppo.pack_granule's default
MIN_WIDTH = 16  # the narrowest packed scoring row and live decode width
RAGGED_KEY_BLOCK = engine_shapes.RAGGED_KEY_BLOCK  # a ragged row reads whole key blocks
RAGGED_KEY_BLOCK_TPU = engine_shapes.RAGGED_KEY_BLOCK_TPU  # the Mosaic form's blocks


def ffd_rows(lengths, width: int) -> int:
    """Rows first-fit decreasing needs for ``lengths`` in rows of ``width`` (each <= width).
    Example: [5, 3, 4, 2] in 8 -> 2."""
    return len(engine_shapes.first_fit_decreasing(lengths, width))


def ffd_place(lengths, width: int) -> list[list[int]]:
    """The rows first-fit decreasing fills (``oppo_jax.base.shapes.first_fit_decreasing``), each its
    sequences' lengths from column 0. Example: [5, 3, 4, 2] in 8 -> [[5, 3], [4, 2]]."""
    lengths = np.asarray(lengths)
    rows = engine_shapes.first_fit_decreasing(lengths, width)
    return [[int(lengths[i]) for i in row] for row in rows]


@dataclasses.dataclass(frozen=True)
class UpdateGroups:
    """How the packed update splits a step's batch (a config's ``ppo`` and mesh)."""

    passes: int = 1  # PPO epochs: each shuffles the batch on its own
    microbatches: int = 1  # per pass: minibatches x gradient-accumulation steps
    row_multiple: int = 1  # rows are a multiple of the batch shards (data x fsdp)
    minibatches: int = 1  # of ``microbatches``: the optimizer steps per pass
    width_factor: int = 1  # ppo.pack_width_factor: rows of k x (P + R)

    @property
    def chunks(self) -> int:
        """A: the accumulation steps a minibatch is dealt to."""
        return self.microbatches // self.minibatches

    def draw(self, n: int, seed: int = 0) -> np.ndarray:
        """[G, n / minibatches] batch rows of every distinct minibatch of a step: shuffled per
        pass as the engine does (its draw is JAX's; this one is NumPy's, alike in law). One
        minibatch per pass packs the whole batch every pass, so G = 1."""
        if n % self.microbatches:
            raise ValueError(f"{n} sequences do not split into {self.microbatches} microbatches")
        if self.minibatches == 1:
            return np.arange(n)[None]
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(n) for _ in range(self.passes)]
        return np.concatenate([p.reshape(self.minibatches, -1) for p in perms])


def minibatch_rows(lengths, full: int, minis, groups: UpdateGroups, granule: int = GRANULE):
    """(rows that run, their width) of the packed update over the minibatches ``minis``
    [G, A·m] (batch rows) of sequences of ``lengths`` (prompt + response), padded width
    ``full`` = P + R, split as ``groups`` says: chunks of the engine's one height
    (``oppo_jax.base.shapes.update_chunk_rows``), only those holding sequences run (module
    docstring)."""
    lengths, minis = np.asarray(lengths), np.asarray(minis)
    width = engine_shapes.packed_width(full, granule, groups.width_factor)
    return _chunked_rows([lengths[mini] for mini in minis], width, minis.shape[1], groups), width


def _chunked_rows(items: list, width: int, per_minibatch: int, groups: UpdateGroups) -> int:
    """Rows that run when each minibatch's ``items`` (lengths) first-fit decreasing into rows
    of ``width``, dealt to chunks of the engine's one height, set by the ``per_minibatch``
    sequences (A·m) the config sized it for; chunks without an item do not run."""
    m = per_minibatch // groups.chunks
    height = engine_shapes.update_chunk_rows(m, groups.row_multiple, groups.width_factor)
    return sum(-(-ffd_rows(it, width) // height) for it in items) * height


def shared_prefix_items(prompt: int, responses, members, width: int, group_size: int) -> list:
    """The item lengths of a shared-prefix update over one minibatch (``members``: its batch
    rows; row b in group b // G): per group, its prompt once, then its members' responses,
    greedily in batch order, a new part (its own prompt) where the next would pass ``width``
    (docs/SHARED_PREFIX_UPDATE.md). Example: prompt 4, one group's responses [3, 5, 9],
    width 16 -> [4 + 3 + 5, 4 + 9] = [12, 13]."""
    items, responses = [], np.asarray(responses)
    for group in np.unique(np.asarray(members) // group_size):
        part = prompt
        for b in sorted(i for i in members if i // group_size == group):
            if part > prompt and part + responses[b] > width:
                items.append(part)
                part = prompt
            part += int(responses[b])
        items.append(part)
    return items


def shared_update_work(
    prompt: int, responses, full: int, groups: UpdateGroups, group_size: int, segment: bool
) -> tuple[float, int, float | None]:
    """(rows, width, segment-attention pairs or None) of one pass of a shared-prefix update
    over ``responses`` behind prompts of ``prompt`` (``shared_prefix_items`` per minibatch,
    drawn as ``update_rows`` draws them); the segment kernel visits an item's key blocks from
    its start to the diagonal, its members' siblings' among them (masked, so still visited)."""
    responses = np.asarray(responses)
    minis = groups.draw(responses.size, seed=int(responses.sum()) + prompt * responses.size)
    width = engine_shapes.packed_width(full, GRANULE, groups.width_factor)
    items = [shared_prefix_items(prompt, responses, mini, width, group_size) for mini in minis]
    rows = _chunked_rows(items, width, minis.shape[1], groups)
    pairs = _items_pairs(items, width) if segment else None
    passes = 1 if groups.minibatches == 1 else groups.passes
    return rows / passes, width, None if pairs is None else pairs / passes


def _items_pairs(items: list, width: int) -> int:
    """Query-key pairs the segment attention visits when each minibatch's ``items`` (lengths)
    first-fit decreasing into rows of ``width`` (``row_segment_pairs`` per row)."""
    block = segment_block(width)
    return sum(row_segment_pairs(row, width, block) for it in items for row in ffd_place(it, width))


def minibatch_pairs(lengths, full: int, minis, groups: UpdateGroups, granule: int = GRANULE):
    """Query-key pairs the segment attention visits over ``minibatch_rows``' rows: each
    minibatch's first-fit rows by ``row_segment_pairs``; the chunks' padding rows, none."""
    lengths, minis = np.asarray(lengths), np.asarray(minis)
    width = engine_shapes.packed_width(full, granule, groups.width_factor)
    return _items_pairs([lengths[mini] for mini in minis], width)


def minibatch_slots(lengths, full: int, minis, groups: UpdateGroups = UpdateGroups()) -> int:
    """Token slots of ``minibatch_rows``."""
    rows, width = minibatch_rows(lengths, full, minis, groups)
    return rows * width


def update_rows(lengths, full: int, groups: UpdateGroups = UpdateGroups()) -> tuple[float, int]:
    """(rows, width) one pass of the packed update computes over sequences of ``lengths``
    (prompt + response) with padded width ``full`` = P + R, split as ``groups`` says (module
    docstring); the shuffles are seeded by the lengths, so a step is reproducible."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return 0.0, 0
    minis = groups.draw(lengths.size, seed=int(lengths.sum()))
    rows, width = minibatch_rows(lengths, full, minis, groups)
    return rows / (1 if groups.minibatches == 1 else groups.passes), width


def update_segment_pairs(lengths, full: int, groups: UpdateGroups = UpdateGroups()) -> float:
    """Query-key pairs one pass of the packed update's segment attention visits (the rows of
    ``update_rows``, drawn alike)."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return 0.0
    minis = groups.draw(lengths.size, seed=int(lengths.sum()))
    pairs = minibatch_pairs(lengths, full, minis, groups)
    return pairs / (1 if groups.minibatches == 1 else groups.passes)


def update_tokens(lengths, full: int, groups: UpdateGroups = UpdateGroups()) -> float:
    """Token slots of ``update_rows``: one pass of the packed update."""
    rows, width = update_rows(lengths, full, groups)
    return rows * width


def score_tokens(lengths, full: int) -> int:
    """Token slots a scorer's packed ``sync`` calls compute over ``lengths``: the engine's own
    plan (``oppo_jax.base.shapes.score_calls``), calls of one shape."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return 0
    calls = engine_shapes.score_calls(lengths, full)
    return (
        len(calls)
        * engine_shapes.score_rows_per_call(lengths.size)
        * (engine_shapes.score_width(full))
    )


def chunk_tokens(counts, chunk: int) -> int:
    """Tokens a streamed chunk with these new tokens per slot (``counts`` [S], each at most C =
    ``chunk``) is scored at: the engine's calls of one budget (``oppo_jax.base.shapes.
    chunk_groups``, ``chunk_budget``). Example: C 8, 24 slots (budget 2 rows, 8 tokens):
    [8, 2, 3, 1] and 20 empty -> 3 calls, 24."""
    counts = np.asarray(counts)
    _, budget = engine_shapes.chunk_budget(counts.size, chunk)
    return len(engine_shapes.chunk_groups(counts, chunk)) * budget


SEGMENT_BLOCK = engine_shapes.SEGMENT_BLOCK  # query and key blocks of packed rows


def segment_block(width: int) -> int:
    """``models.segment_attention.block_for``."""
    return engine_shapes.pow2_block(width, SEGMENT_BLOCK)


def row_segment_pairs(lengths, width: int, block: int | None = None) -> int:
    """Query-key pairs the segment attention (``models.segment_attention``) visits over one
    packed row of ``width`` holding sequences of ``lengths`` from column 0 (the unused tail
    padding): each query block holding a sequence's token, the key blocks from its first
    query's segment start to the diagonal, whole; a block of padding only, none.
    Example: [10, 30] in 64, blocks of 16 -> (1 + 2 + 3 + 0)·256."""
    block = block or segment_block(width)
    ends = np.cumsum(np.asarray(lengths, np.int64))
    starts = np.concatenate([[0], ends[:-1]]) if ends.size else np.zeros(1, np.int64)
    used = int(ends[-1]) if ends.size else 0
    if 0 < used < width:
        starts = np.append(starts, used)
    first = np.arange(0, width, block)
    run_start = starts[np.searchsorted(starts, first, side="right") - 1]
    visited = np.where(first < used, first // block - run_start // block + 1, 0)
    return int(visited.sum()) * block * block


REPLAY_CHUNK = 32  # scoring.carried.REPLAY_CHUNK: prefix tokens per replay call


def replay_tokens(prefix, slots: int, chunk: int = REPLAY_CHUNK) -> int:
    """Tokens one model's replay of the carried ``prefix`` lengths [S] (slot order) computes:
    per chunk, its leading row bucket x ``chunk``. Example: [130, 70, 0, 10], S 8, c 64 ->
    3 chunks of 4 rows: 768; c 32: 5 chunks of 4 rows: 640."""
    prefix = np.asarray(prefix)
    total = 0
    for start in range(0, int(prefix.max(initial=0)), chunk):
        longer = np.flatnonzero(prefix > start)
        total += row_bucket(int(longer[-1]) + 1, slots) * chunk
    return total


def prefix_bucket(longest_prefix: int, response_len: int) -> int:
    """The split admission's context room for carried prefixes: 0, or a power of two >= 16,
    capped at R. Example: R 64: 0 -> 0, 5 -> 16, 17 -> 32, 40 -> 64."""
    if longest_prefix <= 0:
        return 0
    return min(max(16, 1 << (int(longest_prefix) - 1).bit_length()), response_len)


def split_rows(prefix, slots: int) -> int:
    """Leading slots the split admission prefilled at the full width: the row bucket covering
    every slot with a carried prefix (carried rows come first)."""
    rows = np.flatnonzero(np.asarray(prefix) > 0)
    return row_bucket(int(rows[-1]) + 1 if rows.size else 0, slots)
