"""From a run Config to the static specs the kernels are compiled for, and abstract checks."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from oppo_jax import offload
from oppo_jax.config import Config, OptimConfig
from oppo_jax.models.model_config import ModelConfig, preset
from oppo_jax.pipeline.placement import Placement
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.optimizer import make_optimizer
from oppo_jax.ppo.update import (
    UpdateSpec,
    batch_shardings,
    make_sharded_update,
)
from oppo_jax.rollout.lengths import LengthSpec
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.rollout.spec import RolloutSpec
from oppo_jax.sharding import abstract_params, make_mesh, param_shardings, per_device_bytes
from oppo_jax.trained_params import abstract_train_state


def sampling_config(cfg: Config) -> SamplingConfig:
    """The rollout's sampling settings."""
    r = cfg.rollout
    return SamplingConfig(r.temperature, r.top_k, r.top_p, r.greedy)


def update_spec(cfg: Config, actor: ModelConfig, critic: ModelConfig) -> UpdateSpec:
    """Static description of the PPO update for ``cfg`` (optimizers sized to the run, layers
    rematerialised as ``model.remat`` says: the rollout never differentiates, so only here;
    LoRA adapters as ``model.lora_*`` say; trained weights in ``optim.master_dtype``)."""
    updates = cfg.train.steps * cfg.ppo.ppo_epochs * cfg.ppo.num_minibatches
    m = cfg.model
    # Trained weights are created (LoRA adapters, value heads) in the master dtype.
    trained = dict(
        remat=m.remat,
        param_dtype=cfg.optim.master_dtype,
        lora_rank=m.lora_rank,
        lora_alpha=m.lora_alpha,
        lora_targets=tuple(m.lora_targets),
    )
    return UpdateSpec(
        actor=actor.replace(**trained),
        critic=critic.replace(**trained),
        ppo=cfg.ppo,
        temperature=cfg.rollout.temperature,
        actor_tx=_optimizer(cfg.optim, cfg.optim.actor_lr, updates),
        critic_tx=_optimizer(cfg.optim, cfg.optim.critic_lr, updates),
    )


@functools.cache
def _optimizer(optim: OptimConfig, lr: float, updates: int):
    """AdamW of the run; with ``optim.offload`` its state rests in host memory. One object
    per setting, so that two runs' equal ``UpdateSpec``s are one key of ``make_update``'s
    cache and a second run in a process (a notebook's sync then oppo, a resume) reuses the
    compiled update."""
    tx = make_optimizer(optim, lr, updates)
    return offload.offloaded(tx) if optim.offload else tx


def rollout_spec(
    cfg: Config, eos_ids: tuple[int, ...], pad_id: int, placement: Placement | None = None
) -> RolloutSpec:
    """Static rollout shapes for ``cfg``; with a ``placement``, the meshes the decode and
    scorer state are sharded over (generation mesh, and ``placement.scoring_mesh``)."""
    return RolloutSpec(
        sampling=sampling_config(cfg),
        prompt_width=cfg.rollout.max_prompt_len,
        max_response_len=cfg.rollout.max_response_len,
        eos_ids=tuple(eos_ids),
        pad_id=pad_id,
        mesh=None if placement is None else placement.groups.generation,
        scoring_mesh=None if placement is None else placement.scoring_mesh,
        lengths=length_spec(cfg),
    )


def length_spec(cfg: Config) -> LengthSpec | None:
    """The synthetic length distribution of ``rollout.length_sampler: lognormal``, else None."""
    r = cfg.rollout
    if r.length_sampler == "policy":
        return None
    return LengthSpec(median=float(r.length_median), p99=float(r.length_p99))


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
    """Lower the sharded update of ``cfg`` on its declared mesh without allocating anything.

    Returns a dict with the mesh shape, the per-device parameter bytes of actor and critic
    (from the shardings), and the lowered computation (``.as_text()`` is the StableHLO).
    """
    m = cfg.mesh
    count = m.data * m.fsdp * m.tensor
    devices = list(jax.devices()[:count] if devices is None else devices)
    mesh = make_mesh(m.data, m.fsdp, m.tensor, devices)
    spec = update_spec(cfg, actor, critic)
    update, state_sh = make_sharded_update(spec, mesh)
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_train_state(spec, cfg.optim.master_dtype, cfg.model.param_dtype),
        state_sh,
    )
    batch = abstract_batch(cfg, batch_shardings(mesh))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    lowered = update.lower(abstract_state, batch, key, jax.ShapeDtypeStruct((), jnp.float32))
    return {
        "mesh": (m.data, m.fsdp, m.tensor),
        "actor_bytes_per_device": per_device_bytes(
            abstract_params(actor), param_shardings(actor, mesh)
        ),
        "critic_bytes_per_device": per_device_bytes(
            abstract_params(critic), param_shardings(critic, mesh)
        ),
        "lowered": lowered,
    }
