"""Everything a run needs before its first step: checkpoints, prompts, models, kernels and
the initial state (the static specs they are built from: ``run.specs``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from oppo_jax.base.errors import InputError
from oppo_jax.config import Config, devices_needed
from oppo_jax.data.prompt_set import PromptFormat, PromptSet, load_prompt_set
from oppo_jax.data.prompts import PromptIterator
from oppo_jax.data.random_prompts import RANDOM_EOS_ID, RANDOM_PAD_ID, random_prompts
from oppo_jax.models.api import HFModel, load_hf_model
from oppo_jax.models.hf_io import load_params
from oppo_jax.models.model_config import ModelConfig, preset
from oppo_jax.models.tokenizer import same_vocabulary
from oppo_jax.models.transformer import init_params
from oppo_jax.parallel.sharding import init_sharded_params, make_device_groups, placed_on
from oppo_jax.pipeline.host_state import sampling_key
from oppo_jax.pipeline.kernels import Kernels, build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.step import StepEngine
from oppo_jax.ppo.estimators import estimator
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.update import (
    TrainState,
    make_sharded_init,
)
from oppo_jax.rewards.setup import reward_functions
from oppo_jax.run.specs import rollout_spec, update_spec
from oppo_jax.run.trained_params import initial_params

NUM_DEMO_PROMPTS = 4096  # size of the built-in demo's prompt set
DEMO_CONTEXT = 128  # context of the default demo models, tokens; longer runs get their own
RANDOM_MODELS = "random"  # model.actor_path / reward_path of seeded random-weight models


def cache_dir() -> Path:
    """Where built-in assets are cached (``$OPPO_JAX_CACHE`` or ``~/.cache/oppo_jax``)."""
    return Path(os.environ.get("OPPO_JAX_CACHE", Path.home() / ".cache" / "oppo_jax"))


@dataclasses.dataclass(frozen=True)
class RunContext:
    """The static pieces of a run (the train state is not one: each step returns a new one)."""

    cfg: Config
    engine: StepEngine  # what every step dispatches to: kernels, placement, frozen scorers
    prompts: list[np.ndarray] | PromptSet  # a PromptSet (with its records) for user data
    tokenizer: object  # None for random models
    actor_dir: Path | None  # None for random models
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
    """The demo task's actor and reward model, in ``<cache>/demo``, built for the run's
    response length (the SFT corpus is capped at it).

    A run whose prompt + response exceed the default models' context of 128 tokens (e.g. the
    long-tail bench, R = 512, whose lengths come from ``rollout.length_sampler``) gets models
    trained on the default corpus (capped at 64 tokens: the task's responses rarely reach
    it) with a context of the next power of two, in ``<cache>/demo-ctx<N>``, so that neither
    set of models evicts the other from the cache and the long run costs one default build.
    """
    from oppo_jax.data.demo_task import DemoTaskSpec, gold_scores, sample_prompts
    from oppo_jax.demo.assets import ensure_demo_assets

    r = cfg.rollout.max_response_len
    spec = DemoTaskSpec(max_response_len=r)
    context = cfg.rollout.max_prompt_len + r
    where, sizes = cache_dir() / "demo", None
    if context > DEMO_CONTEXT:
        spec, width = DemoTaskSpec(), 1 << (context - 1).bit_length()
        where, sizes = cache_dir() / f"demo-ctx{width}", {"max_position_embeddings": width}
    actor_dir, reward_dir = ensure_demo_assets(
        where,
        spec,
        cfg.train.sft_steps,
        cfg.train.rm_steps,
        progress=progress,
        model_sizes=sizes,
    )
    prompts = sample_prompts(spec, NUM_DEMO_PROMPTS, np.random.default_rng(12345))
    return actor_dir, reward_dir, prompts, lambda resp, lens: gold_scores(resp, lens, spec)


def _random_models(cfg: Config, mesh) -> tuple[HFModel, HFModel]:
    """Seeded random-weight actor and reward model of ``model.preset`` (no files), born
    sharded over ``mesh``: for benchmarks at any size. They read eos id 1 and pad id 0 and
    have no tokenizer."""
    m = cfg.model
    try:
        arch = preset(m.preset, dtype=m.dtype, param_dtype=m.param_dtype)
    except ValueError as e:
        raise InputError(f"model.preset={m.preset!r}: {e}") from None
    arch = arch.replace(pad_token_id=RANDOM_PAD_ID)
    actor_key, reward_key = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), 7))
    reward_arch = arch.replace(head="score", num_labels=1)
    return (
        HFModel(arch, init_sharded_params(arch, actor_key, mesh), Path(RANDOM_MODELS)),
        HFModel(
            reward_arch, init_sharded_params(reward_arch, reward_key, mesh), Path(RANDOM_MODELS)
        ),
    )


def _critic_from_actor(actor: HFModel, critic_cfg: ModelConfig, key: jax.Array):
    """A random model's critic started from the actor: its backbone, a fresh score head."""
    fresh = jax.jit(init_params, static_argnums=0)(critic_cfg, key)
    return {name: fresh[name] if name == "score" else actor.params[name] for name in fresh}


def _load_models(cfg: Config, mesh, progress: bool):
    """(actor, reward model, actor_dir or None, demo prompts or None, gold function or None);
    every parameter is placed on its sharding over ``mesh`` as it is read or initialised."""
    m = cfg.model
    if (m.actor_path == "demo") != (m.reward_path == "demo") or (
        (m.actor_path == RANDOM_MODELS) != (m.reward_path == RANDOM_MODELS)
    ):
        raise InputError(
            f"model.actor_path={m.actor_path!r} and model.reward_path={m.reward_path!r}: "
            "must both be 'demo', both 'random', or neither"
        )
    if m.actor_path == RANDOM_MODELS:
        actor, reward = (_with_attention(x, m.attention) for x in _random_models(cfg, mesh))
        return actor, reward, None, None, None
    prompts = gold_fn = None
    actor_dir, reward_dir = Path(m.actor_path), Path(m.reward_path)
    if m.actor_path == "demo":
        actor_dir, reward_dir, prompts, gold_fn = _demo_assets(cfg, progress)
        if cfg.data.prompts != "demo":  # the user's prompts, read with the demo's tokenizer
            prompts = None
    if m.actor_path == "demo_arith":  # the addition task's SFT actor, built on first use
        from oppo_jax.demo.arith import ensure_arith_actor

        actor_dir = ensure_arith_actor(cache_dir() / "demo_arith", cfg.train.sft_steps, 0, progress)
    if m.actor_path == "demo_word_problems":  # the word problems' SFT actor, built on first use
        from oppo_jax.demo.word_problems import ensure_word_actor

        actor_dir = ensure_word_actor(cache_dir() / m.actor_path, cfg.train.sft_steps, 0, progress)
    options = {"dtype": m.dtype, "param_dtype": m.param_dtype, "placement": placed_on(mesh)}
    actor = load_hf_model(actor_dir, trust_remote_code=m.trust_remote_code, **options)
    reward = None  # reward.model_weight=0: reward functions alone score; no model is loaded
    if cfg.reward.model_weight:
        reward = load_hf_model(reward_dir, trust_remote_code=m.trust_remote_code, **options)
    _check_models(actor, reward, actor_dir, reward_dir)
    actor, reward = _with_attention(actor, m.attention), _with_attention(reward, m.attention)
    return actor, reward, actor_dir, prompts, gold_fn


def _with_attention(model: HFModel | None, kernel: str) -> HFModel | None:
    """``model`` whose architecture runs attention on ``kernel`` (``model.attention``): a
    choice of the run, not of the checkpoint, so it is set after loading."""
    if model is None:
        return None
    return dataclasses.replace(model, config=model.config.replace(attention=kernel))


def prompt_format(cfg: Config) -> PromptFormat:
    """How records of ``data.prompts`` (and ``eval.prompts``) become prompt text."""
    d = cfg.data
    return PromptFormat(
        d.prompt_field, d.messages_field, d.chat_template, d.system_prompt, d.answer_field
    )


def _user_prompts(cfg: Config, tokenizer) -> tuple[PromptSet, int]:
    """(tokenized prompts of ``data.prompts``, streamed from their source; how many were
    truncated)."""
    return load_prompt_set(
        cfg.data.prompts,
        tokenizer,
        cfg.rollout.max_prompt_len,
        cfg.rollout.prompt_too_long,
        prompt_format(cfg),
        cfg.data.split,
    )


def _random_prompt_set(cfg: Config, actor: HFModel) -> list[np.ndarray]:
    """``data.prompts: random``: seeded token ids within the actor's vocabulary (its
    tokenizer's, when it has one), special ids left out."""
    vocab, special = actor.config.vocab_size, [RANDOM_EOS_ID, RANDOM_PAD_ID]
    if actor.tokenizer is not None:
        vocab = min(vocab, len(actor.tokenizer))
        special = list(getattr(actor.tokenizer, "all_special_ids", []))
    lo, hi = cfg.data.random_prompt_len
    return random_prompts(vocab, (lo, hi), exclude=special)


def _check_context(cfg: Config, actor_dir: Path | None, context: int) -> None:
    """Prompt plus response must fit the positions the actor was trained for."""
    r = cfg.rollout
    if r.max_prompt_len + r.max_response_len > context:
        raise InputError(
            f"rollout.max_prompt_len={r.max_prompt_len} + rollout.max_response_len="
            f"{r.max_response_len} exceeds the context of "
            f"{actor_dir or f'model.preset={cfg.model.preset}'} "
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
        cfg.pipeline.placement,
        m.data,
        m.fsdp,
        m.tensor,
        m.scoring_devices,
        jax.devices()[: devices_needed(cfg)],
    )
    return Placement(groups)


def staleness_settings(rollout) -> dict:
    """The engine's settings of carried groups (``StepEngine``), from ``cfg.rollout``."""
    keys = ("max_staleness", "on_stale", "carry_kv")
    return {key: getattr(rollout, key) for key in keys}


def prepare_run(cfg: Config, progress: bool = True) -> tuple[RunContext, TrainState]:
    """Load (or build) the models, the prompts and the kernels of ``cfg``; returns the run's
    context and its initial train state."""
    placement = _placement(cfg)
    mesh = placement.groups.training
    actor, reward, actor_dir, prompts, gold_fn = _load_models(cfg, mesh, progress)
    critic_cfg = actor.config.replace(head="score", num_labels=1)
    critic_params = None  # a LoRA critic started from the actor sits on the actor's base
    if not estimator(cfg.ppo).needs_critic:  # critic-free (the GRPO family): none is built
        pass
    elif cfg.model.critic_init == "reward":  # copied (trained) or shared (a LoRA base) below
        critic_cfg, critic_params = reward.config, reward.params
    elif cfg.model.lora_rank:
        pass
    elif actor_dir is None:
        critic_params = _critic_from_actor(actor, critic_cfg, jax.random.key(cfg.seed))
    else:
        critic_params = load_params(
            actor_dir, critic_cfg, jax.random.key(cfg.seed), placed_on(mesh)(critic_cfg)
        )
    _check_context(cfg, actor_dir, actor.config.max_position_embeddings)
    truncated = 0
    if cfg.data.prompts == "random":
        prompts = _random_prompt_set(cfg, actor)
    elif prompts is None:
        prompts, truncated = _user_prompts(cfg, actor.tokenizer)
    eos_ids, pad_id = (RANDOM_EOS_ID,), RANDOM_PAD_ID  # random models: no tokenizer
    if (tok := actor.tokenizer) is not None:
        eos_ids = tuple({tok.eos_token_id} - {None}) or (1,)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    spec = update_spec(cfg, actor.config, critic_cfg)
    update = make_update(spec, mesh)  # moves the batch onto its row shardings itself
    rollout = rollout_spec(cfg, eos_ids, pad_id, placement)
    if not cfg.reward.model_weight:  # (random models are built in pairs; drop the reward one)
        reward = None
    engine = StepEngine(
        kernels=dataclasses.replace(
            build_kernels(spec, rollout, reward_model=reward and reward.config, update=update),
            compact_slots=cfg.pipeline.compact_slots,
            compact_min_slots=cfg.pipeline.compact_min_slots,
        ),
        placement=placement,
        ref_params=placement.scoring_params(actor.config, actor.params)
        if cfg.ppo.uses_reference
        else None,  # β = 0: no reference
        reward_params=reward and placement.scoring_params(reward.config, reward.params),
        sample_key=sampling_key(cfg.seed),
        rewards=reward_functions(cfg, tok, prompts, eos_ids),  # reward.functions (host)
        **staleness_settings(cfg.rollout),
    )
    critic_base = reward.params if reward and cfg.model.critic_init == "reward" else actor.params
    actor_trained, critic_trained, frozen = initial_params(
        spec,
        actor.params,
        critic_params,
        critic_base,
        mesh,
        jax.random.fold_in(jax.random.key(cfg.seed), 11),
        cfg.optim.master_dtype,
    )
    state = make_sharded_init(spec, mesh)(actor_trained, critic_trained).replace(frozen=frozen)
    ctx = RunContext(cfg, engine, prompts, tok, actor_dir, gold_fn, prompts_truncated=truncated)
    return ctx, state


def _check_models(actor, reward, actor_dir: Path, reward_dir: Path) -> None:
    """The actor must be a CausalLM with a tokenizer, the reward model a classifier reading
    the same vocabulary."""
    if actor.config.head != "lm" or (reward is not None and reward.config.head != "score"):
        raise InputError(f"{actor_dir} must be a CausalLM and {reward_dir} a sequence classifier")
    if actor.tokenizer is None:
        raise InputError(f"{actor_dir}: no tokenizer files found")
    if reward is None:
        return
    if reward.tokenizer is not None and not same_vocabulary(actor.tokenizer, reward.tokenizer):
        raise InputError(
            f"actor ({actor_dir}) and reward model ({reward_dir}) use different tokenizers; "
            "the reward model would read token ids from another vocabulary"
        )
