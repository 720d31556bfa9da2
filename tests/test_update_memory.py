"""Memory of the compiled sharded update, read from XLA's own analysis (nothing allocated).

A model big enough that activations dominate, lowered with abstract sharded inputs: on a
1 x 4 x 1 mesh the rules shard every microbatch's rows, so a device's temporaries shrink with
the device count; and the non-finite guard keeps no second train state, so the donated state
is updated in place.
"""

import functools
import math

import jax
import jax.numpy as jnp
import pytest

from oppo_jax.config import OptimConfig, PPOConfig
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel.sharding import abstract_params, make_mesh
from oppo_jax.ppo.optimizer import make_optimizer
from oppo_jax.ppo.update import (
    UpdateSpec,
    init_train_state,
)
from oppo_tools.memory.abstract import per_device_bytes
from oppo_tools.memory.report import abstract_ppo_batch
from tests.padded_update import make_sharded_update
from tests.xla_flags import compile_as_in_production

# Activations dominate: logits [16, 128, 4096] and MLP [16, 128, 1024] against 2 x 2.6M params.
MODEL = ModelConfig(
    vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64,
)  # fmt: skip
ROWS, PROMPT, RESPONSE = 16, 32, 96  # B, P, R: sequences of L = 128 tokens
ONE_STEP = PPOConfig(ppo_epochs=1)  # one optimizer step over all 16 rows


def _spec(model: ModelConfig, ppo: PPOConfig) -> UpdateSpec:
    tx = make_optimizer(OptimConfig(), 1e-4, 100)
    return UpdateSpec(model, model.replace(head="score"), ppo, 1.0, tx, tx)


@functools.cache
def _compiled(mesh_shape, model=MODEL, ppo=ONE_STEP, shape=(ROWS, PROMPT, RESPONSE)):
    """(compiled sharded update, per-device train-state bytes) on a mesh of ``mesh_shape``."""
    spec = _spec(model, ppo)
    mesh = make_mesh(*mesh_shape, jax.devices()[: math.prod(mesh_shape)])
    update, state_sh = make_sharded_update(spec, mesh)
    state = jax.eval_shape(
        functools.partial(init_train_state, spec),
        abstract_params(spec.actor),
        abstract_params(spec.critic),
    )
    state_bytes = per_device_bytes(state, state_sh)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, state_sh
    )
    batch = abstract_ppo_batch(*shape, mesh)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    lowered = update.lower(state, batch, key, jax.ShapeDtypeStruct((), jnp.float32))
    return compile_as_in_production(lowered), state_bytes


def test_four_devices_hold_at_most_a_third_of_one_devices_update_temporaries():
    one = _compiled((1, 1, 1))[0].memory_analysis().temp_size_in_bytes
    four = _compiled((1, 4, 1))[0].memory_analysis().temp_size_in_bytes
    assert one > 20 * 2**20  # activations of a 16 x 128 microbatch: tens of MiB
    assert four <= 0.35 * one, (four, one)


def test_microbatch_rows_are_sharded_in_the_compiled_update():
    text = _compiled((1, 4, 1))[0].as_text()
    # The MLP hidden activation of a microbatch: 4 of its 16 rows per device, never all 16.
    assert f"f32[4,128,{MODEL.intermediate_size}]" in text
    assert f"f32[16,128,{MODEL.intermediate_size}]" not in text


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 4, 1)])
def test_update_keeps_one_train_state_and_updates_it_in_place(mesh_shape):
    # Parameters dominate here (8 rows of 16 tokens), so a second train state would show.
    wide = MODEL.replace(vocab_size=8192, num_layers=1)
    ppo = PPOConfig(ppo_epochs=2, num_minibatches=2, grad_accum_steps=2)
    compiled, state_bytes = _compiled(mesh_shape, wide, ppo, (8, 8, 8))
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == state_bytes  # the donated state is the output state
    if mesh_shape == (1, 1, 1):
        # Gradients and their accumulator (two parameter copies) and AdamW's temporaries stay
        # under one train state (parameters + two moments); the old guard's whole-state
        # jnp.where kept a second one: 1.67x the arguments here, now 0.7x.
        assert stats.temp_size_in_bytes < stats.argument_size_in_bytes
