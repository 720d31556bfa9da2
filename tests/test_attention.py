"""The attention kernels a call can run on compute the same function: the arguments cuDNN gets
(a causal flag, per-row key lengths) run through XLA equal the mask they replace, and Pallas
splash attention (interpreted on the CPU) equals XLA, alone, under a mesh and in the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.models.attention import attend, fused_arguments_attention, resolve, splash_attention
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.query_blocks import attention as xla_attention
from oppo_jax.models.transformer import Transformer, attention_mask_for_cache, init_params
from oppo_jax.parallel.sharding import DEFAULT_RULES, make_mesh, tracing_rules


def test_auto_picks_the_backend_kernel_where_it_supports_the_heads():
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert resolve("auto", bf16, 128, "gpu") == "cudnn"
    assert resolve("auto", f32, 128, "gpu") == "xla"  # cuDNN's flash attention is half only
    assert resolve("auto", bf16, 256, "gpu") == "xla"
    assert resolve("auto", bf16, 128, "tpu") == "splash"
    assert resolve("auto", bf16, 128, "cpu") == "xla"
    assert resolve("xla", bf16, 128, "gpu") == "xla"  # an explicit choice stands


def _qkv(s, t, tc, h=4, k=2, dh=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (s, t, h, dh))
    kv = [jax.random.normal(key, (s, tc, k, dh)) for key in keys[1:]]
    return q, *kv


def test_cudnn_arguments_equal_the_masks_they_replace():
    # Cache-less causal: the flag alone.
    q, k, v = _qkv(3, 24, 24)
    want = xla_attention(q, k, v, None, True)
    got = fused_arguments_attention(q, k, v, True, None, "xla")
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    # A decode step: one query per row at its position (one past the cache width: clipped).
    q, k, v = _qkv(3, 1, 32)
    positions = jnp.array([[0], [17], [40]])
    mask = attention_mask_for_cache(positions, 32)
    want = xla_attention(q, k, v, mask, False)
    got = fused_arguments_attention(q, k, v, False, positions[:, 0] + 1, "xla")
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_attend_routes_forms_a_kernel_cannot_take_to_xla():
    """Segments never go to cuDNN, a chunk written into the cache goes with its mask: the
    result on the CPU is XLA's with that mask whatever kernel was asked for."""
    q, k, v = _qkv(2, 16, 16)
    seg = jnp.asarray(np.repeat([[0] * 6 + [1] * 10], 2, 0))
    same = seg[:, None, :, None] == seg[:, None, None, :]
    want = xla_attention(q, k, v, same, True)
    got = attend(q, k, v, implementation="cudnn", causal=True, segment_ids=seg)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    q, k, v = _qkv(2, 4, 16)
    mask = attention_mask_for_cache(jnp.array([[3, 4, 5, 6], [9, 10, 11, 12]]), 16)
    got = attend(q, k, v, implementation="splash", mask=mask)  # not causal by index: XLA
    np.testing.assert_allclose(got, xla_attention(q, k, v, mask, False), atol=1e-6, rtol=0)


@pytest.mark.parametrize("segmented", [False, True])
def test_splash_equals_xla_in_values_and_gradients(segmented):
    q, k, v = _qkv(2, 128, 128, h=4, k=2, dh=16)
    seg = jnp.asarray(np.repeat([[0] * 50 + [1] * 70 + [2] * 8], 2, 0)) if segmented else None
    mask = None if seg is None else seg[:, None, :, None] == seg[:, None, None, :]

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * jnp.sin(out)), out

    splash = lambda q, k, v: splash_attention(q, k, v, seg, interpret=True)  # noqa: E731
    xla = lambda q, k, v: xla_attention(q, k, v, mask, True)  # noqa: E731
    (_, got), got_grads = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)(splash, q, k, v)
    (_, want), want_grads = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)(xla, q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)


def test_splash_under_a_mesh_runs_per_device_and_equals_one_device():
    """Rows over data × fsdp and heads over tensor (the logical rules), each device its own
    kernel call through shard_map: the same as one device."""
    mesh = make_mesh(2, 1, 2, jax.devices()[:4])
    q, k, v = _qkv(4, 128, 128, h=4, k=2, dh=16)
    seg = jnp.asarray(np.repeat([[0] * 64 + [1] * 64], 4, 0))
    heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))

    def sharded(q, k, v, seg):
        with tracing_rules(mesh, DEFAULT_RULES):
            return splash_attention(q, k, v, seg, interpret=True)

    args = (*(jax.device_put(x, heads) for x in (q, k, v)), jax.device_put(seg, rows))
    got = jax.jit(sharded)(*args)
    want = splash_attention(q, k, v, seg, interpret=True)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert got.sharding.is_equivalent_to(heads, 4)


def test_model_with_splash_attention_equals_the_model_with_xla():
    """A cache-less packed forward (the update's) through splash equals XLA's."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)  # fmt: skip
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 128), 1, 64)
    seg = jnp.asarray(np.repeat([[0] * 90 + [1] * 38], 2, 0))
    pos = jnp.asarray(np.concatenate([np.arange(90), np.arange(38)]))[None].repeat(2, 0)

    def forward(kernel):
        model = Transformer(cfg.replace(attention=kernel))
        return model.apply({"params": params}, tokens, positions=pos, segment_ids=seg)[0]

    np.testing.assert_allclose(forward("splash"), forward("xla"), atol=2e-5, rtol=0)
