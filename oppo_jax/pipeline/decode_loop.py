"""The decode loop of one step: decode chunks until the cut rule holds, handing each chunk to
the step's scorers as it is done, and compacting the running slots as others finish.

Plain Python that dispatches ``Kernels.decode_tokens`` and never waits on it, except for one
small read per chunk (may the rollout be cut? how many slots still run? and, when streaming,
the chunk's token count per slot, which packs its scoring), read one chunk late so the actor's
queue never drains while the host looks.

Slot compaction (``SlotMap``, where ``Kernels.compaction_floor`` says the run compacts): when
the running slots fit in half of the slot bucket, the decode state, the chunk about to be
handed on and the cut rule are gathered into the smaller bucket (``rollout.compaction``); the
host keeps which original slot each row holds and the last full-layout state to scatter the
rows back into when the rollout ends, so everything after the loop (the cut, scoring,
experience, carry) sees the admission's slot layout. The decision needs one number, the
running slots after a chunk, which the loop's one read carries (``ChunkTokens.running``, -1
once the rollout may be cut); which rows to keep is computed on the device from the same
chunk's flags. Read one chunk late, a slot counted as running may have finished since, never
the reverse. Only the decode moves: every consumer of the chunks gets each in the admission's
layout (``SlotMap.full_chunk``), so a run compacts only where the scorers pack.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.parallel.sharding import to_host
from oppo_jax.pipeline.kernels import Kernels
from oppo_jax.pipeline.step_scorers import StepScorers
from oppo_jax.rollout.compaction import compact_bucket, compact_rows, put_slots, take_slots
from oppo_jax.rollout.decode import ChunkTokens, CutRule, DecodeState


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How a step decodes: its cut rule, chunk size C and the longest context admitted (the
    live widths start there, ``Kernels.chunk_width``)."""

    rule: CutRule
    chunk_size: int
    longest_context: int


def decode_rollout(
    kernels: Kernels,
    params,
    state: DecodeState,
    chunking: Chunking,
    scorers: StepScorers | None = None,
) -> DecodeState:
    """Decode until the cut rule allows the cut. With ``scorers`` (streaming), each chunk is
    fed to them once it is done (``StepScorers.feed``), in the admission's slot layout, with
    the live width it was decoded at and its token counts (read with the loop's flag, once the
    next chunk is dispatched). ``Kernels.decode_tokens`` records each chunk it dispatches
    (``StepRecorder``).

    Chunk i reads the cache's live prefix, sized on the host from the admitted lengths and i
    alone (``Kernels.chunk_width``). Where the kernels compact (``Kernels.compaction_floor``),
    the rows still running move into smaller slot buckets as the others finish
    (``SlotMap``), decided from their count, which the loop's one read per chunk
    carries; the state comes back in the admission's layout."""
    rule, size = chunking.rule, chunking.chunk_size
    floor = kernels.compaction_floor
    slot_map = None if floor is None else SlotMap(state.tokens.shape[0], minimum=floor)
    chunk = width = None
    for i in itertools.count(0):
        last, last_width = chunk, width
        width = kernels.chunk_width(chunking.longest_context, size, i)
        state, chunk = kernels.decode_tokens(params, state, rule, size, width)
        if last is None:  # the first chunk: dispatched, nothing to read yet
            continue
        # chunk i is dispatched before the host reads chunk i - 1
        if scorers is None:
            running = int(jax.device_get(last.running))  # the loop's only read: -1 once ready
        else:  # streaming: the chunk's counts with it (one transfer), then it is scored
            full = last if slot_map is None else slot_map.full_chunk(last)
            # to_host: on several processes the counts are sharded over their slots.
            running, counts = to_host((full.running, full.count))
            running = int(running)
            scorers.feed(full, last_width, np.asarray(counts))
        if running < 0:
            return state if slot_map is None else slot_map.restore(state)
        if slot_map is not None:
            state, chunk, rule = slot_map.maybe_compact(running, last.finished, state, chunk, rule)


class SlotMap:
    """Original slot of each row of a compacting rollout, and the state to scatter back."""

    def __init__(self, slots: int, minimum: int = 1):
        self.slots = slots  # S, the admission's slots
        self.slot_of = jnp.arange(slots, dtype=jnp.int32)  # [N] original slot of each row
        self.minimum = minimum  # smallest bucket
        self.parked = None  # the full-layout decode state, once compacted
        self._empty = None  # full_chunk's all-empty [S, C] chunk, made once per step

    def maybe_compact(self, running: int, finished, state, chunk: ChunkTokens, rule: CutRule):
        """Gather the ``running`` rows (flagged by the device array ``finished`` [N], of the
        same chunk) when they fit in half the bucket: returns (state, chunk, rule)."""
        n = int(self.slot_of.shape[0])
        bucket = compact_bucket(running, n, self.minimum)
        if bucket is None:
            return state, chunk, rule
        rows = compact_rows(finished, bucket)
        # The kernels get the gathered copies: the parked state is not donated.
        self.parked = state if self.parked is None else put_slots(self.parked, state, self.slot_of)
        state, chunk = take_slots(state, rows, n), take_slots(chunk, rows, n)
        # Rows left behind have finished; those holding a sequence leave the rule's count.
        kept = take_slots(rule, rows, n)
        done = jnp.sum(rule.active) - jnp.sum(kept.active)
        rule = kept.replace(target=rule.target - done.astype(rule.target.dtype))
        self.slot_of = self.slot_of[rows]
        return state, chunk, rule

    def full_chunk(self, chunk: ChunkTokens) -> ChunkTokens:
        """The chunk in the admission's layout (rows not held: no new tokens), as every
        consumer takes it; a chunk in that layout already comes back as it is."""
        if self.parked is None or chunk.tokens.shape[0] == self.slots:
            return chunk
        if self._empty is None:  # a step's chunks share one width; scalars come from the chunk
            s = self.slots
            self._empty = ChunkTokens(
                jnp.full((s, chunk.tokens.shape[1]), 0, chunk.tokens.dtype),
                jnp.zeros((s,), jnp.int32),
                jnp.zeros((s,), jnp.int32),
                chunk.ready,
                None if chunk.finished is None else jnp.ones((s,), bool),
                chunk.running,
            )
        return put_slots(self._empty, chunk, self.slot_of)

    def restore(self, state):
        """The decode state with its rows scattered back into the admission's layout."""
        if self.parked is None:
            return state
        state, self.parked = put_slots(self.parked, state, self.slot_of), None
        return state
