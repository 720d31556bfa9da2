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
from tests import tolerances
from tests.oracles import policy_logprobs
from tests.padded_update import make_sharded_update, ppo_update
from tests.ppo_fixtures import ACTOR, CRITIC, make_spec, random_batch, tiny_params

PPO = PPOConfig(ppo_epochs=2, num_minibatches=2, grad_accum_steps=2, entropy_coef=0.01)


def _bounds(ppo: PPOConfig, batch) -> tolerances.UpdateBounds:
    """tests/tolerances.py's bounds of one update of ``batch`` (make_spec's lr, 1e-3)."""
    rows, width = batch.tokens.shape
    steps = ppo.ppo_epochs * ppo.num_minibatches
    cfgs = (ACTOR, CRITIC)
    return tolerances.update_bounds(cfgs, rows // ppo.num_minibatches * width, width, steps, 1e-3)


def _assert_same_update(ppo, batch, state, got_state, want_state, got=None, want=None):
    """Two updates of ``batch`` from ``state`` agree within the float32 bounds."""
    bounds = _bounds(ppo, batch)
    if got is not None:
        names = ("policy_loss", "value_loss", "clipfrac", "entropy")
        tolerances.assert_same_metrics(got, want, names, bounds.n, bounds.steps, ACTOR.vocab_size)
    before = {"actor": state.actor_params, "critic": state.critic_params}
    tolerances.assert_same_update(bounds, before, got_state, want_state)


def _relative_diff(a, b):
    """max |a - b| / max |b|: how far an update moved the parameters."""
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
    _assert_same_update(PPO, batch, state, new_state, expected, metrics, expected_metrics)


@pytest.mark.slow
def test_update_changes_parameters_and_jit_equals_eager():
    # A smaller schedule than PPO keeps the eager (op-by-op) run short.
    ppo = PPOConfig(num_minibatches=2, ppo_epochs=1)
    spec, batch, state, expected, metrics = _reference(ppo)
    moved = _relative_diff(expected.actor_params, state.actor_params)
    assert moved > 1e-4  # the update did something
    assert int(expected.step) == 1
    assert float(metrics["value_loss"]) > 0
    with jax.disable_jit():
        eager, _ = ppo_update(spec, state, batch, jax.random.key(3), jnp.float32(0.05))
    _assert_same_update(ppo, batch, state, eager, expected)


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
        PPOConfig(ppo_epochs=2, num_minibatches=2, grad_accum_steps=2, off_policy_correction="tis"),
    ):
        spec = make_spec(ppo)
        new_state, metrics = jax.jit(functools.partial(ppo_update, spec))(
            state, batch, jax.random.key(3), jnp.float32(0.5)
        )
        assert all(np.isfinite(float(v)) for v in jax.tree.leaves(metrics))
        assert _relative_diff(new_state.actor_params, expected.actor_params) > 1e-7
