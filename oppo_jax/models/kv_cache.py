"""The key/value cache: an explicit pytree passed into the model and returned updated.

Shapes (the one place they are documented):
    k, v:    [L, S, K, Tc, Dh]   per layer, per slot, kv-heads, cache capacity Tc, head dim
    length:  [S] int32           tokens already written for each slot (its next write position)

Tc and Dh are the two minor dimensions: TPU tiles the last two axes of a bf16 array in
(16, 128) tiles, so a small K (2-4 kv-heads per chip) second-minor would be padded 4-8x.

Each slot holds its tokens contiguously from index 0 (prompt, then response), so a token's
cache index is its position. Rows of one batch may hold different lengths: a write of T new
tokens to slot s lands at indices ``length[s] .. length[s] + T - 1``. Writes past the capacity
are dropped, never wrapped or shifted, so an undersized cache loses tokens instead of silently
overwriting others.

The model scans over layers with the whole [L, ...] buffers as the scan's carry; each layer
writes its new keys and values into them in place (``write_layer``), so a forward step never
copies the cache (when the caller donates it).

Live prefix: a kernel whose tokens all sit at positions below some bound reads only the first
``width`` cache columns of each layer (``read_layer``; a static slice, so the read, the scores
and the softmax cost S·T·width, not S·T·Tc). The host picks ``width`` with ``live_width`` from
what it already knows (context lengths at admission, chunks dispatched), a power of two, so a
run compiles at most ``len(live_widths(Tc))`` variants of each kernel.

On a mesh the rollout kernels shard S over the batch axes (data x fsdp) and K over tensor
(logical axes ``oppo_jax.parallel.sharding.KV_CACHE_AXES``), so each device holds its slots only.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from oppo_jax.base.shapes import MIN_LIVE_WIDTH, live_width, live_widths  # noqa: F401 (re-exported)
from oppo_jax.models.model_config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for S slots, and each slot's filled length."""

    k: Float[Array, "L S K Tc Dh"]
    v: Float[Array, "L S K Tc Dh"]
    length: Int[Array, " S"]

    # jax rebuilds it with non-array leaves (eval_shape, .lower(), sharding trees): the field
    # annotations document the shapes but are not checked at construction.
    __no_type_check__ = True

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, num_slots: int, capacity: int) -> KVCache:
    """An empty cache (length 0 everywhere) in the model's activation dtype."""
    shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, capacity, cfg.head_dim)
    zeros = jnp.zeros(shape, cfg.jnp_dtype)
    return KVCache(k=zeros, v=zeros, length=jnp.zeros((num_slots,), jnp.int32))


def write_positions(length: Int[Array, " S"], width: int) -> Int[Array, "S T"]:
    """Cache indices a write of ``width`` tokens fills, per slot.

    Example: length [0, 3], width 2 -> [[0, 1], [3, 4]].
    """
    return length[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]


def write_layer(
    buffer: Float[Array, "L S K Tc Dh"],
    layer: Int[Array, ""],
    new: Float[Array, "N T K Dh"],
    positions: Int[Array, "N T"],
    slots: Int[Array, "N T"] | None = None,
) -> Float[Array, "L S K Tc Dh"]:
    """Scatter layer ``layer``'s new keys (or values) at per-slot positions, in place; token
    (n, i) of ``new`` belongs to slot ``slots[n, i]`` (None: slot n, N = S).

    One scatter into the whole buffer: XLA updates a donated (or loop-carried) buffer in
    place, where slicing out a layer and stacking the layers again would copy it twice.
    Out-of-range positions and slots are dropped (a padding row's slot is S: it writes nothing).
    """
    n, t, k, _ = new.shape
    rows = jnp.arange(n)[:, None] if slots is None else slots
    # One index (layer, slot, kv head, position) per Dh values: the scatter's window is the
    # minor axis alone, so the buffer keeps its row-major layout. With [K, Dh] windows, which
    # straddle Tc, XLA:TPU laid the carried cache out K-minor-of-Tc for the scatter and copied
    # it whole into the ragged kernel's row-major operand at every layer of every step.
    parts = jnp.broadcast_arrays(layer, rows[..., None], jnp.arange(k), positions[..., None])
    index = jnp.stack(parts, axis=-1).astype(jnp.int32)  # [N T K 4]
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(3,), inserted_window_dims=(0, 1, 2, 3),
        scatter_dims_to_operand_dims=(0, 1, 2, 3),
    )  # fmt: skip
    return jax.lax.scatter(
        buffer, index, new.astype(buffer.dtype), dims,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )  # fmt: skip


def read_layer(
    buffer: Float[Array, "L S K Tc Dh"],
    layer: Int[Array, ""],
    width: int | None = None,
    rows: Int[Array, " N"] | None = None,
) -> Float[Array, "N W K Dh"]:
    """One layer's keys (or values) in the [N, W, K, Dh] layout attention takes: the first
    ``width`` cache columns (static; all Tc when None) of the slots ``rows`` (None: every
    slot; an out-of-range slot reads the last one, for a padding row). A slice read: the
    buffer itself is neither copied nor resized; with ``rows``, only their prefixes are."""
    one = jax.lax.dynamic_index_in_dim(buffer, layer, 0, keepdims=False)
    if width is not None:
        one = jax.lax.slice_in_dim(one, 0, width, axis=2)
    if rows is not None:
        one = jnp.take(one, rows, axis=0, mode="clip")
    return jnp.swapaxes(one, 1, 2)
