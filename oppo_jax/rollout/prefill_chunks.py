"""Prefill in sequence chunks: the admission's activations bounded by a chunk, not the width.

One cached call over rows of width T holds every layer's activations for all S x T tokens at
once (a Qwen2.5-7B admission of 112 rows x 512 prompt tokens: two float32 [57,344, 18,944] MLP
tensors of 4.05 GiB each). The same tokens fed into the cache ``chunk`` columns at a time, in a
``lax.scan`` whose carry is the cache, hold one chunk's activations: any split of a sequence
into successive cached calls gives the same keys, values and hidden states as one call (the
model's tested invariant), so only the shapes change.

Dimension letters: S rows, T context width, C tokens per chunk, N chunks, D model width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from oppo_jax.models.heads import gather_rows
from oppo_jax.models.kv_cache import KVCache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import cached_hidden
from oppo_jax.parallel.sharding import constrain_slots

# Tokens one device prefills in a call (rows per device x chunk width), read when traced:
# below it an admission runs in one call, as before. 8,192 tokens of a 7B model are
# [8192, 18944] MLP activations, 0.3 GiB each in bf16: large enough matmuls to keep a GPU
# busy, small beside the weights and caches.
PREFILL_TOKEN_BUDGET = 8192
MIN_PREFILL_CHUNK = 16  # thinner chunks would re-read the weights for too little work


def prefill_chunk(rows_per_device: int, width: int, budget: int | None = None) -> int:
    """Tokens per chunk: the whole ``width`` when ``rows_per_device x width`` fits ``budget``
    (default ``PREFILL_TOKEN_BUDGET``), else the width split into as few equal chunks as fit
    it, rounded up to a multiple of ``MIN_PREFILL_CHUNK`` (and never thinner than that).

    Example (budget 8192): 120 rows x 512 -> 64 (8 chunks); 8 x 1536 -> 768; 8 x 512 -> 512.
    """
    budget = PREFILL_TOKEN_BUDGET if budget is None else budget
    if rows_per_device * width <= budget:
        return width
    chunks = -(-rows_per_device * width // budget)
    chunk = -(-width // chunks)
    return -(-chunk // MIN_PREFILL_CHUNK) * MIN_PREFILL_CHUNK


def chunked_prefill(
    cfg: ModelConfig,
    params,
    cache: KVCache,
    tokens: Int[Array, "S T"],
    n_valid: Int[Array, " S"],
    chunk: int,
    mesh: Mesh | None = None,
) -> tuple[Float[Array, "S D"], KVCache]:
    """Append ``n_valid[s]`` tokens of each right-padded row to an empty ``cache``, ``chunk``
    tokens per call.

    Returns (hidden state at each row's last valid token [S, D] (token 0 when ``n_valid`` is
    0, as one call gives), the cache). Equal to one ``cached_hidden`` call over the whole
    width at every valid token. With ``mesh`` the scan's carry is laid out along the rows.
    """
    s, t = tokens.shape
    n = -(-t // chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, n * chunk - t)))
    # Valid tokens sit at positions < T: attention reads that many columns at most.
    width = min(n * chunk, cache.capacity)
    last = jnp.maximum(n_valid - 1, 0)

    def one_chunk(carry, start):
        cache, last_hidden = carry
        part = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        # A row past its end takes 0 tokens: its length stops and only scratch is written.
        valid = jnp.clip(n_valid - start, 0, chunk)
        hidden, cache = cached_hidden(cfg, params, cache, part, valid, kv_width=width)
        here = (last >= start) & (last < start + chunk)
        picked = gather_rows(hidden, (last - start)[:, None])[:, 0]
        last_hidden = jnp.where(here[:, None], picked, last_hidden)
        return (cache, last_hidden), None

    init = constrain_slots((cache, jnp.zeros((s, cfg.hidden_size), cfg.jnp_dtype)), mesh)
    starts = jnp.arange(n, dtype=jnp.int32) * chunk
    (cache, last_hidden), _ = jax.lax.scan(one_chunk, init, starts)
    return last_hidden, cache
