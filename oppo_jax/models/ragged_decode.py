"""Ragged decode attention: each row of a decode step reads only its own keys.

A decode step (one new token per slot) attends to keys ``0 .. lengths[s] - 1`` of its slot.
XLA's attention over the live prefix reads ``width`` keys for every slot: the longest live
context, finished slots included, so a step's KV-cache traffic follows the longest row. This
kernel walks each row's keys in blocks up to its own length, so the traffic follows the rows'
contexts, and a row of length 0 (a slot that takes no token this step: ``models.transformer``
passes 0 for it) reads nothing. That is what makes finished slots free on an accelerator
without moving them (slot compaction's gathers).

It reads the cache buffer itself, [L, S, K, Tc, Dh], with the layer index as an operand:
slicing the layer out or transposing it to [S, Tc, K, Dh] before a Pallas call (a custom call,
whose operands XLA must materialise) would copy the whole live cache at every layer of every
step, the traffic the kernel exists to save.

Grid (slot, kv head, key split), flash-decoding style: each program holds its kv head's
G = H / K query heads (padded to ``MIN_GROUP`` rows, Triton's smallest dot), runs an online
softmax over its split's key blocks that lie below the row's length, and writes an unscaled
output with its running max and sum; XLA combines the splits, so a few long rows still spread
over the GPU's cores. Pallas lowers it to Triton on a GPU. On a TPU the kernel is
``models.ragged_decode_tpu``'s (Mosaic: key blocks as a grid axis whose block index stops at
the row's length, so the pipeline's copies do). Elsewhere the Triton form runs in Pallas's
interpreter (tests, and ``model.attention=ragged`` on a CPU); ``lowering`` picks a form
explicitly, so the TPU one is tested in the interpreter too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

import oppo_jax.models.platform as platform
import oppo_jax.models.ragged_decode_tpu as ragged_decode_tpu
from oppo_jax.base import shapes

KEY_BLOCK = shapes.RAGGED_KEY_BLOCK  # keys per block at most
MIN_GROUP = 16  # query rows per program at least: Triton's smallest dot
SPLIT_KEYS = 1024  # keys per split at least, before a row is split over more programs
MAX_SPLITS = 16
CACHE_AXES = ("layers", "batch", "kv_heads", "length", None)  # sharding.KV_CACHE_AXES


def key_block(width: int) -> int:
    """The key block for a live width: the largest power of two <= KEY_BLOCK dividing it (a
    block never reads past the width). Example: 1536 -> 128, 80 -> 16, 24 -> 8."""
    return shapes.pow2_block(width, KEY_BLOCK)


def fits_gpu(head_dim: int, width: int) -> bool:
    """Whether Triton takes these shapes: power-of-two heads and key blocks of >= 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and key_block(width) >= 16


def fits(head_dim: int, width: int, backend: str) -> bool:
    """Whether ``backend``'s lowering takes these shapes (a CPU has none: the interpreter is
    for tests)."""
    if backend == "tpu":
        return ragged_decode_tpu.fits_tpu(head_dim, width)
    return backend == "gpu" and fits_gpu(head_dim, width)


def lowering_for(backend: str) -> str:
    """The kernel's form on ``backend``: "mosaic" on a TPU, "triton" elsewhere."""
    return "mosaic" if backend == "tpu" else "triton"


def block_for(width: int, lowering: str | None = None) -> int:
    """The keys a row reads at a time (whole blocks) in ``lowering`` (default: the backend's)
    at live ``width``: what the work ledger counts. Example: 2048 -> 128 (Triton), 512
    (Mosaic)."""
    if (lowering or lowering_for(platform.current())) == "mosaic":
        return ragged_decode_tpu.key_block(width)
    return key_block(width)


def splits_for(width: int) -> int:
    """Key splits per row: one per SPLIT_KEYS keys, at most MAX_SPLITS (a power of two)."""
    n = 1
    while n < MAX_SPLITS and width >= 2 * n * SPLIT_KEYS:
        n *= 2
    return n


def ragged_decode_attention(
    q: Float[Array, "S 1 H Dh"],
    k_cache: Float[Array, "L S K Tc Dh"],
    v_cache: Float[Array, "L S K Tc Dh"],
    layer: Int[Array, ""],
    lengths: Int[Array, " S"],
    width: int,
    lowering: str | None = None,
    interpret: bool | None = None,
) -> Float[Array, "S 1 H Dh"]:
    """Attention of each row's query over its keys ``0 .. lengths[s] - 1`` of cache layer
    ``layer`` (module docstring); no key at or past ``width`` (static) is read. ``lowering``
    ("triton" | "mosaic"; default ``lowering_for`` the backend) runs in the interpreter off
    its own backend unless ``interpret`` says (False: lower it for its backend, to inspect
    on another one). Under a mesh each device runs the kernel on its own slots and kv heads
    (``shard_map``: a Pallas call is not partitioned by the compiler)."""
    backend = platform.current()
    lowering = lowering or lowering_for(backend)
    if lowering not in ("triton", "mosaic"):
        raise ValueError(f"ragged decode lowering {lowering!r}: expected 'triton' or 'mosaic'")
    if interpret is None:
        interpret = backend != {"triton": "gpu", "mosaic": "tpu"}[lowering]
    lengths = jnp.clip(lengths, 0, width).astype(jnp.int32)
    run = functools.partial(_attend, width=width, lowering=lowering, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return run(q, k_cache, v_cache, layer, lengths)
    rows = nn.logical_to_mesh_axes(("batch",))
    heads = nn.logical_to_mesh_axes(("batch", "length", "heads", None))
    cache = nn.logical_to_mesh_axes(CACHE_AXES)
    if (
        heads[2] != cache[2]
        or q.shape[2] % mesh_size(mesh, heads[2])
        or (k_cache.shape[2] % mesh_size(mesh, cache[2]))
    ):  # each device must hold whole query groups with their kv heads
        raise ValueError(
            f"ragged decode attention: {q.shape[2]} query heads over {heads[2]} and "
            f"{k_cache.shape[2]} kv heads over {cache[2]} do not split into whole groups "
            "per device; use model.attention=xla for this mesh"
        )
    specs = (heads, cache, cache, PartitionSpec(), rows)
    shard = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)
    return shard(q, k_cache, v_cache, layer, lengths)


def mesh_size(mesh, axes) -> int:
    """Devices a spec entry (None, an axis name or a tuple of them) splits a dimension over."""
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(math.prod(mesh.shape[a] for a in names))


def _attend(q, k_cache, v_cache, layer, lengths, *, width: int, lowering: str, interpret: bool):
    """One device's rows: each kv head's query rows grouped, then the kernel of ``lowering``."""
    s, _, h, dh = q.shape
    kv = k_cache.shape[2]
    group = h // kv
    rows = max(MIN_GROUP, 1 << (group - 1).bit_length())
    grouped = q[:, 0].reshape(s, kv, group, dh)
    grouped = jnp.pad(grouped, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    if lowering == "mosaic":
        run = functools.partial(ragged_decode_tpu.attend, width=width)
    else:
        run = functools.partial(_attend_triton, block=key_block(width), width=width)
    out = run(grouped, k_cache, v_cache, layer, lengths, interpret=interpret)
    return out[:, :, :group].reshape(s, 1, h, dh).astype(q.dtype)


def _attend_triton(grouped, k_cache, v_cache, layer, lengths, *, block, width, interpret):
    """The Triton form: the kernel over (slot, kv head, split), then the splits combined."""
    s, kv, rows, dh = grouped.shape
    splits = splits_for(width)
    split = -(-width // splits // block) * block  # keys per split, whole blocks
    kernel = functools.partial(_kernel, block=block, split=split, width=width, scale=dh**-0.5)
    out, top, total = pl.pallas_call(
        kernel,
        grid=(s, kv, splits),
        in_specs=[
            pl.BlockSpec((), lambda i, j, n: ()),  # the layer
            pl.BlockSpec((None,), lambda i, j, n: (i,)),  # this row's length
            pl.BlockSpec((None, None, rows, dh), lambda i, j, n: (i, j, 0, 0)),
            pl.no_block_spec,  # the caches: whole buffers, read block by block inside
            pl.no_block_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dh), lambda i, j, n: (i, j, n, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, j, n: (i, j, n, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, j, n: (i, j, n, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((s, kv, splits, rows, dh), jnp.float32),
            jax.ShapeDtypeStruct((s, kv, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((s, kv, splits, rows), jnp.float32),
        ],
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),  # Triton
        interpret=interpret,
        name="ragged_decode_attention",
    )(layer.astype(jnp.int32), lengths, grouped, k_cache, v_cache)
    # Flash-decoding's combine: rescale each split to the row's max, then normalise.
    best = jnp.max(top, axis=2, keepdims=True)
    weight = jnp.exp(top - best)
    norm = jnp.sum(total * weight, axis=2)
    merged = jnp.sum(out * weight[..., None], axis=2)
    return merged / jnp.where(norm > 0, norm, 1.0)[..., None]  # a row with no keys: zeros


def _kernel(
    layer_ref, length_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block, split, width, scale
):
    """One (slot, kv head, split): an online softmax over the split's key blocks below the
    row's length (and the live ``width``)."""
    row, head, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, length = layer_ref[()], length_ref[()]
    start = part * split
    stop = jnp.minimum(jnp.minimum(length, start + split), width)
    q = q_ref[...]
    lowest = jnp.finfo(jnp.float32).min  # finite: exp(lowest - max) is 0, never nan

    def body(i, carry):
        o, m, total = carry
        first = start + i * block
        keys = k_ref[layer, row, head, pl.ds(first, block), :].astype(q.dtype)
        values = v_ref[layer, row, head, pl.ds(first, block), :].astype(q.dtype)
        logits = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * scale
        seen = (first + jnp.arange(block)) < stop
        logits = jnp.where(seen[None, :], logits, lowest)
        m_next = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(logits - m_next[:, None])
        total_next = correction * total + jnp.sum(p, axis=1)
        o_next = correction[:, None] * o + jnp.dot(
            p.astype(values.dtype), values, preferred_element_type=jnp.float32
        )
        return o_next, m_next, total_next

    rows, dh = q.shape
    init = (
        jnp.zeros((rows, dh), jnp.float32),
        jnp.full((rows,), lowest, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    blocks = jnp.maximum(stop - start + block - 1, 0) // block
    o, m, total = jax.lax.fori_loop(0, blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = total
