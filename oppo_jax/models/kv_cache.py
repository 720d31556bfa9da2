"""The key/value cache: an explicit pytree passed into the model and returned updated.

Shapes (the one place they are documented):
    k, v:    [L, S, Tc, K, Dh]   per layer, per slot, cache capacity Tc, kv-heads, head dim
    length:  [S] int32           tokens already written for each slot (its next write position)

Each slot holds its tokens contiguously from index 0 (prompt, then response), so a token's
cache index is its position. Rows of one batch may hold different lengths: a write of T new
tokens to slot s lands at indices ``length[s] .. length[s] + T - 1``. Writes past the capacity
are dropped, never wrapped or shifted, so an undersized cache loses tokens instead of silently
overwriting others.

On a mesh the rollout kernels shard S over the batch axes (data x fsdp) and K over tensor
(logical axes ``oppo_jax.sharding.KV_CACHE_AXES``), so each device holds its slots only.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from oppo_jax.models.model_config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for S slots, and each slot's filled length."""

    k: Float[Array, "L S Tc K Dh"]
    v: Float[Array, "L S Tc K Dh"]
    length: Int[Array, " S"]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, num_slots: int, capacity: int) -> KVCache:
    """An empty cache (length 0 everywhere) in the model's activation dtype."""
    shape = (cfg.num_layers, num_slots, capacity, cfg.num_kv_heads, cfg.head_dim)
    zeros = jnp.zeros(shape, cfg.jnp_dtype)
    return KVCache(k=zeros, v=zeros, length=jnp.zeros((num_slots,), jnp.int32))


def write_positions(length: Int[Array, " S"], width: int) -> Int[Array, "S T"]:
    """Cache indices a write of ``width`` tokens fills, per slot.

    Example: length [0, 3], width 2 -> [[0, 1], [3, 4]].
    """
    return length[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]


def write_layer(
    cache_k: Float[Array, "S Tc K Dh"],
    new: Float[Array, "S T K Dh"],
    positions: Int[Array, "S T"],
) -> Float[Array, "S Tc K Dh"]:
    """Scatter one layer's new keys (or values) at per-slot positions; out-of-range ones drop."""
    rows = jnp.arange(new.shape[0])[:, None]
    return cache_k.at[rows, positions].set(new.astype(cache_k.dtype), mode="drop")


def select_slots(cache: KVCache, keep: jax.Array, other: KVCache) -> KVCache:
    """Per-slot choice between two caches: ``keep[s]`` takes slot s from ``cache``."""
    k_mask = keep[None, :, None, None, None]
    return KVCache(
        k=jnp.where(k_mask, cache.k, other.k),
        v=jnp.where(k_mask, cache.v, other.v),
        length=jnp.where(keep, cache.length, other.length),
    )
