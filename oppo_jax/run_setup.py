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
from oppo_jax.models.api import load_hf_model
from oppo_jax.models.hf_io import load_params
from oppo_jax.models.tokenizer import same_vocabulary
from oppo_jax.pipeline.kernels import Kernels, build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.ppo.update import TrainState, make_sharded_init, make_sharded_update
from oppo_jax.sharding import make_device_groups
from oppo_jax.specs import rollout_spec, update_spec

NUM_DEMO_PROMPTS = 4096  # size of the built-in demo's prompt set


def cache_dir() -> Path:
    """Where built-in assets are cached (``$OPPO_JAX_CACHE`` or ``~/.cache/oppo_jax``)."""
    return Path(os.environ.get("OPPO_JAX_CACHE", Path.home() / ".cache" / "oppo_jax"))


@dataclasses.dataclass
class RunContext:
    """The static pieces of a run and its freshly initialised state."""

    cfg: Config
    kernels: Kernels
    train_state: TrainState
    ref_params: dict
    reward_params: dict
    prompts: list[np.ndarray]
    tokenizer: object
    actor_dir: Path
    gold_fn: Callable[[np.ndarray, np.ndarray], np.ndarray] | None  # (responses, lengths) -> [B]
    placement: Placement

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
            raise ValueError(
                "model.actor_path and model.reward_path must both be 'demo' or neither"
            )
        return _demo_assets(cfg, progress)
    return Path(m.actor_path), Path(m.reward_path), None, None


def _user_prompts(cfg: Config, tokenizer) -> list[np.ndarray]:
    texts = load_prompt_file(cfg.data.prompts, cfg.data.prompt_field)
    prompts, _ = tokenize_prompts(
        texts, tokenizer, cfg.rollout.max_prompt_len, on_too_long=cfg.rollout.prompt_too_long
    )
    return prompts


def _placement(cfg: Config) -> Placement:
    m, have = cfg.mesh, len(jax.devices())
    if devices_needed(cfg) > have:
        raise ValueError(
            f"the config needs {devices_needed(cfg)} devices (mesh {m.data}x{m.fsdp}x{m.tensor}"
            f" + scoring_devices {m.scoring_devices}) but {have} are visible; on a CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices_needed(cfg)}"
        )
    groups = make_device_groups(
        cfg.pipeline.placement, m.data, m.fsdp, m.tensor, m.scoring_devices,
        jax.devices()[: devices_needed(cfg)],
    )  # fmt: skip
    return Placement(groups)


def prepare_run(cfg: Config, progress: bool = True) -> RunContext:
    """Load (or build) the models, the prompts and the compiled kernels of ``cfg``."""
    actor_dir, reward_dir, prompts, gold_fn = _resolve_models(cfg, progress)
    dtypes = {"dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype}
    remote = cfg.model.trust_remote_code
    actor = load_hf_model(actor_dir, trust_remote_code=remote, **dtypes)
    reward = load_hf_model(reward_dir, trust_remote_code=remote, **dtypes)
    if actor.config.head != "lm" or reward.config.head != "score":
        raise ValueError(f"{actor_dir} must be a CausalLM and {reward_dir} a sequence classifier")
    if actor.tokenizer is None:
        raise ValueError(f"{actor_dir}: no tokenizer files found")
    if reward.tokenizer is not None and not same_vocabulary(actor.tokenizer, reward.tokenizer):
        raise ValueError(
            f"actor ({actor_dir}) and reward model ({reward_dir}) use different tokenizers; "
            "the reward model would read token ids from another vocabulary"
        )
    critic_cfg = actor.config.replace(head="score", num_labels=1)
    if cfg.model.critic_init == "reward":
        critic_cfg, critic_params = reward.config, jax.tree.map(jnp.copy, reward.params)
    else:
        critic_params = load_params(actor_dir, critic_cfg, fresh_head_key=jax.random.key(cfg.seed))
    if prompts is None:
        prompts = _user_prompts(cfg, actor.tokenizer)
    tok = actor.tokenizer
    eos_ids = tuple({tok.eos_token_id} - {None}) or (1,)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    placement = _placement(cfg)
    mesh = placement.groups.training
    spec = update_spec(cfg, actor.config, critic_cfg)
    update, _ = make_sharded_update(spec, mesh)
    rollout = rollout_spec(cfg, eos_ids, pad_id)
    kernels = build_kernels(spec, rollout, reward_model=reward.config, update=update)
    state = make_sharded_init(spec, mesh)(actor.params, critic_params)
    return RunContext(
        cfg, kernels, state, ref_params=placement.to_scoring(actor.params),
        reward_params=placement.to_scoring(reward.params), prompts=prompts, tokenizer=tok,
        actor_dir=actor_dir, gold_fn=gold_fn, placement=placement,
    )  # fmt: skip
