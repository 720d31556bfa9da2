"""Ragged decode attention's TPU lowering (Pallas Mosaic): each row's DMAs stop at its length.

``models.ragged_decode`` holds the contract (each row of a decode step attends to keys
``0 .. lengths[s] - 1`` of its slot, read from the cache buffer [L, S, K, Tc, Dh] itself) and
the GPU lowering. A Mosaic kernel cannot index a buffer in HBM block by block the way a Triton
program loads through pointers; its operands reach it as blocks that the pipeline copies into
VMEM. So here the key blocks are a grid axis, and the lengths and the layer index are
scalar-prefetched (they sit in SMEM before the grid runs) so that the cache's block index map
can read them:

- grid (slot, key block); the key-block axis is sequential ("arbitrary"), the slots parallel,
  and an online softmax per kv head over it lives in VMEM scratch (running max, sum, output);
- the cache block of step n is (layer, slot, every kv head, min(n, last), :) with ``last`` the
  row's last block holding a key: past it the index stays put, and the pipeline copies a
  block only when its index changes, so a row's HBM reads stop at its length (a row of length
  0 reads one block, then nothing); ``pl.when`` skips the compute there too;
- each program holds every kv head's G = H / K query heads padded to ``MIN_GROUP`` rows (a
  sublane multiple for float32 and bfloat16), runs a 2-D matmul per kv head, and writes its
  normalised output at the last key block.

Why every kv head and blocks of up to 1024 keys (``key_block``) in one step: a TPU grid step costs
about 0.35 µs of fixed overhead (Pallas's TPU guide), about what copying such a block (1 MiB at the
7B's 2 kv heads) takes, so smaller steps would cost more in overhead than the reads they save; with
these the kernel follows the bytes it reads (docs/PROJECTIONS.md, "The ragged decode on TPU"). The
cost: a running row reads up to 1023 keys past its length. VMEM holds two buffers of each cache
block: 4 MiB at 2 kv heads, 8 MiB at 4 (under the default scoped limit). Off a TPU it runs in
Pallas's interpreter (tests).

Dimension letters: S slots, K kv heads, G query rows per kv head, Tc cache columns, Dh head
width, L layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from oppo_jax.base import shapes

MIN_GROUP = 16  # query rows per kv head at least: bfloat16's sublane tile
LANES = 128  # the running max and sum are kept lane-wide (one vreg row each)
KEY_BLOCK = shapes.RAGGED_KEY_BLOCK_TPU  # keys per grid step at most


def key_block(width: int) -> int:
    """The key block for a live width: the largest power of two <= KEY_BLOCK dividing it.
    Example: 2048 -> 1024, 2304 -> 256, 528 -> 16."""
    return shapes.pow2_block(width, KEY_BLOCK)


def fits_tpu(head_dim: int, width: int) -> bool:
    """Whether Mosaic takes these shapes: a key block of at least 16 rows (bfloat16's sublane
    tile); any head width (a block spans it whole)."""
    return head_dim >= 1 and key_block(width) >= 16


def attend(
    grouped: Float[Array, "S K G Dh"],
    k_cache: Float[Array, "L S K Tc Dh"],
    v_cache: Float[Array, "L S K Tc Dh"],
    layer: Int[Array, ""],
    lengths: Int[Array, " S"],
    *,
    width: int,
    interpret: bool,
) -> Float[Array, "S K G Dh"]:
    """The kernel over one device's rows (module docstring): ``grouped`` holds each kv head's
    query rows, padded to at least ``MIN_GROUP``; ``lengths`` are clipped to [0, width]; the
    output is normalised (a row without keys gives zeros), in float32."""
    s, kv, rows, dh = grouped.shape
    block = key_block(width)
    cache_block = functools.partial(cache_block_index, block=block)
    cache_spec = pl.BlockSpec((None, None, kv, block, dh), cache_block)
    rows_spec = pl.BlockSpec((None, kv, rows, dh), lambda i, n, *_: (i, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # the layer (as [1]) and the lengths
        grid=(s, width // block),
        in_specs=[rows_spec, cache_spec, cache_spec],
        out_specs=rows_spec,
        scratch_shapes=[
            pltpu.VMEM((kv, rows, LANES), jnp.float32),  # running max, lane-replicated
            pltpu.VMEM((kv, rows, LANES), jnp.float32),  # running sum
            pltpu.VMEM((kv, rows, dh), jnp.float32),  # unnormalised output
        ],
    )
    kernel = functools.partial(_kernel, block=block, heads=kv, scale=dh**-0.5)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((s, kv, rows, dh), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_decode_attention_tpu",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths, grouped, k_cache, v_cache)


def _precision(dtype) -> jax.lax.Precision:
    """The kernel's matmul precision, whatever ``jax_default_matmul_precision`` says: float32
    operands at full precision, narrower ones as they are (Mosaic refuses a float32
    contraction of bfloat16 operands: "Bad lhs type", caught by compiling for a v5p)."""
    full = jnp.dtype(dtype) == jnp.dtype(jnp.float32)
    return jax.lax.Precision.HIGHEST if full else jax.lax.Precision.DEFAULT


def cache_block_index(slot, step, layer_ref, lengths_ref, *, block: int):
    """The cache block grid step (``slot``, ``step``) reads: layer, slot, every kv head, key
    block min(step, last) with ``last`` the slot's last block holding a key (0 for a slot
    without keys). Past ``last`` the index repeats, so the pipeline copies nothing more.

    Example: block 1024, length 1500: steps 0, 1, 2, 3 -> key blocks 0, 1, 1, 1.
    """
    # lax.div: lengths are >= 0, and floor division's sign fix-up does not lower to Mosaic
    last = jnp.maximum(jax.lax.div(lengths_ref[slot] + block - 1, block) - 1, 0)
    return layer_ref[0], slot, 0, jnp.minimum(step, last), 0


def _kernel(
    layer_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, block, heads,
    scale,
):  # fmt: skip
    """One (slot, key block): fold the block into each kv head's online softmax when it holds
    keys below the row's length; write the outputs after the last block."""
    del layer_ref  # read by the cache's index map only
    row, step = pl.program_id(0), pl.program_id(1)
    length, first = lengths_ref[row], step * block
    lowest = jnp.finfo(jnp.float32).min  # finite: exp(lowest - max) is 0, never nan

    @pl.when(step == 0)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, lowest, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(first < length)
    def _fold():
        for head in range(heads):  # unrolled: 2-D matmuls per kv head
            q, keys, values = q_ref[head], k_ref[head], v_ref[head]
            nt = (((1,), (1,)), ((), ()))  # q · keysᵀ without a transpose: [G, block]
            logits = jax.lax.dot_general(
                q,
                keys.astype(q.dtype),
                nt,
                preferred_element_type=jnp.float32,
                precision=_precision(q.dtype),
            )
            logits = logits * scale
            key = first + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            logits = jnp.where(key < length, logits, lowest)
            m_prev = m_ref[head]
            m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))  # [G, LANES]
            correction = jnp.exp(m_prev - m_next)
            p = jnp.exp(logits - m_next[:, :1])
            l_ref[head] = correction * l_ref[head] + jnp.sum(p, axis=1, keepdims=True)
            update = jnp.dot(
                p.astype(values.dtype),
                values,
                preferred_element_type=jnp.float32,
                precision=_precision(values.dtype),
            )
            acc_ref[head] = correction[:, :1] * acc_ref[head] + update
            m_ref[head] = m_next

    @pl.when(step == pl.num_programs(1) - 1)
    def _finish():
        total = l_ref[:, :, :1]
        o_ref[...] = acc_ref[...] / jnp.where(total > 0, total, 1.0)
