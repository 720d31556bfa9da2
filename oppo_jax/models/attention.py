"""Which attention kernel a call runs: XLA's (over query blocks), cuDNN's fused flash attention
on GPU, or Pallas splash attention on TPU.

The model describes each call by its form rather than by a mask, so a fused kernel can take
it without materialising one:
- cache-less (the update, packed scoring): causal by index, optionally within segments;
- a decode step (one new token per row against the cache): keys ``0 .. kv_lengths[s] - 1``;
- anything else (a chunk or an admission written into the cache): the explicit ``mask``.

``implementation`` ("auto" | "xla" | "cudnn" | "splash" | "ragged", ``model.attention``)
picks the kernel; a form the chosen kernel cannot take runs on XLA. "auto" is cuDNN on a GPU
for bfloat16/float16 heads of width <= 128 (what cuDNN's flash attention supports), splash on
a TPU, XLA otherwise; and for a decode step on a GPU or a TPU the ragged kernel
(``models.ragged_decode``: each row reads only its own keys, straight from the cache buffer;
Triton on a GPU, Mosaic on a TPU) where its form takes the shapes. "ragged" asks for that
kernel on a CPU too (Pallas's interpreter: for tests), XLA for every other form. Packed rows
(causal within segments: the packed update, sync's packed scoring) go with "auto" on a GPU,
and with "ragged" anywhere, to ``models.segment_attention``, which visits only the key
blocks a query block's segment reaches (an explicit "cudnn" leaves them on XLA: cuDNN takes
no segments). cuDNN gets padding and causal masks as sequence lengths and mask types, splash
gets causal masks and segment ids; all compute the same function as XLA's kernel, except
that the segment kernel yields zeros for blocks of padding only, which nothing reads. The
ragged kernel is called from ``models.transformer``, before a layer's keys are read out of
the cache.

Dimension letters: S rows, T queries, Tc keys, H query heads, K kv-heads, Dh head width.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

import oppo_jax.models.kernel_check as kernel_check
import oppo_jax.models.platform as platform
import oppo_jax.models.ragged_decode as ragged_decode_kernel
import oppo_jax.models.segment_attention as segment_kernel
from oppo_jax.models.query_blocks import attention as blocked_xla_attention

Implementation = Literal["auto", "xla", "cudnn", "splash", "ragged"]
IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash", "ragged")
SPLASH_BLOCK = 128  # splash attention's query and key tile: sequence lengths must divide by it
CUDNN_MAX_HEAD_DIM = 128


def resolve(implementation: Implementation, dtype, head_dim: int, backend: str | None = None):
    """The kernel "auto" means on ``backend`` (default: jax's) for heads of ``dtype`` and
    ``head_dim``; any other choice is returned as given.

    Example: ("auto", bfloat16, 128, "gpu") -> "cudnn"; ("auto", float32, 128, "gpu") -> "xla".
    """
    if implementation != "auto":
        return implementation
    backend = backend or platform.current()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if backend == "gpu" and half and head_dim <= CUDNN_MAX_HEAD_DIM and head_dim % 8 == 0:
        return "cudnn"
    return "splash" if backend == "tpu" else "xla"


def ragged_decode(implementation: Implementation, head_dim: int, width: int, backend=None):
    """Whether a decode step over ``width`` cache columns runs the ragged kernel: chosen
    (``reads_lengths``) and trusted on this backend (``kernel_check``: else XLA runs it)."""
    return reads_lengths(implementation, head_dim, width, backend) and kernel_check.trusted(
        "ragged_decode", backend
    )


def reads_lengths(implementation: Implementation, head_dim: int, width: int, backend=None):
    """Whether decode over ``width`` cache columns is given to the ragged kernel, which takes
    each row's length as data: asked for, or "auto" on a GPU or a TPU where its lowering takes
    the shapes (``ragged_decode.fits``). Then a run needs no live-width programs (one width,
    the capacity): the kernel reads no key past a row's length. Its fallback where it is not
    trusted (``kernel_check``) is XLA's attention over the whole cache: the same programs,
    more keys read."""
    if implementation == "ragged":
        return True
    backend = backend or platform.current()
    return implementation == "auto" and ragged_decode_kernel.fits(head_dim, width, backend)


def implementations(cfg, capacity: int, packed_width: int) -> dict[str, str]:
    """The kernel each form of ``cfg``'s attention runs (a ``ModelConfig``; a cache of
    ``capacity`` columns, packed rows of ``packed_width``): what a run's ``warmup.json``
    names."""
    kernel = resolve(cfg.attention, cfg.jnp_dtype, cfg.head_dim)
    pallas = cfg.attention == "ragged" or (cfg.attention == "auto" and kernel == "cudnn")
    segment = pallas and segment_kernel.fits(cfg.head_dim, packed_width)
    decode = "cudnn" if kernel == "cudnn" else "xla"  # (attend: cuDNN takes a decode step)
    if ragged_decode(cfg.attention, cfg.head_dim, capacity):
        decode = "ragged"
    rows = "splash" if kernel == "splash" else "xla"
    if segment and kernel_check.trusted("segment"):
        rows = "segment"
    return {"decode": decode, "packed rows": rows, "chunks": "xla"}  # chunks: an explicit mask


def attend(
    q: Float[Array, "S T H Dh"],
    k: Float[Array, "S Tc K Dh"],
    v: Float[Array, "S Tc K Dh"],
    *,
    implementation: Implementation = "auto",
    causal: bool = False,
    segment_ids: Int[Array, "S T"] | None = None,
    kv_lengths: Int[Array, " S"] | None = None,
    mask: Bool[Array, "S 1 T Tc"] | None = None,
) -> Float[Array, "S T H Dh"]:
    """Attention of one call in its form (module docstring): ``causal`` (cache-less, with
    ``segment_ids`` for packed rows), ``kv_lengths`` (a decode step, T = 1) or ``mask``."""
    kernel = resolve(implementation, q.dtype, q.shape[-1])
    t, tc = q.shape[1], k.shape[1]
    decode_step = kv_lengths is not None and t == 1
    packed_rows = segment_ids is not None and causal and t == tc and mask is None
    # auto's GPU kernels or "ragged"; an explicit "cudnn" keeps the kernels before the Pallas
    # ones (benchmarks/gpu_bench.sh falls back to it when a Pallas kernel fails its check).
    pallas = implementation == "ragged" or (implementation == "auto" and kernel == "cudnn")
    segment = pallas and segment_kernel.fits(q.shape[-1], t)
    if packed_rows and segment and kernel_check.trusted("segment"):
        return segment_kernel.segment_attention(q, k, v, segment_ids)
    if kernel == "cudnn" and segment_ids is None and (causal or decode_step):
        return fused_arguments_attention(q, k, v, causal, kv_lengths, "cudnn")
    if kernel == "splash" and causal and t == tc and t % SPLASH_BLOCK == 0:
        return splash_attention(q, k, v, segment_ids, interpret=platform.current() != "tpu")
    if kernel not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {kernel!r}: expected one of {IMPLEMENTATIONS}")
    if segment_ids is not None:  # segments restrict the causal mask further
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        mask = same if mask is None else mask & same
    return blocked_xla_attention(q, k, v, mask, causal)


def fused_arguments_attention(q, k, v, causal: bool, kv_lengths, implementation: str):
    """``jax.nn.dot_product_attention`` with the form as a fused kernel takes it: a causal
    flag and per-row key lengths instead of a mask (``implementation`` "cudnn", or "xla" to
    check the same arguments on a CPU)."""
    if kv_lengths is not None:
        kv_lengths = jnp.clip(kv_lengths, 1, k.shape[1]).astype(jnp.int32)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, key_value_seq_lengths=kv_lengths, implementation=implementation
    )


def splash_attention(
    q: Float[Array, "S T H Dh"],
    k: Float[Array, "S T K Dh"],
    v: Float[Array, "S T K Dh"],
    segment_ids: Int[Array, "S T"] | None,
    interpret: bool = False,
) -> Float[Array, "S T H Dh"]:
    """Causal Pallas splash attention (TPU; ``interpret``: Pallas's interpreter, on any
    backend, which ``attend`` uses off a TPU so that the choice is testable), within
    segments when ``segment_ids`` are given. Under a mesh each device runs the kernel on its
    own rows and heads (``shard_map``: a Pallas call is not partitioned by the compiler)."""
    dh = q.shape[-1]

    def per_device(q, k, v, segments):
        kernel = _splash_kernel(q.shape[1], q.shape[2], interpret)  # this device's heads

        def one_row(q, k, v, seg):  # splash takes [heads, T, Dh] and scales nothing itself
            ids = None if seg is None else _segment_ids(seg)
            return kernel(q.swapaxes(0, 1) * dh**-0.5, k.swapaxes(0, 1), v.swapaxes(0, 1), ids)

        out = jax.vmap(one_row, in_axes=(0, 0, 0, None if segments is None else 0))(
            q, k, v, segments
        )
        return out.swapaxes(1, 2).astype(q.dtype)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return per_device(q, k, v, segment_ids)
    rows, heads = _mesh_specs()
    specs = (heads, heads, heads, None if segment_ids is None else rows)
    shard = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)
    return shard(q, k, v, segment_ids)


def _segment_ids(seg):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    return splash.SegmentIds(q=seg, kv=seg)


@functools.lru_cache(maxsize=32)
def _splash_kernel(t: int, heads: int, interpret: bool):
    """The splash kernel for ``heads`` causal heads of length ``t`` (built once per shape)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((t, t)) for _ in range(heads)])
    return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret)


def _mesh_specs() -> tuple[PartitionSpec, PartitionSpec]:
    """(rows [S, T], heads [S, T, H, Dh]) as the active logical rules lay them out."""
    rows = nn.logical_to_mesh_axes(("batch", "length"))
    heads = nn.logical_to_mesh_axes(("batch", "length", "heads", None))
    return rows, heads
