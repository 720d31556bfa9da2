"""Checks of a run configuration's values; each problem names the dotted key and the bad value.

Pure Python over the dataclass instances (no jax, no OmegaConf), so a notebook can build a
`Config` by hand and still get the same errors as `load_config` gives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import TYPE_CHECKING, Any

from oppo_jax.base.errors import ConfigError
from oppo_jax.config.schema import LORA_TARGETS
from oppo_jax.config.validate_user import user_data_problems

if TYPE_CHECKING:
    from oppo_jax.config.schema import Config


# Allowed values of the string-valued choices.
ENUMS: dict[str, tuple[str, ...]] = {
    "model.critic_init": ("reward", "actor"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.remat": ("none", "full", "dots"),
    "model.attention": ("auto", "xla", "cudnn", "splash", "ragged"),
    "optim.master_dtype": ("float32", "bfloat16"),
    "rollout.prompt_too_long": ("truncate", "reject"),
    "rollout.length_sampler": ("policy", "lognormal"),
    "ppo.kl_estimator": ("k1", "k2", "k3"),
    "ppo.loss_agg": ("token_mean", "seq_mean", "dr_grpo", "dapo"),
    "ppo.advantage": ("gae", "grpo", "rloo", "reinforce_pp"),
    "ppo.scale_rewards": ("group", "batch", "none"),
    "ppo.importance_sampling_level": ("token", "sequence", "sequence_sum"),
    "ppo.off_policy_correction": ("none", "tis", "mis"),
    "rollout.on_stale": ("finish", "drop"),
    "rollout.carry_kv": ("replay", "keep"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "pipeline.mode": ("sync", "intra", "inter", "oppo"),
    "pipeline.placement": ("colocated", "disaggregated"),
}
_POSITIVE_INTS = (
    "rollout.batch_size", "rollout.group_size", "rollout.max_prompt_len",
    "rollout.max_response_len",
    "ppo.kl_horizon", "ppo.ppo_epochs", "ppo.num_minibatches", "ppo.grad_accum_steps",
    "ppo.pack_granule", "ppo.pack_width_factor",
    "mesh.data", "mesh.fsdp", "mesh.tensor",
    "pipeline.chunk_size", "pipeline.chunk_tuning_every", "pipeline.overcommit_window",
    "train.steps", "train.max_to_keep", "train.log_every", "train.max_nonfinite_in_a_row",
)  # fmt: skip
_NONNEGATIVE = (
    "rollout.top_k", "ppo.kl_coef", "ppo.vf_coef", "ppo.entropy_coef",
    "optim.actor_lr", "optim.critic_lr", "optim.weight_decay", "optim.warmup_steps",
    "mesh.scoring_devices", "pipeline.overcommit", "pipeline.overcommit_min",
    "pipeline.overcommit_max", "rollout.max_staleness", "rollout.refill_every",
    "train.checkpoint_every",
    "train.sft_steps", "train.rm_steps", "model.lora_rank",
)  # fmt: skip
_POSITIVE_FLOATS = (
    "ppo.target_kl", "ppo.cliprange", "ppo.cliprange_value", "optim.max_grad_norm",
    "optim.adam_eps", "rollout.length_median", "rollout.length_p99", "model.lora_alpha",
    "optim.lora_lr_scale",
)  # fmt: skip


def type_name(hint: Any) -> str:
    """Readable name of a field annotation: `int`, `str | None`, `list[int]`."""
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items()
        )
    if hint is Any:
        return True
    if hint is float:  # an int is an exact float; bool is not a number here
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_problems(obj: Any, prefix: str = "") -> list[str]:
    """Wrong types and non-finite floats, found by walking the dataclass tree."""
    problems = []
    for f in dataclasses.fields(obj):
        key, value, hint = prefix + f.name, getattr(obj, f.name), _hints(type(obj))[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, hint):
            problems += _type_problems(value, key + ".")
        elif not _matches(value, hint):
            problems.append(f"{key}={value!r}: expected {type_name(hint)}")
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{key}={value!r}: must be finite")
    return problems


def _get(cfg: Any, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def _value_problems(cfg: Config) -> list[str]:
    """Per-key ranges and choices."""
    problems = []
    for key in _POSITIVE_INTS:
        if (v := _get(cfg, key)) < 1:
            problems.append(f"{key}={v!r}: must be a positive integer")
    for key in _NONNEGATIVE:
        if (v := _get(cfg, key)) < 0:
            problems.append(f"{key}={v!r}: must be >= 0")
    for key in _POSITIVE_FLOATS:
        if (v := _get(cfg, key)) <= 0:
            problems.append(f"{key}={v!r}: must be > 0")
    for key, allowed in ENUMS.items():
        if (v := _get(cfg, key)) not in allowed:
            problems.append(f"{key}={v!r}: must be one of {', '.join(allowed)}")
    for key in ("ppo.gamma", "ppo.lam"):
        if not 0 <= (v := _get(cfg, key)) <= 1:
            problems.append(f"{key}={v!r}: must lie in [0, 1]")
    for key in ("optim.adam_b1", "optim.adam_b2"):
        if not 0 <= (v := _get(cfg, key)) < 1:
            problems.append(f"{key}={v!r}: must lie in [0, 1)")
    if not 0 <= cfg.seed < 2**32:
        problems.append(f"seed={cfg.seed!r}: must lie in [0, 2**32)")
    r, ppo = cfg.rollout, cfg.ppo
    if not r.greedy and r.temperature <= 0:
        problems.append(f"rollout.temperature={r.temperature!r}: must be > 0 unless greedy")
    if not 0 < r.top_p <= 1:
        problems.append(f"rollout.top_p={r.top_p!r}: must lie in (0, 1]")
    if ppo.importance_clip < 1:
        problems.append(f"ppo.importance_clip={ppo.importance_clip!r}: must be >= 1")
    if not 0 <= ppo.mis_lower <= 1 <= ppo.mis_upper:  # an on-policy sequence (ratio 1) is kept
        problems.append(
            f"ppo.mis_lower={ppo.mis_lower!r}, ppo.mis_upper={ppo.mis_upper!r}: the band must "
            "hold 1 (0 <= mis_lower <= 1 <= mis_upper)"
        )
    if ppo.missing_eos_penalty is not None and ppo.missing_eos_penalty < 0:
        problems.append(f"ppo.missing_eos_penalty={ppo.missing_eos_penalty!r}: must be >= 0")
    floor = cfg.pipeline.compact_min_slots
    if floor < 1 or floor & (floor - 1):
        problems.append(f"pipeline.compact_min_slots={floor!r}: must be a power of two >= 1")
    cands = cfg.pipeline.chunk_candidates
    if not cands or min(cands) < 1:
        problems.append(f"pipeline.chunk_candidates={cands!r}: must be positive token counts")
    targets = cfg.model.lora_targets
    if not targets or not set(targets) <= set(LORA_TARGETS):
        problems.append(f"model.lora_targets={targets!r}: a non-empty subset of {LORA_TARGETS}")
    return problems


def _source_problems(cfg: Config) -> list[str]:
    """Model and prompt sources: built-in ones come in pairs, random models need a preset,
    random prompts a length range, synthetic lengths a median within the response cap."""
    problems, m, r, d = [], cfg.model, cfg.rollout, cfg.data
    for kind in ("demo", "random"):
        if kind in (m.actor_path, m.reward_path) and m.actor_path != m.reward_path:
            problems.append(
                f"model.actor_path={m.actor_path!r}, model.reward_path={m.reward_path!r}: "
                f"must both be {kind!r} or neither"
            )
    if m.actor_path == "random" and m.preset is None:
        problems.append("model.preset=None: random models need an architecture (e.g. small)")
    if m.actor_path == "random" and d.prompts != "random":
        problems.append(
            f"data.prompts={d.prompts!r}: must be 'random' with random models (no tokenizer)"
        )
    lo_hi = d.random_prompt_len  # only read for random prompts
    bad = len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1] <= r.max_prompt_len
    if d.prompts == "random" and bad:
        problems.append(
            f"data.random_prompt_len={lo_hi!r}: must be [shortest, longest] with "
            f"1 <= shortest <= longest <= rollout.max_prompt_len={r.max_prompt_len}"
        )
    if r.length_sampler == "lognormal" and not r.length_median <= r.length_p99:
        problems.append(
            f"rollout.length_median={r.length_median!r}: must be <= "
            f"rollout.length_p99={r.length_p99!r}"
        )
    if r.length_sampler == "lognormal" and r.length_median > r.max_response_len:
        problems.append(
            f"rollout.length_median={r.length_median!r}: must be <= "
            f"rollout.max_response_len={r.max_response_len}"
        )
    return problems


def _relation_problems(cfg: Config) -> list[str]:
    """Constraints that tie several keys together (batch splits, Δ bounds, placement)."""
    problems = _source_problems(cfg)
    b, ppo, mesh, p = cfg.rollout.batch_size, cfg.ppo, cfg.mesh, cfg.pipeline
    splits, batch_shards = ppo.num_minibatches * ppo.grad_accum_steps, mesh.data * mesh.fsdp
    if b % splits:
        problems.append(
            f"rollout.batch_size={b}: must be divisible by "
            f"ppo.num_minibatches*ppo.grad_accum_steps={splits}"
        )
    elif b % batch_shards:
        problems.append(
            f"rollout.batch_size={b}: must be divisible by mesh.data*mesh.fsdp={batch_shards}"
        )
    elif (b // splits) % batch_shards:
        # Every microbatch is sharded over the batch axes of the mesh.
        problems.append(
            f"rollout.batch_size={b}: its microbatches of {b // splits} sequences must be "
            f"divisible by mesh.data*mesh.fsdp={batch_shards}"
        )
    if p.overcommit_min > p.overcommit_max:
        problems.append(
            f"pipeline.overcommit_min={p.overcommit_min}: must be <= "
            f"pipeline.overcommit_max={p.overcommit_max}"
        )
    elif p.adaptive_overcommit and not p.overcommit_min <= p.overcommit <= p.overcommit_max:
        problems.append(
            f"pipeline.overcommit={p.overcommit}: must lie in [pipeline.overcommit_min, "
            f"pipeline.overcommit_max]=[{p.overcommit_min}, {p.overcommit_max}] "
            "when pipeline.adaptive_overcommit is on"
        )
    problems += _group_problems(cfg)
    g = cfg.rollout.group_size
    largest_delta = p.overcommit_max if p.adaptive_overcommit else p.overcommit
    if largest_delta * g > b and p.mode in ("inter", "oppo"):  # the schedules that carry
        # At most Δ groups are carried out of a step; B + Δ'G slots must take them all in.
        problems.append(
            f"pipeline.overcommit{'_max' if p.adaptive_overcommit else ''}={largest_delta}: "
            f"must be <= rollout.batch_size / rollout.group_size ({b}/{g})={b // g} (groups)"
        )
    problems += _staleness_problems(cfg, largest_delta) + _refill_problems(cfg)
    if p.placement == "disaggregated" and mesh.scoring_devices < 1:
        problems.append(
            f"mesh.scoring_devices={mesh.scoring_devices}: must be >= 1 when "
            "pipeline.placement=disaggregated"
        )
    if p.placement == "colocated" and mesh.scoring_devices:
        problems.append(
            f"mesh.scoring_devices={mesh.scoring_devices}: must be 0 when "
            "pipeline.placement=colocated (scorers share the mesh)"
        )
    return problems


def _staleness_problems(cfg: Config, largest_delta: int) -> list[str]:
    """The staleness bound: with must-finish, every group at the bound has to fit the batch."""
    r, p = cfg.rollout, cfg.pipeline
    carrying = p.mode in ("inter", "oppo") and largest_delta > 0
    if carrying and r.max_staleness == 0 and r.on_stale == "finish":
        # Every admitted group is at the bound: B/G + Δ groups must finish, B/G are trained.
        return [
            "rollout.max_staleness=0: with rollout.on_stale=finish every one of the B + Δ·G "
            "sequences a step starts must finish in it, but only B are trained; set "
            "rollout.on_stale=drop, max_staleness >= 1, or pipeline.overcommit=0"
        ]
    return []


def _refill_problems(cfg: Config) -> list[str]:
    """Continuous refill (rollout.refill_every): what the built engine runs it with."""
    r, p = cfg.rollout, cfg.pipeline
    if not r.refill_every:
        return []
    key, problems = f"rollout.refill_every={r.refill_every}", []
    sizes = {p.chunk_size, *(p.chunk_candidates if p.chunk_tuning else ())}
    if p.mode not in ("inter", "oppo"):
        problems.append(f"{key}: refill is a carrying schedule's; pipeline.mode={p.mode}")
    if any(r.refill_every % c for c in sizes):
        problems.append(f"{key}: must be a multiple of every chunk size ({sorted(sizes)})")
    if p.adaptive_overcommit or p.compact_slots or p.placement != "colocated":
        problems.append(
            f"{key}: refill decodes a fixed B + Δ·G rows on one mesh; set "
            "pipeline.adaptive_overcommit=false, pipeline.compact_slots=null or false and "
            "pipeline.placement=colocated"
        )
    return problems


def _group_problems(cfg: Config) -> list[str]:
    """Group sampling and the critic-free estimators (the GRPO family)."""
    r, ppo, problems = cfg.rollout, cfg.ppo, []
    if r.batch_size % r.group_size:
        problems.append(
            f"rollout.batch_size={r.batch_size}: must be a multiple of "
            f"rollout.group_size={r.group_size} (a batch holds whole groups)"
        )
    if ppo.advantage != "gae" and r.group_size < 2:
        problems.append(
            f"rollout.group_size={r.group_size}: ppo.advantage={ppo.advantage} needs groups of "
            "at least 2 responses per prompt (its baseline is the group's other scores)"
        )
    if ppo.advantage != "gae" and ppo.adaptive_kl:
        problems.append(f"ppo.adaptive_kl=true: not supported with ppo.advantage={ppo.advantage}")
    if ppo.cliprange_high is not None and ppo.cliprange_high <= 0:
        problems.append(f"ppo.cliprange_high={ppo.cliprange_high}: must be > 0 (or null)")
    if r.group_size > 1 and cfg.pipeline.compact_slots:
        problems.append(
            "pipeline.compact_slots=true: slot compaction does not keep groups together; "
            f"set it to null or false with rollout.group_size={r.group_size}"
        )
    return problems + _ratio_level_problems(ppo)


def _ratio_level_problems(ppo) -> list[str]:
    """The sequence-level ratios (GSPO's, TRL RLOOTrainer's) and what they are refused with."""
    level, problems = ppo.importance_sampling_level, []
    key = f"ppo.importance_sampling_level={level}"
    if level == "token":
        return problems
    if ppo.advantage == "gae":
        problems.append(
            f"{key}: one ratio per sequence weighs one advantage per sequence; ppo.advantage=gae "
            "gives each token its own (use grpo, rloo or reinforce_pp, or level token)"
        )
    if ppo.off_policy_correction == "tis":
        problems.append(
            f"{key}: ppo.off_policy_correction=tis weights each token by its own stale ratio, "
            "a token-level correction; use mis (a sequence mask), none, or level token"
        )
    if level == "sequence_sum" and ppo.loss_agg != "seq_mean":
        problems.append(
            f"{key}: TRL RLOOTrainer's loss averages one clipped term per sequence; set "
            f"ppo.loss_agg=seq_mean (not {ppo.loss_agg})"
        )
    return problems


def _raise(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ConfigError(problems[0], problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{len(problems)} config problems:\n{lines}", problems)


def validate(cfg: Config) -> None:
    """Raise `ConfigError` listing every bad value in `cfg` (types, then ranges, then relations)."""
    _raise(_type_problems(cfg))
    _raise(_value_problems(cfg))
    _raise(_relation_problems(cfg))  # may divide by axis sizes, so only once those are positive
    _raise(user_data_problems(cfg))  # data formats, reward functions, evaluation


def validate_mesh(cfg: Config, num_devices: int) -> None:
    """Check that the mesh plus the scoring devices use exactly `num_devices` devices.

    The mesh (data × fsdp × tensor) holds actor generation and training; in disaggregated
    placement the scorers run on `mesh.scoring_devices` further devices outside it (the
    paper: 7 GPUs for generation and training, 1 for scoring).
    """
    m = cfg.mesh
    used = m.data * m.fsdp * m.tensor + m.scoring_devices
    if used != num_devices:
        raise ConfigError(
            f"mesh.data*mesh.fsdp*mesh.tensor={m.data}*{m.fsdp}*{m.tensor} plus "
            f"mesh.scoring_devices={m.scoring_devices} uses {used} devices, but {num_devices} "
            "are available; change the mesh so that they match"
        )


def devices_needed(cfg) -> int:
    """Devices the config's mesh and placement use (generation/training + scoring)."""
    m = cfg.mesh
    extra = m.scoring_devices if cfg.pipeline.placement == "disaggregated" else 0
    return m.data * m.fsdp * m.tensor + extra
