"""Decoder-only transformer of the Qwen2 / Llama family in Flax Linen, with an explicit KV cache.

Dimension letters: S slots (batch rows), T new tokens, Tc cache capacity, D model width,
H query heads, K kv-heads, G = H / K query heads per kv-head, Dh head width, F MLP width,
V vocabulary, L layers.

The module is only a parameter container: every compiled function calls ``model.apply(params,
...)``, a pure function of the parameter pytree. Parameters carry logical axis names (see
``oppo_jax.parallel.sharding``); the model never names mesh axes.

The blocks run under ``nn.scan``: their parameters are stacked on a leading "layers" axis
(``params["layers"][...]`` has shape [L, ...]), a model compiles to the same program whatever
its depth, and the KV cache is the scan's carry, written in place layer by layer.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from oppo_jax.models.attention import attend, ragged_decode
from oppo_jax.models.chunk_layout import ChunkLayout
from oppo_jax.models.kv_cache import KVCache, read_layer, write_layer, write_positions
from oppo_jax.models.lora import LoraDense
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.ragged_decode import ragged_decode_attention

_INIT = nn.initializers.normal(stddev=0.02)


def _dense(cfg: ModelConfig, features: int, axes: tuple, use_bias: bool, name: str) -> nn.Module:
    if cfg.lora_rank and name in cfg.lora_targets:  # same parameter names, plus an adapter
        return LoraDense(
            features, axes, use_bias, cfg.lora_rank, cfg.lora_alpha, cfg.jnp_dtype,
            cfg.jnp_param_dtype, _INIT, name=name,
        )  # fmt: skip
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=cfg.jnp_dtype,
        param_dtype=cfg.jnp_param_dtype,
        kernel_init=nn.with_logical_partitioning(_INIT, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
        name=name,
    )


class RMSNorm(nn.Module):
    """x / rms(x) * scale, normalised in float32 and cast back (as Hugging Face does)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Float[Array, "S T D"]) -> Float[Array, "S T D"]:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (x.shape[-1],),
            self.cfg.jnp_param_dtype,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(
            jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.rms_norm_eps
        )
        return scale.astype(self.cfg.jnp_dtype) * x32.astype(self.cfg.jnp_dtype)


def apply_rope(x: Float[Array, "S T N Dh"], positions: Int[Array, "S T"], theta: float) -> Array:
    """Rotary embedding in the 'rotate half' layout used by Qwen2 and Llama checkpoints."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [S T half]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_mask_for_cache(
    positions: Int[Array, "S T"], capacity: int
) -> Bool[Array, "S 1 T Tc"]:
    """Which cache entries each new token sees: cache index (= position) <= its own position.

    Keys past a slot's valid length always sit at positions greater than every valid query, so
    causality alone excludes cache garbage and right padding; no separate padding mask is needed.
    Example: positions [[1, 2]], capacity 4 -> [[[[T, T, F, F], [T, T, T, F]]]].
    """
    k_pos = jnp.arange(capacity, dtype=jnp.int32)
    return k_pos[None, None, None, :] <= positions[:, None, :, None]


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions, reading and writing the KV cache."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, context, kv):
        cfg = self.cfg
        positions = context[0]
        s, t, _ = x.shape
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = _dense(cfg, q_width, ("embed", "heads"), cfg.qkv_bias, "q_proj")(x)
        k = _dense(cfg, kv_width, ("embed", "kv_heads"), cfg.qkv_bias, "k_proj")(x)
        v = _dense(cfg, kv_width, ("embed", "kv_heads"), cfg.qkv_bias, "v_proj")(x)
        q = apply_rope(q.reshape(s, t, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = apply_rope(k.reshape(s, t, cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = v.reshape(s, t, cfg.num_kv_heads, cfg.head_dim)
        out, kv = _attention(cfg, (q, k, v), kv, context)
        out = out.reshape(s, t, q_width)
        return _dense(cfg, cfg.hidden_size, ("heads", "embed"), cfg.o_bias, "o_proj")(out), kv


def _attention(cfg: ModelConfig, qkv, kv, context):
    """One layer's attention in its call's form (``models.attention``): (out [S T H Dh], kv).

    Without a cache: causal by index (segments, if any, restrict it). With a cache: the new
    keys are written in, and attention reads the live prefix the mask covers; a decode step
    (``decode_lengths``: each row's keys, 0 for a row that takes no token) may instead run the
    ragged kernel, which reads each row's own keys from the buffer itself."""
    q, k, v = qkv
    positions, segment_ids, mask, layout, decode_lengths = context
    causal = kv is None
    if causal:
        keys, values = k, v
    else:
        k_all, v_all, layer = kv
        # Packed (models.chunk_layout): each token to its own slot; rows read their slots.
        slots = None if layout is None else layout.token_slots(k_all.shape[1])[None, :]
        k_all = write_layer(k_all, layer, k, positions, slots)
        v_all = write_layer(v_all, layer, v, positions, slots)
        kv = (k_all, v_all, layer)
        # Only the live prefix the mask covers (its last axis: the static width).
        width, rows = mask.shape[-1], None if layout is None else layout.rows
        if decode_lengths is not None and ragged_decode(cfg.attention, cfg.head_dim, width):
            return ragged_decode_attention(q, k_all, v_all, layer, decode_lengths, width), kv
        keys = read_layer(k_all, layer, width, rows)
        values = read_layer(v_all, layer, width, rows)
    kv_lengths = decode_lengths  # GQA is native; the call's form, not a mask, to the kernel
    if layout is not None:  # attention over the rows; everything else over packed tokens
        q = layout.to_rows(q[0])
    keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    out = attend(q, keys, values, implementation=cfg.attention, causal=causal,
                 segment_ids=segment_ids, kv_lengths=kv_lengths, mask=mask)  # fmt: skip
    return (out if layout is None else layout.from_rows(out)[None]), kv


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate = _dense(cfg, cfg.intermediate_size, ("embed", "mlp"), cfg.mlp_bias, "gate_proj")(x)
        up = _dense(cfg, cfg.intermediate_size, ("embed", "mlp"), cfg.mlp_bias, "up_proj")(x)
        hidden = nn.with_logical_constraint(nn.silu(gate) * up, ("batch", "length", "mlp"))
        return _dense(cfg, cfg.hidden_size, ("mlp", "embed"), cfg.mlp_bias, "down_proj")(hidden)


class Block(nn.Module):
    """Pre-norm transformer block as a scan body: carry (x, kv) -> (x', kv'), no scanned output.

    ``kv`` is None (no cache) or (keys [L S K Tc Dh], values, this layer's index); ``context``
    (the same for every layer) is (positions [S T], segment ids [S T] or None, the cache mask
    [S 1 T Tc] or None, a packed chunk's ``ChunkLayout`` or None; packed, S is 1, T the
    packed tokens M, and the mask is over the layout's rows [N 1 C Tc]; a decode step's keys
    per row [S], else None).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, carry, context):
        x, kv = carry
        attn_out, kv = Attention(self.cfg, name="self_attn")(
            RMSNorm(self.cfg, name="input_layernorm")(x), context, kv
        )
        x = x + attn_out
        x = x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="post_attention_layernorm")(x))
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        if kv is not None:
            kv = (kv[0], kv[1], kv[2] + 1)
        return (x, kv), None


# What "dots" keeps for the backward: the weight matmuls' outputs, not the attention scores
# (those have batch dimensions and are [S, H, T, T], the largest activations of a layer).
_REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _layers(cfg: ModelConfig):
    """All blocks as one scanned module: parameters stacked on a leading "layers" axis."""
    block = Block
    if cfg.remat != "none":
        block = nn.remat(Block, prevent_cse=False, policy=_REMAT_POLICIES[cfg.remat])
    return nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,),
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, name="layers")


class Transformer(nn.Module):
    """Backbone plus the configured head: ``lm`` gives logits [S T V], ``score`` gives [S T N].

    Without a cache the call is a full causal forward over right-padded rows (positions
    0..T-1), or over packed rows when ``segment_ids`` (and per-segment ``positions``) are
    given: a token then sees only earlier tokens of its own segment. With a cache, the T new
    tokens of slot s take positions ``cache.length[s] + i``, are written into the cache, and
    ``n_valid[s]`` of them (default all T) count as filled. ``kv_width`` (static) bounds the
    cache columns attention reads: every new token must sit at a position below it (the live
    prefix, ``kv_cache.live_width``); None reads the whole capacity. With a ``chunk_layout``
    the tokens are one packed row [1, M] of a chunk's new tokens (``models.chunk_layout``):
    each goes to its own slot and position, attention runs over the layout's rows, and only
    those rows' slots advance (by their counts; ``n_valid`` unused). ``return_hidden`` returns the
    final-normed hidden states [S T D] instead of the head's output (``oppo_jax.models.heads``
    applies the head only where it is needed).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens: Int[Array, "S T"],
        cache: KVCache | None = None,
        n_valid: Int[Array, " S"] | None = None,
        *,
        positions: Int[Array, "S T"] | None = None,
        segment_ids: Int[Array, "S T"] | None = None,
        return_hidden: bool = False,
        kv_width: int | None = None,
        chunk_layout: ChunkLayout | None = None,
    ) -> tuple[Float[Array, "S T O"], KVCache | None]:
        cfg = self.cfg
        s, t = tokens.shape
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.jnp_dtype,
            param_dtype=cfg.jnp_param_dtype,
            embedding_init=nn.with_logical_partitioning(_INIT, ("vocab", "embed")),
            name="embed_tokens",
        )
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        if cache is None:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
            mask = kv = None  # causal by index; segments (if any) go to attention as they are
        else:
            if positions is not None or segment_ids is not None:
                raise ValueError("positions and segment_ids are for the cache-less forward only")
            positions = write_positions(cache.length, t)
            in_rows = positions  # the queries' positions as attention lays them out
            if chunk_layout is not None:
                positions, in_rows = chunk_layout.positions(cache.length)
            mask = attention_mask_for_cache(in_rows, _kv_width(kv_width, cache.capacity))
            kv = (cache.k, cache.v, jnp.zeros((), jnp.int32))
        layout = None if cache is None else chunk_layout
        decode = cache is not None and layout is None and t == 1  # one new token per row
        lengths = _decode_lengths(positions, n_valid, decode)
        (x, kv), _ = _layers(cfg)((x, kv), (positions, segment_ids, mask, layout, lengths))
        x = RMSNorm(cfg, name="norm")(x)
        out = x if return_hidden else self._head(embed, x)
        if cache is None:
            return out, None
        if chunk_layout is not None:
            length = cache.length.at[chunk_layout.rows].add(chunk_layout.count, mode="drop")
            return out, KVCache(k=kv[0], v=kv[1], length=length)
        advance = jnp.full((s,), t, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
        return out, KVCache(k=kv[0], v=kv[1], length=cache.length + advance)

    def _head(self, embed: nn.Embed, x):
        cfg = self.cfg
        if cfg.head == "lm" and cfg.tie_word_embeddings:
            return embed.attend(x)
        axes = ("embed", "vocab") if cfg.head == "lm" else ("embed", None)
        name = "lm_head" if cfg.head == "lm" else "score"
        return _dense(cfg, cfg.head_out, axes, False, name)(x)


def cached_hidden(
    cfg: ModelConfig,
    params,
    cache: KVCache,
    tokens: Int[Array, "S T"],
    n_valid: Int[Array, " S"],
    kv_width: int | None = None,
) -> tuple[Float[Array, "S T D"], KVCache]:
    """Append ``n_valid[s]`` tokens of each right-padded row to the cache and return the final
    hidden states, attention reading the first ``kv_width`` cache columns (None: all). The
    chunk prefill of the streaming scorers; any split of a sequence gives the same outputs."""
    apply = Transformer(cfg).apply
    return apply({"params": params}, tokens, cache, n_valid, return_hidden=True, kv_width=kv_width)


def packed_chunk_hidden(
    cfg: ModelConfig,
    params,
    cache: KVCache,
    tokens: Int[Array, " M"],
    layout: ChunkLayout,
    kv_width: int | None = None,
) -> tuple[Float[Array, "M D"], KVCache]:
    """``cached_hidden`` for a chunk's new tokens packed end to end (``models.chunk_layout``):
    the final hidden state of each packed token, and the cache with them written in."""
    apply = Transformer(cfg).apply
    hidden, cache = apply(
        {"params": params}, tokens[None, :], cache,
        return_hidden=True, kv_width=kv_width, chunk_layout=layout,
    )  # fmt: skip
    return hidden[0], cache


def _decode_lengths(positions, n_valid, decode: bool) -> Int[Array, " S"] | None:
    """A decode step's keys per row (its own position + 1), 0 for a row that takes no token
    (``n_valid`` 0: a finished slot, whose output nobody reads); None for any other call."""
    if not decode:
        return None
    lengths = positions[:, 0] + 1
    return lengths if n_valid is None else jnp.where(n_valid > 0, lengths, 0)


def _kv_width(kv_width: int | None, capacity: int) -> int:
    """The cache columns a cached call reads: ``kv_width`` checked against the capacity."""
    if kv_width is None:
        return capacity
    if not 1 <= kv_width <= capacity:
        raise ValueError(f"kv_width {kv_width} outside 1..{capacity} (the cache capacity)")
    return int(kv_width)


def init_params(cfg: ModelConfig, key: jax.Array, boxed: bool = False):
    """Random parameters for ``cfg`` (unboxed arrays unless ``boxed``, which keeps axis names)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    variables = Transformer(cfg).init(key, tokens)
    return variables["params"] if boxed else nn.unbox(variables["params"])
