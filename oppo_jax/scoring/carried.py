"""Carried sequences on the scorers' side: each prefix replayed into an admission's cache, chunk
by chunk, at its own length, or, for the frozen scorers, their rows kept from the cut.

Replayed: a carried slot comes back with the response it had when its step was cut. The actor (new
parameters) and the critic (trained) must prefill that prefix again, and so must the frozen
scorers when their kept rows cannot be used (after a resume). After the prompt prefill
(``rollout.admission.prompt_prefill``), the prefixes are fed like a stream of chunks of
``REPLAY_CHUNK`` tokens: chunk j gives every slot its prefix tokens [j·c, (j+1)·c), over the
leading bucket of slots that still have some (carried sequences come first, FIFO, so the
older and longer prefixes sit first), with attention over the cache's live prefix only. Each
chunk is ``stream.score_chunk`` on those leading rows, written back in place, so a replayed
prefix gives exactly the cache, hidden states and per-token quantities a streamed one does
(the tested invariant: chunked prefill equals one pass).

Why chunks rather than one prefill per admission at P + pow2(longest prefix): a slot then costs its
own prefix, rounded up to a chunk, not the longest of all carried prefixes (in a long tail most
carried rows hold one cut's tokens and a few hold two; docs/PROJECTIONS.md, "Carried prefixes
replayed at their own lengths"). The compiled shapes stay few and fixed for a run: one per (row
bucket, live width), ``replay_shapes``. On a mesh that splits the slots, the leading rows sit on the
first devices, so each chunk moves its rows' cache block [L, N, K, live width, Dh] between devices
(the partitioner gathers it); carried rows laid out over the shards would avoid that.

Kept (``KeptCaches``): a carried row's reference and reward-model state (KV cache, last
hidden state, per-token log-probs, score) is kept from the step that cut it to the step that
re-admits it, so those two models never prefill a carried prefix again. Both are frozen, so a
kept cache is exactly what a re-prefill would compute (up to the rounding of a chunk-wise
versus a one-shot prefill); the critic (trained) and the actor (new parameters) are still
replayed at every admission. Only carried rows are kept, gathered into a bucket of at most
Δ_max rows (``kept_bucket``), so the memory is bounded by Δ_max rows of each frozen scorer's
cache. Rows are in the carry buffer's order (the next step admits carried sequences first,
FIFO), and each row carries the identity of its sequence, so a row is only reused for the very
sequence it was cut from. For resume the rows go into the checkpoint as orbax arrays
(``to_tree`` / ``from_tree``): a resumed run continues bit for bit.

Dimension letters: S slots, N leading rows of a chunk, c replay chunk width, R response
capacity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from oppo_jax.base.shapes import row_bucket
from oppo_jax.models.kv_cache import KVCache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel.sharding import constrain_slots
from oppo_jax.rollout.decode import ChunkTokens
from oppo_jax.rollout.spec import RolloutSpec
from oppo_jax.scoring.stream import ScorerSpec, ScorerState, score_chunk

# Tokens of each prefix one replay chunk feeds. Smaller wastes less of each row's last chunk
# (c / 2 on average) for more calls; 32 keeps a 7B call of >= 8 carried rows compute-bound on
# an H100 (256 tokens of 15 GFLOP each against one 15 GB read of the weights) and a short
# CPU-sized prefix (R = 64) within two calls.
REPLAY_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class ReplayChunk:
    """One replay call: the prefix tokens of the leading N slots (host arrays)."""

    tokens: np.ndarray  # [N, c] int32, right-padded
    count: np.ndarray  # [N] int32: tokens each slot takes (0 once its prefix has ended)
    kv_width: int  # cache columns the call's attention reads

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def computed_tokens(self) -> int:
        return self.tokens.size


def plan_replay(
    context: np.ndarray,
    prompt_len: np.ndarray,
    prefix_len: np.ndarray,
    shape: tuple[int, int],
    chunk: int = REPLAY_CHUNK,
) -> list[ReplayChunk]:
    """The replay of every slot's carried prefix (host arrays of the admission: ``context``
    [S, >= P + longest prefix], prompt then prefix per row); ``shape`` is (P, R).

    Chunk j runs over the row bucket holding every slot whose prefix is longer than j·c, over
    the whole cache (one program per row bucket: live widths here would multiply the replay's
    programs by up to log2(P + R) for a few carried rows' attention). Example: prefixes
    [130, 70, 0, 10], c 64, S 8: three chunks over 4, 4 and 4 rows, counts [64, 64, 0, 10],
    [64, 6, 0, 0], [2, 0, 0, 0].
    """
    prompt_width, response_len = shape
    prefix_len = np.asarray(prefix_len)
    slots, capacity = prefix_len.shape[0], prompt_width + response_len
    chunks = []
    for start in range(0, int(prefix_len.max(initial=0)), chunk):
        longer = np.flatnonzero(prefix_len > start)
        rows = row_bucket(int(longer[-1]) + 1, slots)
        count = np.clip(prefix_len[:rows] - start, 0, chunk).astype(np.int32)
        tokens = np.zeros((rows, chunk), np.int32)
        for r in np.flatnonzero(count):
            at = int(prompt_len[r]) + start
            tokens[r, : count[r]] = context[r, at : at + count[r]]
        chunks.append(ReplayChunk(tokens, count, capacity))
    return chunks


def replay_shapes(num_slots: int, max_carried: int, shape: tuple[int, int]) -> list[tuple]:
    """Every (rows, width) ``plan_replay`` can pick when at most ``max_carried`` of
    ``num_slots`` slots carry a prefix (``shape`` = (P, R)): what a warm-up compiles."""
    rows = sorted({row_bucket(n, num_slots) for n in range(1, max_carried + 1)})
    return [(n, sum(shape)) for n in rows]


def replay_chunk(
    spec: ScorerSpec,
    params,
    state: ScorerState,
    tokens: Int[Array, "N c"],
    count: Int[Array, " N"],
    kv_width: int,
) -> ScorerState:
    """Feed the leading N slots of ``state`` their next prefix tokens (``score_chunk`` over
    those rows, the other slots untouched), reading and writing the cache's first
    ``kv_width`` columns only: every token of the chunk sits below it."""
    rows = tokens.shape[0]

    def lead(x):  # the rows' block: [L, N, K, kv_width, Dh] of the cache, [N, ...] else
        x = jax.lax.slice_in_dim(x, 0, rows, axis=slot_axis(x))
        return jax.lax.slice_in_dim(x, 0, kv_width, axis=3) if x.ndim == 5 else x

    part = jax.tree.map(lead, state)
    chunk = ChunkTokens(tokens, part.num_fed, count, jnp.bool_(False))
    # The rows' block stays where the partitioner puts it: N rows need not divide over the
    # batch shards (on a mesh that splits the slots, the leading rows sit on the first).
    fed = score_chunk(dataclasses.replace(spec, mesh=None), params, part, chunk)

    def write(x, y):
        return jax.lax.dynamic_update_slice(x, y.astype(x.dtype), (0,) * x.ndim)

    return constrain_slots(jax.tree.map(write, state, fed), spec.mesh)


def actor_spec(cfg: ModelConfig, rollout: RolloutSpec, temperature: float) -> ScorerSpec:
    """The actor as the consumer of its own carried prefixes: log-probs at the sampling
    temperature (the old log-probs of the step), on the generation mesh."""
    return ScorerSpec(cfg, "logprob", rollout.max_response_len, temperature, rollout.mesh)


FROZEN = ("reference", "reward")  # the roles whose caches are kept


def slot_axis(x) -> int:
    """Slot axis of a ScorerState leaf: 1 for cache keys/values [L, S, ...], else 0."""
    return 1 if x.ndim == 5 else 0


def take_rows(state: ScorerState, rows: Int[Array, " K"]) -> ScorerState:
    """The scorer state of slots ``rows`` (a K-row state; repeated rows are allowed)."""
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=slot_axis(x)), state)


def put_rows(state: ScorerState, kept: ScorerState, use: Bool[Array, " K"]) -> ScorerState:
    """``state`` with its leading K slots replaced by the kept rows where ``use`` holds.

    Example: S = 6, K = 4, use [T, T, F, F] -> slots 0, 1 from ``kept``, 2..5 from ``state``.
    """

    def merge(x, y):
        axis = slot_axis(x)
        lead = jax.lax.slice_in_dim(x, 0, y.shape[axis], axis=axis)
        shape = [1] * x.ndim
        shape[axis] = use.shape[0]
        mixed = jnp.where(use.reshape(shape), y.astype(x.dtype), lead)
        return jax.lax.dynamic_update_slice_in_dim(x, mixed, 0, axis=axis)

    return jax.tree.map(merge, state, kept)


def kept_bucket(num_rows: int, max_rows: int) -> int:
    """Rows a kept block holds for ``num_rows`` carried ones: a power of two >= 4, but never
    more than ``max(num_rows, max_rows)`` (Δ_max), so few shapes compile and memory stays
    within Δ_max rows. Example: max 8: 1 -> 4, 5 -> 8; max 6: 5 -> 6."""
    return min(max(4, 1 << max(num_rows - 1, 0).bit_length()), max(num_rows, max_rows))


def row_ids(entries) -> list[list[int]]:
    """What identifies a carried sequence's row: (prompt id, response length, deferrals)."""
    return [[int(c.prompt_id), len(c.response), int(c.deferrals)] for c in entries]


@dataclasses.dataclass
class KeptCaches:
    """The frozen scorers' states of the carried rows, in carry-buffer order (device arrays on
    the scoring group), and each row's sequence identity (``row_ids``)."""

    states: dict[str, ScorerState]  # role -> state of K >= len(ids) rows
    ids: list[list[int]]  # one per real row; rows past len(ids) are padding

    def usable_rows(self, admitted) -> int:
        """How many leading slots take their frozen-scorer state from here: all the carried
        entries ``admitted`` (slot order), or 0 (re-prefill) unless each is this block's row
        for the same sequence, in order."""
        n = len(admitted)
        if n == 0 or n > len(self.ids) or row_ids(admitted) != self.ids[:n]:
            return 0
        return n

    def to_tree(self) -> dict:
        """A plain tree of arrays for an orbax checkpoint."""
        tree = {role: _state_tree(s) for role, s in self.states.items()}
        tree["ids"] = np.asarray(self.ids, np.int64).reshape(-1, 3)
        return tree

    @classmethod
    def from_tree(cls, tree: dict) -> KeptCaches:
        """Back from ``to_tree`` (the arrays as restored: the caller places them)."""
        states = {role: _tree_state(tree[role]) for role in FROZEN if role in tree}
        return cls(states, np.asarray(tree["ids"]).astype(int).tolist())


def _state_tree(s: ScorerState) -> dict:
    return {
        "k": s.cache.k,
        "v": s.cache.v,
        "length": s.cache.length,
        "last_hidden": s.last_hidden,
        "per_token": s.per_token,
        "num_fed": s.num_fed,
        "score": s.score,
    }


def _tree_state(t: dict) -> ScorerState:
    cache = KVCache(k=t["k"], v=t["v"], length=t["length"])
    return ScorerState(cache, t["last_hidden"], t["per_token"], t["num_fed"], t["score"])
