"""The host side of slot compaction (``rollout.compaction``) during one step's decode loop.

When the running slots fit in half of the slot bucket, the decode state, the chunk about to be
handed on and the cut rule are gathered into the smaller bucket; the host keeps which original
slot each row holds (``slot_of``) and the last full-layout decode state (``parked``) to scatter
the rows back into when the rollout ends, so everything after the decode loop (the cut,
scoring, experience, carry) sees the admission's slot layout unchanged. The decision needs one
number, the running slots after a chunk, which the loop's one read per chunk carries
(``ChunkTokens.running``, -1 once the rollout may be cut); which rows to keep is computed on
the device from the same chunk's flags. The chunk is read one chunk late, so a slot counted as
running may have finished since, never the reverse.

Only the decode moves. Every consumer of the chunks (the scorers, which pack each chunk's
tokens and so skip finished slots already, and the reward functions) gets each chunk in the
admission's layout (``full_chunk``): a run compacts only where the scorers pack
(``Kernels.compaction_floor``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oppo_jax.rollout.compaction import compact_bucket, compact_rows, put_slots, take_slots
from oppo_jax.rollout.decode import ChunkTokens, CutRule


def compaction_default(backend: str | None = None) -> bool:
    """Whether a backend compacts by default: on the CPU, where a decode step costs in
    proportion to its slots. On GPU and TPU the ragged decode attention
    (``models.ragged_decode``) already reads no keys of a finished slot: one mechanism for
    finished slots per backend."""
    return (backend or jax.default_backend()) == "cpu"


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
