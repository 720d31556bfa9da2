"""Attention over query blocks equals one attention call (values and gradients), in the model
too, and holds a block's scores instead of all of them at a real admission's shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.models import query_blocks
from oppo_jax.models.kv_cache import init_cache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.query_blocks import attention, query_block
from oppo_jax.models.transformer import Transformer, init_params
from tests.xla_flags import compile_as_in_production


def test_query_block_fits_the_budget():
    assert query_block(120, 28, 512, 1536, 1 << 30) == 32
    assert query_block(2, 2, 8, 8, 1 << 30) == 8  # small calls stay whole
    assert query_block(1, 1, 1000, 10, 40 * 64) == 64  # 64 queries x 10 keys x 4 B = budget
    assert query_block(1, 1, 1000, 10, 1) == 16  # never below the minimum


def _inputs(t, tc, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (3, t, 4, 8))
    k, v = (jax.random.normal(key, (3, tc, 2, 8)) for key in keys[1:])
    return q, k, v


@pytest.mark.parametrize("case", ["causal", "causal_segments", "cache_mask"])
def test_blocked_equals_one_call_in_values_and_gradients(case):
    t = 37  # not a multiple of the block: the last block is padded
    tc = t if case != "cache_mask" else 64
    q, k, v = _inputs(t, tc)
    causal, mask = case != "cache_mask", None
    if case == "causal_segments":
        seg = jnp.asarray(np.repeat([[0, 1, 2]], 3, 0).repeat([10, 20, 7], axis=1))
        mask = seg[:, None, :, None] == seg[:, None, None, :]
    if case == "cache_mask":
        positions = jnp.arange(t)[None, :] + jnp.array([[0], [5], [27]])
        mask = jnp.arange(tc)[None, None, None, :] <= positions[:, None, :, None]

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * jnp.cos(out)), out

    def whole(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)

    def blocked(q, k, v):
        return attention(q, k, v, mask, causal, budget=16 * 3 * 4 * tc * 4)  # 16 queries

    assert query_block(3, 4, t, tc, 16 * 3 * 4 * tc * 4) == 16
    (_, want), want_grads = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)(whole, q, k, v)
    (_, got), got_grads = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)(blocked, q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def test_model_with_query_blocks_equals_the_model_without(monkeypatch):
    """Prefill into a cache and a cache-less forward over packed segments, blocked by a tiny
    budget, against the same calls whole."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)  # fmt: skip
    params = init_params(cfg, jax.random.key(0))
    model = Transformer(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 1, 64)
    segments = jnp.asarray(np.repeat([[0, 1]], 2, 0).repeat([25, 15], axis=1))

    def run():
        cached, cache = model.apply({"params": params}, tokens, init_cache(cfg, 2, 48))
        packed, _ = model.apply({"params": params}, tokens, segment_ids=segments)
        return cached, cache.k, packed

    whole = run()
    monkeypatch.setattr(query_blocks, "SCORE_BUDGET_BYTES", 1)  # 16-query blocks everywhere
    blocked = run()
    for got, want in zip(blocked, whole, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_admission_scores_held_per_block_at_a_real_shape():
    """A 7B-sized attention call of an admission (120 rows, 512 queries, 1536 keys, 28 heads,
    4 kv-heads, head width 128), compiled: the temporaries fall from the whole call's scores
    to about one block's."""
    q = jax.ShapeDtypeStruct((120, 512, 28, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((120, 1536, 4, 128), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((120, 1, 512, 1536), jnp.bool_)

    def temps(budget):
        fn = jax.jit(lambda q, k, v, m: attention(q, k, v, m, False, budget=budget))
        compiled = compile_as_in_production(fn.lower(q, kv, kv, mask))
        return compiled.memory_analysis().temp_size_in_bytes

    scores = 120 * 28 * 512 * 1536 * 4
    whole, blocked = temps(1 << 40), temps(1 << 30)
    assert whole >= scores  # at least the float32 scores of the whole call
    # Measured here: 29.9 GiB whole (scores, probabilities and their float32 copies) against
    # 3.0 GiB over 32-query blocks (a block's 0.62 GiB scores plus the inputs' copies).
    assert blocked < whole / 5
