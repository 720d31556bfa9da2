"""The host side of slot compaction (``rollout.compaction``) during one step's decode loop.

When the running slots fit in half of the slot bucket, the decode state, the chunk about to be
streamed, the cut rule and (unless they pack their chunks) the scorers' states are gathered
into the smaller bucket; the host
keeps which original slot each row holds (``slot_of``, an index array it holds for the
scatter back) and the last full-layout states
(``parked``) to scatter the rows back into when the rollout ends, so everything after the
decode loop (the cut, scoring, experience, carry) sees the admission's slot layout unchanged.
The decision needs one number, the running slots after a chunk, which the loop's one read per
chunk carries (``ChunkTokens.running``, -1 once the rollout may be cut); which rows to keep is
computed on the device from the same chunk's flags. The chunk is read one chunk late, so a
slot counted as running may have finished since, never the reverse.

Scorers that pack each chunk's tokens (``scoring.packed_chunks``) stay in the admission's
layout (``moves_scorers`` False): packing already skips finished slots, both in the
token-wise layers (M packed tokens) and in attention (rows only for slots with new tokens),
so gathering their states would only add programs at every bucket, and a chunk packed over
the admission's S slots can use the whole range of packed sizes (measured on
configs/bench_cpu.yaml's ``intra``: streamed scoring efficiency 0.55 with compacted,
unpacked scorer chunks, 0.84 packed in the full layout at 2^k and 1.5·2^k sizes). They get
each chunk scattered back into the admission's layout (``full_chunk``), a [S, C] scatter on
the generation device.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from oppo_jax.rollout.compaction import compact_bucket, compact_rows, put_slots, take_slots
from oppo_jax.rollout.decode import ChunkTokens, CutRule


def compaction_default(backend: str | None = None) -> bool:
    """Whether a backend compacts by default: on the CPU a decode step costs in proportion to
    its slots (measured: 24 -> 16 demo-sized slots cut a 32-step chunk by a third), so
    dropping finished ones pays; on GPU/TPU a decode step over a few dozen slots is bound by
    reading the weights and the KV cache. On a GPU the ragged decode attention
    (``models.ragged_decode``) already reads no keys of a finished slot, so compaction saves
    nothing there (the simulator: sync and OPPO unchanged with it on top), while its gathers,
    extra compiled buckets and parked full-layout state (up to 1.5x the actor's KV cache)
    cost. On a TPU it would pay (the simulator: sync 0.32-0.57x at median 2048), but it has
    never run on one and the parked state does not fit the 7B configs' memory plan."""
    return (backend or jax.default_backend()) == "cpu"


class SlotMap:
    """Original slot of each row of a compacting rollout, and the states to scatter back."""

    def __init__(self, slots: int, minimum: int = 1, moves_scorers: bool = True):
        self.slots = slots  # S, the admission's slots
        self.moves_scorers = moves_scorers  # False: the scorers stay in the full layout
        self.slot_of = jnp.arange(slots, dtype=jnp.int32)  # [N] original slot of each row
        self.minimum = minimum  # smallest bucket (the generation mesh's batch shards)
        self.parked = None  # full-layout (decode state, scorer states), once compacted
        self._empty = None  # full_chunk's all-empty [S, C] chunk, made once per step

    def maybe_compact(
        self, running: int, finished, state, chunk: ChunkTokens, rule: CutRule, scorers
    ):
        """Gather the ``running`` rows (flagged by the device array ``finished`` [N], of the
        same chunk) when they fit in half the bucket: returns (state, chunk, rule), and sets
        ``scorers.states`` likewise (None when they stay: ``step_compaction``)."""
        n = int(self.slot_of.shape[0])
        bucket = compact_bucket(running, n, self.minimum)
        if bucket is None:
            return state, chunk, rule
        rows = compact_rows(finished, bucket)
        now = (state, scorers.states)  # the kernels get the gathered copies: not donated
        self.parked = now if self.parked is None else put_slots(self.parked, now, self.slot_of)
        state, scorers.states = take_slots(now, rows, n)
        chunk = take_slots(chunk, rows, n)
        # Rows left behind have finished; those holding a sequence leave the rule's count.
        kept = take_slots(rule, rows, n)
        done = jnp.sum(rule.active) - jnp.sum(kept.active)
        rule = kept.replace(target=rule.target - done.astype(rule.target.dtype))
        self.slot_of = self.slot_of[rows]
        return state, chunk, rule

    def scorers_chunk(self, chunk: ChunkTokens) -> ChunkTokens:
        """The chunk in the layout the scorers hold: the rows' own, or the admission's."""
        return chunk if self.moves_scorers else self.full_chunk(chunk)

    def full_chunk(self, chunk: ChunkTokens) -> ChunkTokens:
        """The chunk in the admission's layout (rows not held: no new tokens), for consumers
        that index by slot (reward functions, scorers that pack); a chunk in that layout
        already comes back as it is."""
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

    def restore(self, state, scorers):
        """Scatter the rows back into the full layout: the decode state, and the scorers'."""
        if self.parked is None:
            return state
        state, scorers.states = put_slots(self.parked, (state, scorers.states), self.slot_of)
        self.parked = None
        return state


def step_compaction(floor: int | None, slots: int, scorers):
    """(SlotMap, scorers) for a step whose decode compacts into buckets of at least ``floor``
    slots (``compaction_floor``), else None (``floor`` None). Scorers that pack their chunks
    (``scorers.packed_chunks``) stay in the admission's layout (module docstring)."""
    if floor is None:
        return None
    if getattr(scorers, "packed_chunks", False):  # the map moves no scorer state: none held
        held = types.SimpleNamespace(states=None)
        return SlotMap(slots, minimum=floor, moves_scorers=False), held
    return SlotMap(slots, minimum=floor), scorers


def compaction_floor(compact: bool | None, shards: int, minimum: int = 1) -> int | None:
    """The smallest slot bucket a run's decode compacts into, None when it does not compact
    (``compacts``). Buckets stay multiples of the generation mesh's ``shards`` (batch shards)
    and no smaller than ``minimum`` (``pipeline.compact_min_slots``)."""
    return max(shards, minimum) if compacts(compact, shards) else None


def compacts(compact: bool | None, shards: int) -> bool:
    """Whether a run's decode compacts: ``compact`` (None: the backend's default) and a
    power-of-two count of the generation mesh's batch ``shards``, in a single-process run: the
    kept rows' indices are computed beside the decode state, and moving them to another
    process's devices is a cross-host transfer (the CPU backend has none)."""
    compact = compaction_default() if compact is None else compact
    return bool(compact) and not shards & (shards - 1) and jax.process_count() == 1


def full_chunk(compaction: tuple[SlotMap, object] | None, chunk: ChunkTokens) -> ChunkTokens:
    """The chunk in the admission's slot layout (for consumers that index by slot)."""
    return chunk if compaction is None else compaction[0].full_chunk(chunk)
