"""Heads applied where needed; blocked LM log-probs against a plain full-vocabulary reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.models.heads import apply_head, gather_rows, token_logprobs_and_entropy
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer, init_params
from oppo_jax.rollout.layout import response_tokens
from tests.oracles import critic_values, gather_response, policy_logprobs

CFG = ModelConfig(
    vocab_size=1000,
    hidden_size=48,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    qkv_bias=True,
)
TEMPERATURE = 0.7


def _reference(logits, targets):
    """log_softmax over the whole vocabulary, then the target's entry and the entropy."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / TEMPERATURE, axis=-1)
    token = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return token, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _reference64(logits, targets):
    z = np.asarray(logits, np.float64) / TEMPERATURE
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    token = np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    return token, -(np.exp(logp) * logp).sum(-1)


def _max_rel(a, b):
    """Largest absolute difference over the tree, relative to the largest reference entry."""
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)
    return diff / max(float(jnp.max(jnp.abs(y))) for _, y in pairs)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("block", [128, 1000, 4096])  # 1000 % 128 != 0: the last block overlaps
def test_blocked_logprobs_match_full_vocabulary(tied, block):
    cfg = CFG.replace(tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.key(0))
    hidden = 3.0 * jax.random.normal(jax.random.key(1), (37, cfg.hidden_size))
    targets = jax.random.randint(jax.random.key(2), (37,), 0, cfg.vocab_size)

    def blocked(p, h):
        return token_logprobs_and_entropy(cfg, p, h, targets, TEMPERATURE, block)

    def full(p, h):
        return _reference(apply_head(cfg, p, h), targets)

    got, want = jax.jit(blocked)(params, hidden), full(params, hidden)
    want64 = _reference64(apply_head(cfg, params, hidden), targets)
    for g, w, w64 in zip(got, want, want64, strict=True):
        assert np.max(np.abs(np.asarray(g) - w64)) <= 1e-6
        # The float32 reference rounds -sum(p log p) itself: about one ulp at |x| ~ 7.
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-6)

    def loss(f):
        weights = jnp.cos(jnp.arange(37.0))
        return lambda p, h: jnp.sum(f(p, h)[0] * weights) + jnp.sum(f(p, h)[1] * weights[::-1])

    grads = jax.jit(jax.grad(loss(blocked), argnums=(0, 1)))(params, hidden)
    expected = jax.grad(loss(full), argnums=(0, 1))(params, hidden)
    assert _max_rel(grads, expected) <= 1e-5
    assert float(jnp.max(jnp.abs(grads[1]))) > 0  # gradients reach the hidden states


def _full_vocab_policy_logprobs(cfg, params, tokens, prompt_len, response_len):
    """The previous implementation: full [B, L, V] logits, then log_softmax."""
    logits, _ = Transformer(cfg).apply({"params": params}, tokens)
    logits = gather_response(logits, prompt_len, response_len)
    return _reference(logits, response_tokens(tokens, prompt_len, response_len)), logits


def test_policy_logprobs_and_values_match_full_forward():
    params = init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 20), 0, CFG.vocab_size)
    prompt_len, resp = jnp.array([3, 5, 7]), 12  # rows 1 and 2 run past the end: clipped

    def new(p):
        return policy_logprobs(CFG, p, tokens, prompt_len, resp, TEMPERATURE, block=128)

    def old(p):
        return _full_vocab_policy_logprobs(CFG, p, tokens, prompt_len, resp)[0]

    got, want = new(params), old(params)
    logits = _full_vocab_policy_logprobs(CFG, params, tokens, prompt_len, resp)[1]
    want64 = _reference64(logits, response_tokens(tokens, prompt_len, resp))
    assert got[0].shape == (3, resp)
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=2e-6)
    for g, w64 in zip(got, want64, strict=True):
        assert np.max(np.abs(np.asarray(g) - w64)) <= 1e-6

    def objective(f):
        return lambda p: jnp.sum(f(p)[0]) + 0.3 * jnp.sum(f(p)[1])

    assert _max_rel(jax.grad(objective(new))(params), jax.grad(objective(old))(params)) <= 1e-5

    critic = CFG.replace(head="score", num_labels=1)
    cparams = init_params(critic, jax.random.key(3))
    out, _ = Transformer(critic).apply({"params": cparams}, tokens)
    expected = gather_response(out[..., 0], prompt_len, resp)
    values = critic_values(critic, cparams, tokens, prompt_len, resp)
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": True}, {"head": "score"}])
def test_apply_head_at_positions_equals_the_models_head(changes):
    cfg = CFG.replace(vocab_size=96, num_labels=2, **changes)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 96)
    model = Transformer(cfg)
    out, _ = model.apply({"params": params}, tokens)
    hidden, _ = model.apply({"params": params}, tokens, return_hidden=True)
    assert hidden.shape == (2, 9, cfg.hidden_size)
    positions = jnp.array([[0, 8, 3], [5, 5, 20]])  # 20 clips to 8
    got = apply_head(cfg, params, gather_rows(hidden, positions))
    want = jnp.take_along_axis(out, jnp.clip(positions, 0, 8)[..., None], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bf16_head_logits_are_not_rounded_before_the_softmax():
    cfg = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    hidden = (4.0 * jax.random.normal(jax.random.key(1), (16, cfg.hidden_size))).astype(
        jnp.bfloat16
    )
    targets = jax.random.randint(jax.random.key(2), (16,), 0, cfg.vocab_size)
    got = token_logprobs_and_entropy(cfg, params, hidden, targets, TEMPERATURE, 128)
    weight = params["lm_head"]["kernel"]
    exact = hidden.astype(jnp.float32) @ weight.astype(jnp.float32)  # bf16 products are exact
    want = _reference(exact, targets)
    rounded = _reference(exact.astype(jnp.bfloat16), targets)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    assert np.max(np.abs(np.asarray(rounded[0]) - np.asarray(want[0]))) > 1e-3


def test_logprobs_need_an_lm_head():
    cfg = CFG.replace(head="score")
    params = init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="LM head"):
        token_logprobs_and_entropy(cfg, params, jnp.zeros((2, 48)), jnp.zeros((2,), jnp.int32))
