"""Kept caches of the frozen scorers: a carried row's reference and reward-model state (KV cache,
last hidden state, per-token log-probs, score) is kept from the step that cut it to the step
that re-admits it, so those two models never prefill a carried prefix again.

Both models are frozen, so a kept cache is exactly what a re-prefill would compute (up to the
rounding of a chunk-wise versus a one-shot prefill). The critic (trained) and the actor (new
parameters) are still re-prefilled at every admission. Only carried rows are kept, gathered
into a bucket of at most Δ_max rows (``kept_bucket``), so the memory is bounded by Δ_max rows of
each frozen scorer's cache. Rows are in the carry buffer's order (the next step admits carried
sequences first, FIFO), and each row carries the identity of its sequence, so a row is only
reused for the very sequence it was cut from. For resume the rows go into the checkpoint as
orbax arrays (``to_tree`` / ``from_tree``): a resumed run continues bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from oppo_jax.models.kv_cache import KVCache
from oppo_jax.scoring.stream import ScorerState

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
