"""Slot compaction: move the still-running slots of a rollout into a smaller slot bucket.

Once most slots of a step have finished, a decode chunk still computes every slot (a finished
slot is frozen, not removed). Gathering the running ones into the next smaller power-of-two
bucket makes a chunk cost what its running slots cost. The host keeps the slot -> row map
(``rows[j]`` is the original slot of compact row j), so nothing about a slot changes: its
prompt id, sample index and position travel with it, and so do its sampling keys (a token's
key depends on (seed, prompt id, sample index, position) only).

The state pytrees (``DecodeState``, ``ScorerState``, ``ChunkTokens``, ``CutRule``) keep the
slot axis first in every per-slot leaf except the KV cache's keys and values ([L, S, ...]);
``take_slots`` / ``put_slots`` gather and scatter along that axis and pass other leaves (the
lockstep clock, the sampling key, static fields) through. Dimension letters: S slots, N rows
kept.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jaxtyping import Array, Bool, Int

from oppo_jax.models.kv_cache import KVCache


def slot_bucket(n: int, minimum: int = 1) -> int:
    """The power-of-two slot count that holds ``n`` rows (at least ``minimum``).

    Example: 5 -> 8, 8 -> 8, 0 -> 1.
    """
    return max(minimum, 1 << max(int(n) - 1, 0).bit_length())


def compact_bucket(running: int, slots: int, minimum: int = 1) -> int | None:
    """The smaller slot bucket for ``running`` rows when they fit in half of the bucket of
    ``slots``; None when compacting would not shrink it.

    Example: 8 slots: 2 running -> 2, 3 running -> 4, 5 running -> None; 24 slots (bucket 32):
    13 running -> 16, 17 -> None.
    """
    bucket = slot_bucket(running, minimum)
    if bucket > slot_bucket(slots, minimum) // 2 or bucket >= slots:
        return None
    return bucket


def compact_rows(finished: Bool[Array, " S"], bucket: int) -> Int[Array, " N"]:
    """The ``bucket`` slots to keep: the running ones (ascending), then finished ones to fill
    the bucket. Computed on the device from the flags, so the host reads only a count.

    Example: finished [T, F, T, F], bucket 2 -> [1, 3]; finished [F, T, T, T], 2 -> [0, 1].
    """
    return jnp.argsort(finished, stable=True)[:bucket].astype(jnp.int32)


def _axis(path, leaf) -> int:
    """The slot axis of a leaf: 1 for a KV cache's keys and values, else 0."""
    name = getattr(path[-1], "name", None) if path else None
    return 1 if name in ("k", "v") and leaf.ndim == 5 else 0


def _per_slot(leaf, slots: int, axis: int) -> bool:
    return hasattr(leaf, "ndim") and leaf.ndim > axis and leaf.shape[axis] == slots


def _rows_beside(rows: Array, leaf) -> Array:
    """``rows`` replicated on the devices that hold ``leaf``: the decode state and the scorer
    states may live on different device groups (disaggregated placement), and the row indices
    are computed beside the decode state. A few int32s, copied device to device."""
    target = getattr(leaf, "sharding", None)
    source = getattr(rows, "sharding", None)
    if target is None or source is None or target.device_set == source.device_set:
        return rows
    # An uncommitted leaf (made by jnp on the default device, e.g. the cut rule's flags) follows
    # the rows; moving the rows to it instead would commit the result to one device and a
    # later kernel on the whole mesh would refuse it. (jax has no public name for the flag.)
    if not getattr(leaf, "_committed", True):
        return rows
    if isinstance(target, NamedSharding):
        return jax.device_put(rows, NamedSharding(target.mesh, PartitionSpec()))
    return jax.device_put(rows, SingleDeviceSharding(next(iter(target.device_set))))


@functools.partial(jax.jit, static_argnums=(2,))
def _take_leaves(leaves: list, rows: Array, axes: tuple[int, ...]) -> list:
    return [jnp.take(x, rows, axis=a) for x, a in zip(leaves, axes, strict=True)]


@functools.partial(jax.jit, static_argnums=(3,))
def _put_leaves(fulls: list, parts: list, rows: Array, axes: tuple[int, ...]) -> list:
    index = [(slice(None),) * a + (rows,) for a in axes]
    return [f.at[i].set(p) for f, p, i in zip(fulls, parts, index, strict=True)]


def _by_devices(leaves: list, rows: Array) -> list[tuple[list[int], Array]]:
    """The leaves' indices grouped by the devices that hold them, each group with ``rows``
    placed beside it (``_rows_beside``): one jitted gather or scatter per group, as one
    program cannot take arrays committed to different devices."""
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        beside = _rows_beside(rows, leaf)
        key = frozenset(beside.sharding.device_set) if hasattr(beside, "sharding") else None
        groups.setdefault(key, ([], beside))[0].append(i)
    return list(groups.values())


def take_slots(tree, rows, slots: int):
    """Gather the ``rows`` of every per-slot leaf of ``tree`` (S slots) along its slot axis;
    other leaves pass through unchanged. One jitted program per device group and shapes."""
    rows = jnp.asarray(rows, jnp.int32)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in with_path]
    axes = [_axis(path, leaf) for path, leaf in with_path]
    mine = [i for i, leaf in enumerate(leaves) if _per_slot(leaf, slots, axes[i])]
    for idx, beside in _by_devices([leaves[i] for i in mine], rows):
        picked = [mine[j] for j in idx]
        taken = _take_leaves([leaves[i] for i in picked], beside, tuple(axes[i] for i in picked))
        for i, leaf in zip(picked, taken, strict=True):
            leaves[i] = leaf
    return jax.tree_util.tree_unflatten(treedef, leaves)


def put_slots(full, part, rows):
    """Scatter ``part`` (N rows) back into ``full`` (S slots) at ``rows``: the inverse of
    ``take_slots`` for the kept rows; non-slot leaves come from ``part`` (they moved on)."""
    rows = jnp.asarray(rows, jnp.int32)
    slots = _slot_count(full)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(full)
    fulls = [leaf for _, leaf in with_path]
    out = treedef.flatten_up_to(part)
    axes = [_axis(path, leaf) for path, leaf in with_path]
    mine = [i for i, leaf in enumerate(fulls) if _per_slot(leaf, slots, axes[i])]
    for idx, beside in _by_devices([fulls[i] for i in mine], rows):
        picked = [mine[j] for j in idx]
        leaves = [fulls[i] for i in picked], [out[i] for i in picked]
        put = _put_leaves(*leaves, beside, tuple(axes[i] for i in picked))
        for i, leaf in zip(picked, put, strict=True):
            out[i] = leaf
    return jax.tree_util.tree_unflatten(treedef, out)


def _slot_count(tree) -> int:
    """S of a state pytree: its cache's slot count, or the leading size of its first
    per-slot leaf."""
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, KVCache)):
        if isinstance(leaf, KVCache):
            return leaf.num_slots
    return next(x.shape[0] for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0) >= 1)
