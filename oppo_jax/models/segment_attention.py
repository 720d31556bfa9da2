"""Causal attention within the segments of packed rows, visiting only the key blocks a query
block's segment can see: the packed update's attention on a GPU.

A packed row holds several sequences side by side, each a contiguous run of one segment id
(``ppo.packing``: first-fit decreasing from column 0; the unused tail is padding, -1). XLA's
attention masks the cross-segment pairs but computes them: every query against every key of
the row, W² pairs per row of width W, so a row of 16,384 columns holding six sequences of
~2,700 tokens computes 268M pairs where the sequences' own causal pairs are 22M. cuDNN's fused
kernel takes no segments. This kernel splits the row into query and key blocks and has each
query block visit key blocks from the one holding its first query's segment start up to the
diagonal: a block's work follows its own sequence's prefix, not the row's.

Forward (FlashAttention-2): grid (row, query head, query block), an online softmax over the
visited key blocks, masked within a block to the same segment and keys at or before the query;
it keeps the output and the log-sum-exp. Backward, two kernels: dQ over the same key blocks per
query block, and dK/dV per key block over the query blocks that visit it (a contiguous range:
the segment start is non-decreasing along the row, so the blocks visiting key block j run from
the one holding key j·b to the last whose first query's segment starts at or before j·b + b - 1),
per query head, summed over each kv head's group. The visited ranges are computed from the
segment ids in XLA, one small [S, T / b] table each.

Padding (segment id < 0, the packed layouts' unused slots: ``ppo.packing``,
``scoring.packed``) costs nothing where a whole block of it sits: such a query block visits no
key block and yields zeros (no real query reads a padding key, so nothing real changes). Every
other query equals XLA's ``attention`` with the mask ``same segment & key <= query`` wherever
each segment id is one contiguous run of a row (the packings' layout; a repeated id elsewhere
would still see only its own run here). Pallas lowers it to Triton on a GPU; elsewhere it runs in
Pallas's interpreter (tests, and ``model.attention=ragged`` on a CPU).

Dimension letters: S rows, T positions, H query heads, K kv heads, Dh head width, b block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

import oppo_jax.models.platform as platform
import oppo_jax.models.ragged_decode as ragged_decode
from oppo_jax.base import shapes

BLOCK = shapes.SEGMENT_BLOCK  # queries and keys per block at most
MIN_BLOCK = 16  # Triton's smallest dot


def block_for(width: int) -> int:
    """The block at row ``width``: the largest power of two <= BLOCK dividing it (blocks tile
    the row exactly). Example: 1024 -> 64, 80 -> 16, 24 -> 8 (too thin: ``fits`` is False)."""
    return shapes.pow2_block(width, BLOCK)


def fits(head_dim: int, width: int) -> bool:
    """Whether the Triton form takes these shapes: power-of-two heads of >= 16 and blocks of
    >= 16 (packed update rows at the default 16-token ``ppo.pack_granule`` always are)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and block_for(width) >= MIN_BLOCK


def visited_blocks(segment_ids: Int[Array, "S T"], block: int):
    """(first key block each query block visits [S, T/b], one past the last query block that
    visits each key block [S, T/b]): the first query's segment start (past the diagonal, so
    none, for a block of padding only), and the count of query blocks whose first is at or
    before the key block (module docstring; ``first`` stays non-decreasing).

    Example: segments [0 0 0 1 1 1 -1 -1] in blocks of 2 -> first [0 0 1 4], end [2 3 3 3]."""
    s, t = segment_ids.shape
    pos = jnp.arange(t, dtype=jnp.int32)
    new_run = jnp.concatenate(
        [jnp.ones((s, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    run_start = jax.lax.cummax(jnp.where(new_run, pos, 0), axis=1)  # [S, T]
    blocks = jnp.arange(t // block, dtype=jnp.int32)
    first = run_start[:, ::block] // block  # [S, Nb]
    padding = jnp.all(segment_ids.reshape(s, t // block, block) < 0, axis=2)
    first = jnp.where(padding, blocks[None, :] + 1, first)  # visits nothing
    end = jnp.sum(first[:, None, :] <= blocks[None, :, None], axis=2).astype(jnp.int32)
    return first.astype(jnp.int32), end


def segment_attention(
    q: Float[Array, "S T H Dh"],
    k: Float[Array, "S T K Dh"],
    v: Float[Array, "S T K Dh"],
    segment_ids: Int[Array, "S T"],
    interpret: bool | None = None,
    block: int | None = None,
) -> Float[Array, "S T H Dh"]:
    """Causal attention of each query over the earlier keys of its own segment (module
    docstring); ``interpret`` defaults to Pallas's interpreter off a GPU, ``block`` to
    ``block_for`` the width (tests take smaller ones). Under a mesh each device runs the
    kernel on its own rows and heads (``shard_map``)."""
    if interpret is None:
        interpret = platform.current() != "gpu"
    block = block or block_for(q.shape[1])
    if q.shape[1] % block:
        raise ValueError(f"segment attention: width {q.shape[1]} is not a multiple of {block}")
    run = functools.partial(_per_device, block=block, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return run(q, k, v, segment_ids)
    rows = nn.logical_to_mesh_axes(("batch", "length"))
    heads = nn.logical_to_mesh_axes(("batch", "length", "heads", None))
    split = ragged_decode.mesh_size(mesh, heads[2])
    if q.shape[2] % split or k.shape[2] % split:  # each device: whole query groups
        raise ValueError(
            f"segment attention: {q.shape[2]} query heads and {k.shape[2]} kv heads do not "
            f"split into whole groups over {heads[2]} ({split} devices); use "
            "model.attention=xla for this mesh"
        )
    if q.shape[0] % ragged_decode.mesh_size(mesh, rows[0]):
        # fewer rows than the batch axes' devices (sync scoring's packed call of a small
        # batch, laid out replicated): every device takes every row, its own heads
        rows = PartitionSpec(None, None)
        heads = PartitionSpec(None, None, heads[2], None)
    specs = (heads, heads, heads, rows)
    shard = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)
    return shard(q, k, v, segment_ids)


def _per_device(q, k, v, segment_ids, *, block: int, interpret: bool):
    """One device's rows: heads first ([S, H, T, Dh]), the kernels, back to [S, T, H, Dh]."""
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"segment attention: {q.shape[2]} query heads do not group over {k.shape[2]} kv heads"
        )
    first, end = visited_blocks(segment_ids, block)
    heads_first = (x.swapaxes(1, 2) for x in (q, k, v))
    out = _attention(*heads_first, segment_ids.astype(jnp.int32), first, end, block, interpret)
    return out.swapaxes(1, 2).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, segments, first, end, block, interpret):
    return _forward(q, k, v, segments, first, block, interpret)[0]


def _attention_fwd(q, k, v, segments, first, end, block, interpret):
    out, lse = _forward(q, k, v, segments, first, block, interpret)
    return out, (q, k, v, segments, first, end, out, lse)


def _attention_bwd(block, interpret, residuals, d_out):
    q, k, v, segments, first, end, out, lse = residuals
    # FlashAttention-2's row term: Σ_d dO·O per query (the softmax's Jacobian needs it)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    grads = (d_out.astype(q.dtype), lse, delta)  # what both backward kernels read
    dq = _backward_dq((q, k, v), segments, grads, first, block, interpret)
    dk, dv = _backward_dkv((q, k, v), segments, grads, end, block, interpret)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)

_LOWEST = float(jnp.finfo(jnp.float32).min)  # finite: exp(lowest - max) is 0, never nan


def _params():
    return pl_triton.CompilerParams(num_warps=4, num_stages=2)


def _mask(q_seg, k_seg, q_first, k_first, block):
    """[b, b]: same segment and key at or before the query."""
    q_pos = q_first + jnp.arange(block)
    k_pos = k_first + jnp.arange(block)
    return (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def _forward(q, k, v, segments, first, block, interpret):
    """Output [S, H, T, Dh] and log-sum-exp [S, H, T] (float32)."""
    s, h, t, dh = q.shape
    group = h // k.shape[1]
    kernel = functools.partial(_forward_kernel, block=block, group=group, scale=dh**-0.5)
    return pl.pallas_call(
        kernel,
        grid=(s, h, t // block),
        in_specs=[
            pl.BlockSpec((None, None, block, dh), lambda r, j, i: (r, j, i, 0)),
            pl.no_block_spec,  # keys, values and segments: read block by block inside
            pl.no_block_spec,
            pl.no_block_spec,
            pl.BlockSpec((None, None), lambda r, j, i: (r, i)),  # first visited key block
        ],
        out_specs=[
            pl.BlockSpec((None, None, block, dh), lambda r, j, i: (r, j, i, 0)),
            pl.BlockSpec((None, None, block), lambda r, j, i: (r, j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((s, h, t, dh), q.dtype),
            jax.ShapeDtypeStruct((s, h, t), jnp.float32),
        ],
        compiler_params=_params(),
        interpret=interpret,
        name="segment_attention_fwd",
    )(q, k, v, segments, first)


def _forward_kernel(
    q_ref, k_ref, v_ref, seg_ref, first_ref, o_ref, lse_ref, *, block, group, scale
):
    row, head, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head, q_first = head // group, qb * block
    q = q_ref[...]
    q_seg = seg_ref[row, pl.ds(q_first, block)]

    def body(kb, carry):
        o, m, total = carry
        k_first = kb * block
        keys = k_ref[row, kv_head, pl.ds(k_first, block), :]
        values = v_ref[row, kv_head, pl.ds(k_first, block), :]
        k_seg = seg_ref[row, pl.ds(k_first, block)]
        logits = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(_mask(q_seg, k_seg, q_first, k_first, block), logits, _LOWEST)
        m_next = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(logits - m_next[:, None])
        total_next = correction * total + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return correction[:, None] * o + pv, m_next, total_next

    dh = q.shape[-1]
    init = (
        jnp.zeros((block, dh), jnp.float32),
        jnp.full((block,), _LOWEST, jnp.float32),
        jnp.zeros((block,), jnp.float32),
    )
    # A visited block's queries each see themselves, so total > 0; a padding block visits
    # nothing and yields zeros (its lse is never read: no backward program visits it).
    o, m, total = jax.lax.fori_loop(first_ref[()], qb + 1, body, init)
    total = jnp.where(total > 0, total, 1.0)
    o_ref[...] = (o / total[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(total)


def _backward_dq(qkv, segments, grads, first, block, interpret):
    """dQ [S, H, T, Dh] (``grads`` = (dO, logsumexp, Σ dO·O) of the forward's rows)."""
    (q, k, v), (d_out, lse, delta) = qkv, grads
    s, h, t, dh = q.shape
    group = h // k.shape[1]
    kernel = functools.partial(_dq_kernel, block=block, group=group, scale=dh**-0.5)
    per_query = pl.BlockSpec((None, None, block, dh), lambda r, j, i: (r, j, i, 0))
    per_query_row = pl.BlockSpec((None, None, block), lambda r, j, i: (r, j, i))
    return pl.pallas_call(
        kernel,
        grid=(s, h, t // block),
        in_specs=[
            per_query,
            pl.no_block_spec,
            pl.no_block_spec,
            pl.no_block_spec,
            per_query,  # dO
            per_query_row,  # lse
            per_query_row,  # delta
            pl.BlockSpec((None, None), lambda r, j, i: (r, i)),
        ],
        out_specs=per_query,
        out_shape=jax.ShapeDtypeStruct((s, h, t, dh), jnp.float32),
        compiler_params=_params(),
        interpret=interpret,
        name="segment_attention_dq",
    )(q, k, v, segments, d_out, lse, delta, first)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    seg_ref,
    do_ref,
    lse_ref,
    delta_ref,
    first_ref,
    dq_ref,
    *,
    block,
    group,
    scale,
):
    row, head, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head, q_first = head // group, qb * block
    q, d_out = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_seg = seg_ref[row, pl.ds(q_first, block)]

    def body(kb, dq):
        k_first = kb * block
        keys = k_ref[row, kv_head, pl.ds(k_first, block), :]
        values = v_ref[row, kv_head, pl.ds(k_first, block), :]
        k_seg = seg_ref[row, pl.ds(k_first, block)]
        logits = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * scale
        seen = _mask(q_seg, k_seg, q_first, k_first, block)
        p = jnp.where(seen, jnp.exp(logits - lse[:, None]), 0.0)
        dp = jnp.dot(d_out, values.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        return dq + jnp.dot(ds.astype(keys.dtype), keys, preferred_element_type=jnp.float32)

    dq = jax.lax.fori_loop(first_ref[()], qb + 1, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq * scale


def _backward_dkv(qkv, segments, grads, end, block, interpret):
    """dK, dV [S, K, T, Dh]: per query head over the query blocks visiting each key block,
    then summed over each kv head's group (``grads`` as in ``_backward_dq``)."""
    (q, k, v), (d_out, lse, delta) = qkv, grads
    s, h, t, dh = q.shape
    kv = k.shape[1]
    group = h // kv
    kernel = functools.partial(_dkv_kernel, block=block, group=group, scale=dh**-0.5)
    per_key = pl.BlockSpec((None, None, block, dh), lambda r, j, i: (r, j, i, 0))
    dk, dv = pl.pallas_call(
        kernel,
        grid=(s, h, t // block),
        in_specs=[
            pl.no_block_spec,  # q, keys, values, segments, dO, lse, delta: read inside
            pl.no_block_spec,
            pl.no_block_spec,
            pl.no_block_spec,
            pl.no_block_spec,
            pl.no_block_spec,
            pl.no_block_spec,
            pl.BlockSpec((None, None), lambda r, j, i: (r, i)),  # one past the last visitor
        ],
        out_specs=[per_key, per_key],
        out_shape=[jax.ShapeDtypeStruct((s, h, t, dh), jnp.float32)] * 2,
        compiler_params=_params(),
        interpret=interpret,
        name="segment_attention_dkv",
    )(q, k, v, segments, d_out, lse, delta, end)
    fold = (s, kv, group, t, dh)
    return dk.reshape(fold).sum(axis=2), dv.reshape(fold).sum(axis=2)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    seg_ref,
    do_ref,
    lse_ref,
    delta_ref,
    end_ref,
    dk_ref,
    dv_ref,
    *,
    block,
    group,
    scale,
):
    row, head, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head, k_first = head // group, kb * block
    keys = k_ref[row, kv_head, pl.ds(k_first, block), :]
    values = v_ref[row, kv_head, pl.ds(k_first, block), :]
    k_seg = seg_ref[row, pl.ds(k_first, block)]

    def body(qb, carry):
        dk, dv = carry
        q_first = qb * block
        q = q_ref[row, head, pl.ds(q_first, block), :]
        d_out = do_ref[row, head, pl.ds(q_first, block), :]
        lse = lse_ref[row, head, pl.ds(q_first, block)]
        delta = delta_ref[row, head, pl.ds(q_first, block)]
        q_seg = seg_ref[row, pl.ds(q_first, block)]
        logits = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * scale
        seen = _mask(q_seg, k_seg, q_first, k_first, block)
        p = jnp.where(seen, jnp.exp(logits - lse[:, None]), 0.0)  # [queries, keys]
        dv = dv + jnp.dot(p.T.astype(d_out.dtype), d_out, preferred_element_type=jnp.float32)
        dp = jnp.dot(d_out, values.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        dk = dk + jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros(keys.shape, jnp.float32)
    # The query blocks at and after the diagonal whose segment start reaches this key block.
    dk, dv = jax.lax.fori_loop(kb, end_ref[()], body, (zeros, zeros))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv
