"""The jitted PPO update: sharding invariance, jit invariance, causality, and learning."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import PPOConfig
from oppo_jax.parallel.sharding import make_mesh
from oppo_jax.ppo.update import init_train_state, make_sharded_init
from tests.oracles import policy_logprobs
from tests.padded_update import make_sharded_update, ppo_update
from tests.ppo_fixtures import ACTOR, make_spec, random_batch, tiny_params

PPO = PPOConfig(ppo_epochs=2, num_minibatches=2, grad_accum_steps=2, entropy_coef=0.01)


def _relative_diff(a, b):
    leaves = jax.tree.leaves(jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)), a, b))
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(b))
    return max(float(x) for x in leaves) / scale


@functools.cache
def _reference(ppo=PPO):
    """One update on a single device (plain jit, no shardings)."""
    spec = make_spec(ppo)
    actor, critic = tiny_params()
    batch = random_batch(spec, actor, critic)
    state = init_train_state(spec, actor, critic)
    new_state, metrics = jax.jit(functools.partial(ppo_update, spec))(
        state, batch, jax.random.key(3), jnp.float32(0.05)
    )
    return spec, batch, state, new_state, metrics


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_sharded_update_equals_single_device(shape):
    spec, batch, state, expected, expected_metrics = _reference()
    mesh = make_mesh(*shape)
    init = make_sharded_init(spec, mesh)
    update, _ = make_sharded_update(spec, mesh)
    sharded_state = init(state.actor_params, state.critic_params)
    q_proj = sharded_state.actor_params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert len(q_proj.sharding.device_set) == 8
    new_state, metrics = update(sharded_state, batch, jax.random.key(3), jnp.float32(0.05))
    assert _relative_diff(new_state.actor_params, expected.actor_params) <= 1e-5
    assert _relative_diff(new_state.critic_params, expected.critic_params) <= 1e-5
    for name in ("policy_loss", "value_loss", "clipfrac", "entropy"):
        np.testing.assert_allclose(metrics[name], expected_metrics[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_update_changes_parameters_and_jit_equals_eager():
    # A smaller schedule than PPO keeps the eager (op-by-op) run short.
    spec, batch, state, expected, metrics = _reference(PPOConfig(num_minibatches=2, ppo_epochs=1))
    moved = _relative_diff(expected.actor_params, state.actor_params)
    assert moved > 1e-4  # the update did something
    assert int(expected.step) == 1
    assert float(metrics["value_loss"]) > 0
    with jax.disable_jit():
        eager, _ = ppo_update(spec, state, batch, jax.random.key(3), jnp.float32(0.05))
    assert _relative_diff(eager.actor_params, expected.actor_params) <= 1e-5
    assert _relative_diff(eager.critic_params, expected.critic_params) <= 1e-5


def test_token_loss_has_no_gradient_from_later_tokens():
    """d logπ(token t) / d(input embedding at position p) is 0 for every p after t's context."""
    actor, _ = tiny_params()
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 2, ACTOR.vocab_size)
    prompt_len = jnp.array([3, 4])

    def logp_of_token(delta, t):
        def add_delta(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            is_embed = isinstance(context.module, nn.Embed) and context.method_name == "__call__"
            return out + delta if is_embed else out

        with nn.intercept_methods(add_delta):
            logp, _ = policy_logprobs(ACTOR, actor, tokens, prompt_len, 5, 0.7)
        return jnp.sum(logp[:, t])

    delta = jnp.zeros((2, 9, ACTOR.hidden_size))
    for t in range(5):
        grad = jax.grad(logp_of_token)(delta, t)
        norms = np.asarray(jnp.linalg.norm(grad, axis=-1))
        for b in range(2):
            context_end = int(prompt_len[b]) + t  # response token t sits at this position
            assert np.all(norms[b, context_end:] == 0.0), (b, t)
            assert np.all(norms[b, :context_end] > 0.0), (b, t)


def test_adaptive_kl_in_loss_and_importance_correction_paths_run_and_differ():
    base_spec, batch, state, expected, _ = _reference()
    for ppo in (
        PPOConfig(ppo_epochs=2, num_minibatches=2, grad_accum_steps=2, kl_in_reward=False),
        PPOConfig(ppo_epochs=2, num_minibatches=2, grad_accum_steps=2, importance_correction=True),
    ):
        spec = make_spec(ppo)
        new_state, metrics = jax.jit(functools.partial(ppo_update, spec))(
            state, batch, jax.random.key(3), jnp.float32(0.5)
        )
        assert all(np.isfinite(float(v)) for v in jax.tree.leaves(metrics))
        assert _relative_diff(new_state.actor_params, expected.actor_params) > 1e-7
