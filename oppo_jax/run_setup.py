"""Everything a run needs before its first step: checkpoints, prompts, kernels, initial state."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.config import Config, devices_needed
from oppo_jax.data.prompts import PromptIterator, load_prompt_file, tokenize_prompts
from oppo_jax.errors import InputError
from oppo_jax.models.api import load_hf_model
from oppo_jax.models.hf_io import load_params
from oppo_jax.models.tokenizer import same_vocabulary
from oppo_jax.pipeline.host_state import sampling_key
from oppo_jax.pipeline.kernels import Kernels, build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.step import StepEngine
from oppo_jax.ppo.update import (
    TrainState,
    batch_shardings,
    make_sharded_init,
    make_sharded_update,
)
from oppo_jax.sharding import make_device_groups
from oppo_jax.specs import rollout_spec, update_spec

NUM_DEMO_PROMPTS = 4096  # size of the built-in demo's prompt set


def cache_dir() -> Path:
    """Where built-in assets are cached (``$OPPO_JAX_CACHE`` or ``~/.cache/oppo_jax``)."""
    return Path(os.environ.get("OPPO_JAX_CACHE", Path.home() / ".cache" / "oppo_jax"))


@dataclasses.dataclass(frozen=True)
class RunContext:
    """The static pieces of a run (the train state is not one: each step returns a new one)."""

    cfg: Config
    engine: StepEngine  # what every step dispatches to: kernels, placement, frozen scorers
    prompts: list[np.ndarray]
    tokenizer: object
    actor_dir: Path
    gold_fn: Callable[[np.ndarray, np.ndarray], np.ndarray] | None  # (responses, lengths) -> [B]
    prompts_truncated: int = 0  # user prompts cut to rollout.max_prompt_len (warned at load)

    @property
    def kernels(self) -> Kernels:
        return self.engine.kernels

    @property
    def placement(self) -> Placement:
        return self.engine.placement

    def prompt_iterator(self, state: dict | None = None) -> PromptIterator:
        """Prompts in the run's deterministic order, optionally resumed from ``state``."""
        if state is None:
            return PromptIterator(self.prompts, self.cfg.seed)
        return PromptIterator.from_state(self.prompts, self.cfg.seed, state)


def _demo_assets(cfg: Config, progress: bool):
    from oppo_jax.data.demo_task import DemoTaskSpec, gold_scores, sample_prompts
    from oppo_jax.demo.assets import ensure_demo_assets

    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    actor_dir, reward_dir = ensure_demo_assets(
        cache_dir() / "demo", spec, cfg.train.sft_steps, cfg.train.rm_steps, progress=progress
    )
    prompts = sample_prompts(spec, NUM_DEMO_PROMPTS, np.random.default_rng(12345))
    return actor_dir, reward_dir, prompts, lambda resp, lens: gold_scores(resp, lens, spec)


def _resolve_models(cfg: Config, progress: bool):
    """(actor_dir, reward_dir, demo prompts or None, gold function or None)."""
    m = cfg.model
    if "demo" in (m.actor_path, m.reward_path):
        if (m.actor_path, m.reward_path) != ("demo", "demo"):
            raise InputError(
                "model.actor_path and model.reward_path must both be 'demo' or neither"
            )
        return _demo_assets(cfg, progress)
    return Path(m.actor_path), Path(m.reward_path), None, None


def _user_prompts(cfg: Config, tokenizer) -> tuple[list[np.ndarray], int]:
    """(tokenized prompts of ``data.prompts``, how many were truncated)."""
    texts = load_prompt_file(cfg.data.prompts, cfg.data.prompt_field)
    return tokenize_prompts(
        texts, tokenizer, cfg.rollout.max_prompt_len, on_too_long=cfg.rollout.prompt_too_long,
        source=cfg.data.prompts,
    )  # fmt: skip


def _check_context(cfg: Config, actor_dir: Path, context: int) -> None:
    """Prompt plus response must fit the positions the actor was trained for."""
    r = cfg.rollout
    if r.max_prompt_len + r.max_response_len > context:
        raise InputError(
            f"rollout.max_prompt_len={r.max_prompt_len} + rollout.max_response_len="
            f"{r.max_response_len} exceeds the context of {actor_dir} "
            f"(max_position_embeddings={context})"
        )


def _placement(cfg: Config) -> Placement:
    m, have = cfg.mesh, len(jax.devices())
    if devices_needed(cfg) > have:
        raise InputError(
            f"the config needs {devices_needed(cfg)} devices (mesh {m.data}x{m.fsdp}x{m.tensor}"
            f" + scoring_devices {m.scoring_devices}) but {have} are visible; on a CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices_needed(cfg)}"
        )
    groups = make_device_groups(
        cfg.pipeline.placement, m.data, m.fsdp, m.tensor, m.scoring_devices,
        jax.devices()[: devices_needed(cfg)],
    )  # fmt: skip
    return Placement(groups)


def _batch_resharded(update: Callable, mesh) -> Callable:
    """``update`` that first lays the PPO batch out on its row sharding. jit reshards a
    mismatched argument by itself only when one process holds all of it; with several
    processes (multi-host) the batch built by the experience kernel must be moved here."""
    shardings = batch_shardings(mesh)

    def run(state, batch, key, kl_coef):
        return update(state, jax.device_put(batch, shardings), key, kl_coef)

    return run


def prepare_run(cfg: Config, progress: bool = True) -> tuple[RunContext, TrainState]:
    """Load (or build) the models, the prompts and the kernels of ``cfg``; returns the run's
    context and its initial train state."""
    actor_dir, reward_dir, prompts, gold_fn = _resolve_models(cfg, progress)
    dtypes = {"dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype}
    remote = cfg.model.trust_remote_code
    actor = load_hf_model(actor_dir, trust_remote_code=remote, **dtypes)
    reward = load_hf_model(reward_dir, trust_remote_code=remote, **dtypes)
    _check_models(actor, reward, actor_dir, reward_dir)
    critic_cfg = actor.config.replace(head="score", num_labels=1)
    if cfg.model.critic_init == "reward":
        critic_cfg, critic_params = reward.config, jax.tree.map(jnp.copy, reward.params)
    else:
        critic_params = load_params(actor_dir, critic_cfg, fresh_head_key=jax.random.key(cfg.seed))
    _check_context(cfg, actor_dir, actor.config.max_position_embeddings)
    truncated = 0
    if prompts is None:
        prompts, truncated = _user_prompts(cfg, actor.tokenizer)
    tok = actor.tokenizer
    eos_ids = tuple({tok.eos_token_id} - {None}) or (1,)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    placement = _placement(cfg)
    mesh = placement.groups.training
    spec = update_spec(cfg, actor.config, critic_cfg)
    update = _batch_resharded(make_sharded_update(spec, mesh)[0], mesh)
    rollout = rollout_spec(cfg, eos_ids, pad_id, placement)
    engine = StepEngine(
        kernels=build_kernels(spec, rollout, reward_model=reward.config, update=update),
        placement=placement,
        ref_params=placement.scoring_params(actor.config, actor.params),
        reward_params=placement.scoring_params(reward.config, reward.params),
        sample_key=sampling_key(cfg.seed),
        max_deferrals=cfg.pipeline.max_deferrals,
    )
    state = make_sharded_init(spec, mesh)(actor.params, critic_params)
    ctx = RunContext(cfg, engine, prompts, tok, actor_dir, gold_fn, prompts_truncated=truncated)
    return ctx, state


def _check_models(actor, reward, actor_dir: Path, reward_dir: Path) -> None:
    """The actor must be a CausalLM with a tokenizer, the reward model a classifier reading
    the same vocabulary."""
    if actor.config.head != "lm" or reward.config.head != "score":
        raise InputError(f"{actor_dir} must be a CausalLM and {reward_dir} a sequence classifier")
    if actor.tokenizer is None:
        raise InputError(f"{actor_dir}: no tokenizer files found")
    if reward.tokenizer is not None and not same_vocabulary(actor.tokenizer, reward.tokenizer):
        raise InputError(
            f"actor ({actor_dir}) and reward model ({reward_dir}) use different tokenizers; "
            "the reward model would read token ids from another vocabulary"
        )
