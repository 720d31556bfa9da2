"""The prompt prefill in sequence chunks equals the one-call prefill (actor and every scorer
kind), and its compiled temporaries follow the chunk, not the width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.models import init_params
from oppo_jax.models.kv_cache import init_cache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel.sharding import make_mesh
from oppo_jax.pipeline.program_walk import shape_checks_off
from oppo_jax.rollout import Admission, RolloutSpec, SamplingConfig, prefill_chunks
from oppo_jax.rollout.admission import prefill_hidden, prompt_prefill
from oppo_jax.rollout.prefill_chunks import chunked_prefill, prefill_chunk
from oppo_jax.scoring.stream import ScorerSpec, scorer_admit
from tests.oracles import prefill_and_start, scan_decode
from tests.ppo_fixtures import ACTOR, CRITIC, eager_admission
from tests.test_replay_admission import EOS, P, R, _assert_caches_close, _slots
from tests.xla_flags import compile_as_in_production


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Chunks of 4 tokens for these 8-slot, 5-wide prompt prefills (a one-call one otherwise)."""
    monkeypatch.setattr(prefill_chunks, "MIN_PREFILL_CHUNK", 2)
    monkeypatch.setattr(prefill_chunks, "PREFILL_TOKEN_BUDGET", 16)


def test_chunk_width_fits_the_budget():
    assert prefill_chunk(120, 512, 8192) == 64  # 8 chunks of 7,680 tokens
    assert prefill_chunk(8, 512, 8192) == 512  # fits: one call
    assert prefill_chunk(8, 1536, 8192) == 768  # two chunks, no padding
    assert prefill_chunk(3, 100, 64) == 32  # 5 chunks of 20 -> a multiple of 16: 4 chunks
    assert prefill_chunk(1000, 512, 8192) == prefill_chunks.MIN_PREFILL_CHUNK  # never thinner


@pytest.mark.parametrize("width", [8, 9, 37])  # 37: a last chunk of padding
def test_chunked_prefill_equals_one_call(width):
    params = init_params(ACTOR, jax.random.key(0))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(3, 64, (4, width)), jnp.int32)
    n_valid = jnp.asarray([width, 1, 0, width // 2], jnp.int32)
    cache = init_cache(ACTOR, 4, width + 8)
    hidden, want = prefill_hidden(ACTOR, params, cache, tokens, n_valid)
    last, got = chunked_prefill(ACTOR, params, cache, tokens, n_valid, 4)
    np.testing.assert_array_equal(got.length, n_valid)
    _assert_caches_close(want, got)
    at = np.maximum(np.asarray(n_valid) - 1, 0)  # token 0 for an empty row, as one call
    np.testing.assert_allclose(last, np.asarray(hidden)[np.arange(4), at], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fsdp", [None, 4])  # 4: slots sharded, 2 per device
def test_chunked_actor_admission_equals_one_call(tiny_chunks, monkeypatch, fsdp):
    params = init_params(ACTOR, jax.random.key(0))
    mesh = None if fsdp is None else make_mesh(1, fsdp, 1, jax.devices()[:fsdp])
    rollout = RolloutSpec(SamplingConfig(temperature=0.7), P, R, EOS, mesh=mesh)
    s = _slots()  # 3 carried (their prompts only here), 3 new, 2 empty
    s.prefix_len[:], s.prefix_finished[:] = 0, False
    admission = eager_admission(s)

    def run():
        state = prefill_and_start(ACTOR, params, admission, jax.random.key(7), rollout)
        decode = scan_decode(ACTOR, SamplingConfig(temperature=0.7), 4)
        return state, decode(params, jax.tree.map(jnp.copy, state))

    chunked = run()
    monkeypatch.setattr(prefill_chunks, "PREFILL_TOKEN_BUDGET", 1 << 20)
    whole = run()
    for one, many in zip(whole, chunked, strict=True):
        for name in ("tokens", "num_generated", "finished"):
            np.testing.assert_array_equal(getattr(one, name), getattr(many, name))
        np.testing.assert_allclose(one.next_logits, many.next_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(one.logprobs, many.logprobs, rtol=1e-5, atol=1e-6)
        _assert_caches_close(one.cache, many.cache)
    np.testing.assert_array_equal(chunked[0].cache.length, s.prompt_len)


@pytest.mark.parametrize("kind", ["logprob", "value", "score"])
def test_chunked_scorer_admission_equals_one_call(tiny_chunks, monkeypatch, kind):
    model = ACTOR if kind == "logprob" else CRITIC
    spec = ScorerSpec(model, kind, R, temperature=0.7)
    params = init_params(model, jax.random.key(1))
    admission = eager_admission(_slots())
    chunked = scorer_admit(spec, params, admission, P)
    monkeypatch.setattr(prefill_chunks, "PREFILL_TOKEN_BUDGET", 1 << 20)
    whole = scorer_admit(spec, params, admission, P)
    for name in ("last_hidden", "score", "per_token"):
        np.testing.assert_allclose(
            getattr(whole, name), getattr(chunked, name), rtol=1e-5, atol=1e-5, err_msg=name
        )
    _assert_caches_close(whole.cache, chunked.cache)


# Narrow and deep enough that a layer's MLP activations ([tokens, F] float32) outweigh every
# width-sized buffer the admission itself returns.
WIDE_MLP = ModelConfig(
    vocab_size=64, hidden_size=16, intermediate_size=2048, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=8,
)  # fmt: skip


def _admission_temp(width: int, budget: int, monkeypatch) -> int:
    """Compiled temporaries of a fresh admission of 16 rows ``width`` tokens wide."""
    monkeypatch.setattr(prefill_chunks, "PREFILL_TOKEN_BUDGET", budget)
    params = jax.eval_shape(lambda: init_params(WIDE_MLP, jax.random.key(0)))
    fresh = Admission.fresh(jnp.zeros((16, width), jnp.int32), jnp.ones(16, jnp.int32), 8)

    def admit(params, admission):
        return prompt_prefill(WIDE_MLP, params, admission, (width, 8))

    with shape_checks_off():  # lowering rebuilds the typed Admission from abstract leaves
        compiled = compile_as_in_production(jax.jit(admit).lower(params, fresh))
    return compiled.memory_analysis().temp_size_in_bytes


def test_admission_temporaries_follow_the_chunk_not_the_width(monkeypatch):
    mlp = 16 * 2048 * 4  # bytes of one float32 MLP activation per token column of 16 rows
    one_call = _admission_temp(512, 1 << 30, monkeypatch)
    assert one_call > 512 * mlp  # [16 x 512, 2048] float32: 64 MiB and more
    narrow, wide = (_admission_temp(w, 16 * 32, monkeypatch) for w in (128, 512))  # 32 a chunk
    assert wide < one_call / 8
    assert wide < 1.25 * narrow  # 4x the width, about the same temporaries
    assert wide < 4 * 32 * mlp  # a few [16 x 32, 2048] activations: one chunk's
