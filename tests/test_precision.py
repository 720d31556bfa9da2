"""Precision policy: bf16 compute over float32 master weights and moments, so small updates add up.

At ``optim.actor_lr`` = 1e-6 an Adam step moves a weight by about 1e-6, while a bf16 weight of
magnitude 1e-2 has a spacing of 6.1e-5: stored in bf16 it rounds back every step and never
moves. The master copy accumulates the steps, and the bf16 weights the model computes with
follow the float32 reference's.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import OptimConfig, PPOConfig, load_config
from oppo_jax.ppo.optimizer import make_optimizer
from oppo_jax.ppo.update import UpdateSpec, init_train_state
from oppo_jax.run.specs import update_spec
from oppo_jax.run.trained_params import initial_params
from tests.padded_update import ppo_update
from tests.ppo_fixtures import ACTOR, CRITIC, random_batch, tiny_params

STEPS = 96  # optimizer steps: ~1e-4 of movement, more than one bf16 spacing at |w| ~ 1e-2
LR = 1e-6


def _spec(dtype: str, param_dtype: str) -> UpdateSpec:
    optim = OptimConfig(actor_lr=LR, critic_lr=LR, max_grad_norm=1e9)
    tx = make_optimizer(optim, LR, STEPS)
    models = {"dtype": dtype, "param_dtype": param_dtype}
    return UpdateSpec(
        actor=ACTOR.replace(**models),
        critic=CRITIC.replace(**models),
        ppo=PPOConfig(ppo_epochs=STEPS, num_minibatches=1),
        temperature=0.7,
        actor_tx=tx,
        critic_tx=tx,
    )


def _kernels_after_update(spec: UpdateSpec, actor, critic, batch):
    """The actor's layer kernels [L ...] after STEPS optimizer steps, flattened."""
    state = init_train_state(spec, actor, critic)
    update = jax.jit(lambda s: ppo_update(spec, s, batch, jax.random.key(3), jnp.float32(0.05)))
    new, metrics = update(state)
    assert float(metrics["skipped_steps"]) == 0
    return _layer_kernels(new.actor_params), new


def _layer_kernels(params) -> np.ndarray:
    leaves = jax.tree.leaves(params["layers"])
    return np.concatenate([np.asarray(x, np.float32).ravel() for x in leaves if x.ndim == 3])


@pytest.mark.slow
def test_small_updates_move_bf16_served_weights_like_the_float32_reference():
    actor32, critic32 = tiny_params(seed=5)
    # Start every run from bf16-representable weights, so the runs differ only in precision.
    to_bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)  # noqa: E731
    actor16, critic16 = to_bf16(actor32), to_bf16(critic32)
    start = _layer_kernels(actor16)
    batch = random_batch(_spec("float32", "float32"), actor32, critic32, seed=2)

    as32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    reference, _ = _kernels_after_update(
        _spec("float32", "float32"), as32(actor16), as32(critic16), batch
    )
    # The policy: bf16 compute, float32 master weights (from the bf16 checkpoint) and moments.
    master_spec = _spec("bfloat16", "float32")
    master, state = _kernels_after_update(master_spec, as32(actor16), as32(critic16), batch)
    moments = [x for x in jax.tree.leaves(state.actor_opt) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert moments and all(x.dtype == jnp.float32 for x in moments)
    # The old behaviour: weights and moments in bf16.
    all_bf16, _ = _kernels_after_update(_spec("bfloat16", "bfloat16"), actor16, critic16, batch)

    big = np.abs(start) >= 1e-2
    served = np.asarray(jnp.asarray(master).astype(jnp.bfloat16), np.float32)
    served_ref = np.asarray(jnp.asarray(reference).astype(jnp.bfloat16), np.float32)
    moved_ref = served_ref[big] != start[big]
    assert moved_ref.mean() > 0.5  # the reference does move the served weights
    assert np.array_equal(all_bf16[big], start[big])  # bf16 storage: nothing moved
    # Master weights: the served weights move as the reference's do.
    assert (served[big] == served_ref[big]).mean() > 0.97
    assert (served[big] != start[big]).mean() > 0.5
    step_ref, step_master = reference - start, master - start
    rel = np.linalg.norm(step_master - step_ref) / np.linalg.norm(step_ref)
    assert rel < 0.1, rel


def test_run_config_trains_float32_masters_over_bf16_frozen_weights():
    cfg = load_config(
        None, ["model.dtype=bfloat16", "model.param_dtype=bfloat16", "model.preset=tiny"]
    )
    assert cfg.optim.master_dtype == "float32"  # the default
    actor16 = ACTOR.replace(dtype="bfloat16", param_dtype="bfloat16")
    spec = update_spec(cfg, actor16, actor16.replace(head="score"))
    assert spec.actor.param_dtype == spec.critic.param_dtype == "float32"
    assert spec.actor.dtype == "bfloat16"
    actor, critic = tiny_params(seed=1)
    actor = jax.tree.map(lambda x: x.astype(jnp.bfloat16), actor)
    trained_a, trained_c, frozen = initial_params(
        spec, actor, critic, None, None, jax.random.key(0), cfg.optim.master_dtype
    )
    assert frozen is None
    for tree in (trained_a, trained_c):
        assert {x.dtype for x in jax.tree.leaves(tree)} == {jnp.dtype(jnp.float32)}
    # A copy, never the caller's arrays (the update donates its state).
    same = jax.tree.leaves(critic)[0]
    assert jax.tree.leaves(trained_c)[0] is not same
    old = dataclasses.replace(cfg.optim, master_dtype="bfloat16")
    spec16 = update_spec(dataclasses.replace(cfg, optim=old), actor16, actor16)
    assert spec16.actor.param_dtype == "bfloat16"
