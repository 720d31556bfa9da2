"""Decoder-only transformer of the Qwen2 / Llama family in Flax Linen, with an explicit KV cache.

Dimension letters: S slots (batch rows), T new tokens, Tc cache capacity, D model width,
H query heads, K kv-heads, G = H / K query heads per kv-head, Dh head width, F MLP width,
V vocabulary, L layers.

The module is only a parameter container: every compiled function calls ``model.apply(params,
...)``, a pure function of the parameter pytree. Parameters carry logical axis names (see
``oppo_jax.sharding``); the model never names mesh axes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from oppo_jax.models.kv_cache import KVCache, write_layer, write_positions
from oppo_jax.models.model_config import ModelConfig

_INIT = nn.initializers.normal(stddev=0.02)


def _dense(cfg: ModelConfig, features: int, axes: tuple, use_bias: bool, name: str) -> nn.Dense:
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


def attend(
    q: Float[Array, "S T H Dh"],
    k: Float[Array, "S U K Dh"],
    v: Float[Array, "S U K Dh"],
    q_pos: Int[Array, "S T"],
    k_pos: Int[Array, "S U"],
) -> Float[Array, "S T H Dh"]:
    """Causal grouped-query attention: query at position p sees keys at positions <= p.

    Keys past a slot's valid length always sit at positions greater than every valid query, so
    causality alone excludes cache garbage and right padding; no separate padding mask is needed.
    """
    s, t, h, dh = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(s, t, kv_heads, h // kv_heads, dh)
    logits = jnp.einsum("stkgd,sukd->skgtu", qg, k, preferred_element_type=jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(dh))
    visible = k_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]
    logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("skgtu,sukd->stkgd", probs, v)
    return out.reshape(s, t, h, dh)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions, reading and writing the KV cache."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, layer_cache):
        cfg = self.cfg
        s, t, _ = x.shape
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = _dense(cfg, q_width, ("embed", "heads"), cfg.qkv_bias, "q_proj")(x)
        k = _dense(cfg, kv_width, ("embed", "kv_heads"), cfg.qkv_bias, "k_proj")(x)
        v = _dense(cfg, kv_width, ("embed", "kv_heads"), cfg.qkv_bias, "v_proj")(x)
        q = apply_rope(q.reshape(s, t, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = apply_rope(k.reshape(s, t, cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = v.reshape(s, t, cfg.num_kv_heads, cfg.head_dim)
        if layer_cache is None:
            keys, values, k_pos, new_cache = k, v, positions, None
        else:
            cache_k, cache_v = layer_cache
            keys = write_layer(cache_k, k, positions)
            values = write_layer(cache_v, v, positions)
            k_pos = jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=jnp.int32), keys.shape[:2])
            new_cache = (keys, values)
        out = attend(q, keys.astype(q.dtype), values.astype(q.dtype), positions, k_pos)
        out = out.reshape(s, t, q_width)
        return _dense(cfg, cfg.hidden_size, ("heads", "embed"), cfg.o_bias, "o_proj")(
            out
        ), new_cache


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
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, layer_cache):
        attn_out, new_cache = Attention(self.cfg, name="self_attn")(
            RMSNorm(self.cfg, name="input_layernorm")(x), positions, layer_cache
        )
        x = x + attn_out
        x = x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="post_attention_layernorm")(x))
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), new_cache


class Transformer(nn.Module):
    """Backbone plus the configured head: ``lm`` gives logits [S T V], ``score`` gives [S T N].

    Without a cache the call is a full causal forward over right-padded rows (positions
    0..T-1). With a cache, the T new tokens of slot s take positions ``cache.length[s] + i``,
    are written into the cache, and ``n_valid[s]`` of them (default all T) count as filled.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens: Int[Array, "S T"],
        cache: KVCache | None = None,
        n_valid: Int[Array, " S"] | None = None,
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
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
        else:
            positions = write_positions(cache.length, t)
        new_k, new_v = [], []
        for i in range(cfg.num_layers):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i])
            x, written = Block(cfg, name=f"layers_{i}")(x, positions, layer_cache)
            if written is not None:
                new_k.append(written[0])
                new_v.append(written[1])
        x = RMSNorm(cfg, name="norm")(x)
        out = self._head(embed, x)
        if cache is None:
            return out, None
        advance = jnp.full((s,), t, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
        return out, KVCache(k=jnp.stack(new_k), v=jnp.stack(new_v), length=cache.length + advance)

    def _head(self, embed: nn.Embed, x):
        cfg = self.cfg
        if cfg.head == "lm" and cfg.tie_word_embeddings:
            return embed.attend(x)
        axes = ("embed", "vocab") if cfg.head == "lm" else ("embed", None)
        name = "lm_head" if cfg.head == "lm" else "score"
        return _dense(cfg, cfg.head_out, axes, False, name)(x)


def init_params(cfg: ModelConfig, key: jax.Array, boxed: bool = False):
    """Random parameters for ``cfg`` (unboxed arrays unless ``boxed``, which keeps axis names)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    variables = Transformer(cfg).init(key, tokens)
    return variables["params"] if boxed else nn.unbox(variables["params"])
