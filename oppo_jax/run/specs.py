"""A run's static specs, each a function of its config: sampling, the rollout's shapes and
meshes, synthetic lengths, and the update (models as trained, optimizers). Hashable, so equal
configs share compiled kernels."""

from __future__ import annotations

import functools

from oppo_jax.config import Config, OptimConfig
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel import offload
from oppo_jax.pipeline.placement import Placement
from oppo_jax.ppo.estimators import estimator
from oppo_jax.ppo.optimizer import make_optimizer
from oppo_jax.ppo.update import UpdateSpec
from oppo_jax.rollout.lengths import LengthSpec
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.rollout.spec import RolloutSpec


def sampling_config(cfg: Config) -> SamplingConfig:
    """The rollout's sampling settings."""
    r = cfg.rollout
    return SamplingConfig(r.temperature, r.top_k, r.top_p, r.greedy)


def update_spec(cfg: Config, actor: ModelConfig, critic: ModelConfig | None) -> UpdateSpec:
    """Static description of the PPO update for ``cfg`` (optimizers sized to the run, layers
    rematerialised as ``model.remat`` says: the rollout never differentiates, so only here;
    LoRA adapters as ``model.lora_*`` say; trained weights in ``optim.master_dtype``): the
    models the ``ppo.advantage`` estimator trains, each with its optimizer (a critic-free
    estimator: no critic)."""
    updates = cfg.train.steps * cfg.ppo.ppo_epochs * cfg.ppo.num_minibatches
    m = cfg.model
    # Trained weights are created (LoRA adapters, value heads) in the master dtype.
    trained = dict(
        remat=m.remat,
        param_dtype=cfg.optim.master_dtype,
        lora_rank=m.lora_rank,
        lora_alpha=m.lora_alpha,
        lora_targets=tuple(m.lora_targets),
        lora_train_head=m.lora_train_head,
    )
    given, trains = {"actor": actor, "critic": critic}, estimator(cfg.ppo).trained
    models = {m: given[m].replace(**trained) for m in trains}
    txs = {m: _optimizer(cfg.optim, cfg.learning_rate(m), updates) for m in trains}
    return UpdateSpec(
        actor=models["actor"],
        critic=models.get("critic"),  # None: the estimator trains no critic
        ppo=cfg.ppo,
        temperature=cfg.rollout.temperature,
        actor_tx=txs["actor"],
        critic_tx=txs.get("critic"),
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
        group_size=cfg.rollout.group_size,
    )


def length_spec(cfg: Config) -> LengthSpec | None:
    """The synthetic length distribution of ``rollout.length_sampler: lognormal``, else None."""
    r = cfg.rollout
    if r.length_sampler == "policy":
        return None
    return LengthSpec(median=float(r.length_median), p99=float(r.length_p99))
