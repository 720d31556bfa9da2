"""Abstract checks of a run config: its models' architectures and its sharded PPO update,
lowered on the declared mesh without allocating anything."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from oppo_jax.config import Config
from oppo_jax.models.model_config import ModelConfig, preset
from oppo_jax.parallel.sharding import abstract_params, make_mesh, param_shardings
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.packing import padding_indices
from oppo_jax.ppo.update import batch_shardings, train_state_shardings
from oppo_jax.run.specs import update_spec
from oppo_jax.run.trained_params import abstract_train_state
from oppo_tools.memory.abstract import per_device_bytes


def preset_models(cfg: Config) -> tuple[ModelConfig, ModelConfig]:
    """Actor (lm head) and critic (score head) architectures of a config's ``model.preset``."""
    if cfg.model.preset is None:
        raise ValueError("model.preset is not set; abstract checks need an architecture")
    m = cfg.model
    dtypes = {"dtype": m.dtype, "param_dtype": m.param_dtype, "attention": m.attention}
    return preset(cfg.model.preset, **dtypes), preset(cfg.model.preset, head="score", **dtypes)


def abstract_batch(cfg: Config, shardings: PPOBatch | None = None) -> PPOBatch:
    """A PPOBatch of ShapeDtypeStructs for B rows (nothing allocated)."""
    b, p, r = cfg.rollout.batch_size, cfg.rollout.max_prompt_len, cfg.rollout.max_response_len

    def leaf(name, shape, dtype):
        sharding = None if shardings is None else getattr(shardings, name)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    fields = {f.name: leaf(f.name, (b, r), jnp.float32) for f in dataclasses.fields(PPOBatch)}
    fields["tokens"] = leaf("tokens", (b, p + r), jnp.int32)
    fields["prompt_len"] = leaf("prompt_len", (b,), jnp.int32)
    fields["scores"] = leaf("scores", (b,), jnp.float32)
    fields["mask"] = leaf("mask", (b, r), jnp.bool_)
    return PPOBatch(**fields)


def abstract_update_check(cfg: Config, actor: ModelConfig, critic: ModelConfig, devices=None):
    """Lower the update of ``cfg`` as a run jits it (packed, at its one shape) on its
    declared mesh without allocating anything.

    Returns a dict with the mesh shape, the per-device parameter bytes of actor and critic
    (from the shardings; 0 for a critic-free run's, which has none), and the lowered
    computation (``.as_text()`` is the StableHLO).
    """
    m = cfg.mesh
    count = m.data * m.fsdp * m.tensor
    devices = list(jax.devices()[:count] if devices is None else devices)
    mesh = make_mesh(m.data, m.fsdp, m.tensor, devices)
    spec = update_spec(cfg, actor, critic)
    update, state_sh = make_update(spec, mesh), train_state_shardings(spec, mesh)
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_train_state(spec, cfg.optim.master_dtype, cfg.model.param_dtype),
        state_sh,
    )
    batch = abstract_batch(cfg, batch_shardings(mesh))
    r = cfg.rollout
    shape, count = update.shape(r.batch_size, r.max_prompt_len + r.max_response_len,
                                r.max_response_len)  # fmt: skip
    ppo = spec.ppo
    outer = (ppo.ppo_epochs, ppo.num_minibatches, count)
    indices = padding_indices(outer, shape, r.batch_size // ppo.num_minibatches)
    indices = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), indices)
    kl_coef = jax.ShapeDtypeStruct((), jnp.float32)
    lowered = update.lower(abstract_state, batch, indices, kl_coef)
    return {
        "mesh": (m.data, m.fsdp, m.tensor),
        "actor_bytes_per_device": per_device_bytes(
            abstract_params(actor), param_shardings(actor, mesh)
        ),
        "critic_bytes_per_device": 0
        if spec.critic is None
        else per_device_bytes(abstract_params(critic), param_shardings(critic, mesh)),
        "lowered": lowered,
    }
