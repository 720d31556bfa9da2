"""Run configuration: frozen typed dataclasses (the schema), YAML values and `--set` overrides.

YAML files hold values only. They are merged over the dataclass defaults with OmegaConf
structured configs, so an unknown key, a wrong type or a bad value is a `ConfigError` that
names the key. The YAML files live in the top-level `configs/` directory beside the package;
`load_config(None)` reads `configs/demo_cpu.yaml` from there (a source or editable install).
Defaults follow TRL's PPO trainer where TRL has the knob. No jax here: a config is loaded and
checked before anything compiles.
"""

import ast
import dataclasses
import difflib
import functools
import inspect
import os
import re
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from oppo_jax.config_validate import (
    ConfigError,
    devices_needed,
    type_name,
    validate,
    validate_mesh,
)

__all__ = [
    "CONFIG_DIR", "DEFAULT_CONFIG", "STABLE_KEYS", "Config", "ConfigError", "DataConfig",
    "MeshConfig", "ModelConfig", "OptimConfig", "PipelineConfig", "PPOConfig", "RolloutConfig",
    "TrainConfig", "config_keys_doc", "devices_needed", "load_config", "to_dict", "to_yaml",
    "validate", "validate_mesh",
]  # fmt: skip

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "demo_cpu.yaml"
# Keys promised to users (DESIGN §7): documented and kept across versions.
STABLE_KEYS = (
    "seed", "train.steps", "rollout.batch_size", "pipeline.mode", "pipeline.chunk_size",
    "pipeline.overcommit", "pipeline.adaptive_overcommit", "pipeline.placement",
)  # fmt: skip
# Plain exceptions OmegaConf raises for some malformed inputs (e.g. a list index in a key).
_PLAIN_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError)


@dataclass(frozen=True)
class ModelConfig:
    """Where the actor, reference, critic and reward model start from, and their numerics."""

    # actor and reference weights: a local Hugging Face directory, or "demo" (built-in assets)
    actor_path: str = "demo"
    # reward-model weights: a local Hugging Face directory, or "demo" (built-in assets)
    reward_path: str = "demo"
    critic_init: str = "reward"  # checkpoint the critic's backbone starts from: reward | actor
    # built-in architecture (e.g. qwen2.5-3b, qwen2.5-7b) for abstract shape checks; None = off
    preset: str | None = None
    dtype: str = "float32"  # activation dtype: float32 | bfloat16
    param_dtype: str = "float32"  # parameter dtype: float32 | bfloat16
    trust_remote_code: bool = False  # let transformers run code shipped inside a checkpoint


@dataclass(frozen=True)
class RolloutConfig:
    """What the actor generates each step."""

    batch_size: int = 16  # B, completed sequences per PPO update
    max_prompt_len: int = 16  # longest prompt, tokens
    max_response_len: int = 64  # longest response, tokens (a response without EOS ends here)
    temperature: float = 0.7  # sampling temperature; log-probs use logits / temperature too
    top_k: int = 0  # sample only among the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling: smallest token set with this probability mass
    greedy: bool = False  # take the most likely token instead of sampling
    prompt_too_long: str = "truncate"  # prompts over max_prompt_len: truncate | reject (error)


@dataclass(frozen=True)
class PPOConfig:
    """Rewards, advantages and the clipped PPO losses (TRL's numerics)."""

    kl_coef: float = 0.05  # β, weight of the per-token KL penalty (initial β if adaptive_kl)
    kl_estimator: str = "k1"  # per-token KL estimate of log π/π_ref: k1 | k2 | k3
    kl_in_reward: bool = True  # penalise KL in the per-token reward; False: add it to the loss
    adaptive_kl: bool = False  # steer β toward target_kl (Ziegler et al. controller)
    target_kl: float = 6.0  # KL the adaptive controller aims for, nats per sequence
    kl_horizon: int = 10000  # horizon of the adaptive KL controller, sequences
    cliprange: float = 0.2  # ε, clip range of the policy ratio
    cliprange_value: float = 0.2  # ε_v, clip range of values around the old values, reward units
    vf_coef: float = 0.1  # weight of the value loss in the total loss
    entropy_coef: float = 0.0  # weight of the entropy bonus (0 = off)
    gamma: float = 1.0  # discount per token
    lam: float = 0.95  # λ of generalised advantage estimation
    ppo_epochs: int = 4  # passes over each batch of B sequences
    num_minibatches: int = 1  # optimizer updates per epoch
    grad_accum_steps: int = 1  # microbatches whose gradients are summed per update
    whiten_rewards: bool = False  # whiten per-token rewards over valid tokens before GAE
    # subtracted from the score of responses without EOS, reward units; None = off (TRL)
    missing_eos_penalty: float | None = None
    loss_agg: str = "token_mean"  # loss average: token_mean (all valid tokens) | seq_mean
    # weight carried (stale) tokens by a truncated ratio π_old / π_behaviour (decoupled PPO)
    importance_correction: bool = False
    importance_clip: float = 2.0  # upper truncation of that importance weight


@dataclass(frozen=True)
class OptimConfig:
    """AdamW for the actor and the critic."""

    actor_lr: float = 1e-6  # peak learning rate of the actor, per optimizer update
    critic_lr: float = 1e-5  # peak learning rate of the critic, per optimizer update
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay, per update
    max_grad_norm: float = 1.0  # clip each model's global gradient norm to this
    warmup_steps: int = 0  # linear learning-rate warm-up, optimizer updates
    schedule: str = "constant"  # learning rate after warm-up: constant | cosine | linear decay
    adam_b1: float = 0.9  # Adam β1, decay of the first moment
    adam_b2: float = 0.999  # Adam β2, decay of the second moment
    adam_eps: float = 1e-8  # Adam ε, added to the root of the second moment


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh of actor generation and training; scorers may sit on devices outside it."""

    data: int = 1  # data-parallel axis, devices (batch sharded, parameters replicated)
    fsdp: int = 1  # fully-sharded axis, devices (batch and parameters sharded)
    tensor: int = 1  # tensor-parallel axis, devices (heads and hidden units sharded)
    scoring_devices: int = 0  # extra devices for the scorers when placement is disaggregated
    multihost: bool = False  # call jax.distributed.initialize() (GPU clusters, TPU pods)


@dataclass(frozen=True)
class PipelineConfig:
    """The scheduler: sync baseline or OPPO's intra- and inter-step overlap."""

    mode: str = "oppo"  # scheduler: sync (generate, then score; ignores overcommit) | oppo
    chunk_size: int = 16  # C, tokens decoded per streamed chunk
    # chunk sizes the online tuner tries, tokens
    chunk_candidates: list[int] = field(default_factory=lambda: [8, 16, 32])
    chunk_tuning: bool = False  # tune chunk_size online by measured step time
    chunk_tuning_every: int = 50  # steps between two tuning rounds
    overcommit: int = 0  # Δ, extra prompts started per step (start value if adaptive); 0 = off
    adaptive_overcommit: bool = False  # raise Δ while mean reward rises, else lower it
    overcommit_min: int = 0  # Δ_min, lower clamp of adaptive Δ, prompts
    overcommit_max: int = 8  # Δ_max, upper clamp of adaptive Δ, prompts
    overcommit_window: int = 3  # w, steps averaged in the reward trend
    max_deferrals: int = 2  # steps a sequence may be carried before it must finish
    # device roles: colocated (all share the mesh) | disaggregated (scorers on own devices)
    placement: str = "colocated"


@dataclass(frozen=True)
class TrainConfig:
    """Length of the run, checkpoints and logging."""

    steps: int = 100  # PPO steps, each one update on B sequences
    checkpoint_every: int = 25  # steps between checkpoints; 0 = none
    max_to_keep: int = 3  # checkpoints kept on disk
    log_every: int = 1  # steps between metric records
    sft_steps: int = 3000  # optimizer updates of `oppo-jax sft` (supervised actor)
    rm_steps: int = 500  # optimizer updates of `oppo-jax rm` (reward model)
    max_nonfinite_in_a_row: int = 3  # skipped non-finite updates in a row before the run stops


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from."""

    prompts: str = "demo"  # prompt file (JSONL or parquet), or "demo" (the built-in task)
    prompt_field: str = "prompt"  # field of each record that holds the prompt text


@dataclass(frozen=True)
class Config:
    """A whole run; `load_config` builds one, `validate` checks one built by hand."""

    seed: int = 0  # root of every random stream (initialisation, sampling, data order)
    model: ModelConfig = field(default_factory=ModelConfig)  # checkpoints and dtypes
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation
    ppo: PPOConfig = field(default_factory=PPOConfig)  # PPO objective and hyper-parameters
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizers
    mesh: MeshConfig = field(default_factory=MeshConfig)  # devices
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # scheduling
    train: TrainConfig = field(default_factory=TrainConfig)  # run length and checkpoints
    data: DataConfig = field(default_factory=DataConfig)  # prompts


# ---------------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a run configuration: dataclass defaults <- YAML file <- `key=value` overrides.

    Args:
      path: a YAML file; a bare name such as "qwen2.5-7b_gh200x4" is also looked up in
        `configs/`; None reads `configs/demo_cpu.yaml`.
      overrides: dotted `key=value` items (the command line's `--set`), applied in order;
        values are parsed as YAML and converted to the field's type.

    Returns:
      A frozen, validated `Config`.

    Raises:
      ConfigError: missing or malformed file, unknown key, wrong type or bad value.
    """
    file = _resolve(path)
    merged = _merge(_schema(), _read_yaml(file), str(file))
    for item in overrides:
        merged = _merge(merged, _parse_override(item), f"--set {item}")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.full_key}: {_first_line(e)}") from None
    except _PLAIN_ERRORS as e:
        raise ConfigError(f"config: {_first_line(e)}") from None
    validate(cfg)
    return cfg


@functools.cache
def _schema() -> DictConfig:
    """The structured config of the defaults, built once (merge copies it, never mutates it)."""
    return OmegaConf.structured(Config)


def _resolve(path: str | os.PathLike | None) -> Path:
    if path is None:
        if not DEFAULT_CONFIG.is_file():
            raise ConfigError(
                f"{DEFAULT_CONFIG}: default config not found (it ships with the source tree); "
                "pass a config path"
            )
        return DEFAULT_CONFIG
    file = Path(path)
    if not file.exists() and file.parent == Path("."):
        for candidate in (CONFIG_DIR / file, CONFIG_DIR / f"{file}.yaml"):
            if candidate.is_file():
                return candidate
    return file


def _read_yaml(file: Path) -> DictConfig:
    """The file's values, read with OmegaConf's safe YAML loader (no Python object tags)."""
    try:
        raw = OmegaConf.load(file)
    except FileNotFoundError:
        raise ConfigError(f"{file}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot read the config file ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not a UTF-8 text file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: {_yaml_problem(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{file}: {_first_line(e)}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{file}: the top level must be a mapping of sections, not a list")
    return raw


def _parse_override(item: str) -> DictConfig:
    key, sep, _ = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. rollout.batch_size=32")
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item}: bad YAML value: {_yaml_problem(e, False)}") from None
    except (OmegaConfBaseException, *_PLAIN_ERRORS) as e:
        raise ConfigError(f"--set {item}: {_first_line(e)}") from None


def _merge(base: DictConfig, update: DictConfig, origin: str) -> DictConfig:
    """OmegaConf's merge, with its errors restated as `origin: key=value: problem`."""
    try:
        return OmegaConf.merge(base, update)
    except OmegaConfBaseException as e:
        key = e.full_key
        if not key:
            raise ConfigError(f"{origin}: {_first_line(e)}") from None
        if origin.startswith("--set"):  # the override itself shows key and value
            where = origin
        else:
            value = _lookup(OmegaConf.to_container(update, resolve=False), key)
            where = f"{origin}: {key}={value!r}"
        if isinstance(e, ConfigKeyError):
            named = "" if f"{key}=" in where else f" {key}"
            raise ConfigError(f"{where}: unknown key{named}{_suggest(key)}") from None
        raise ConfigError(f"{where}: {_first_line(e)}") from None
    except _PLAIN_ERRORS as e:  # some OmegaConf merge paths raise these undecorated
        raise ConfigError(f"{origin}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    """OmegaConf's message without the full_key/object_type trailer lines."""
    return (getattr(e, "msg", None) or str(e) or type(e).__name__).splitlines()[0]


def _yaml_problem(e: yaml.YAMLError, with_mark: bool = True) -> str:
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    tag = re.search(r"constructor for the tag '([^']*)'", problem)
    if tag:  # e.g. !!python/object/apply: the safe loader builds plain values only
        problem = f"YAML tag {tag.group(1)!r} is not allowed (configs hold plain values only)"
    mark = getattr(e, "problem_mark", None)
    if with_mark and mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem


def _lookup(tree: Any, key: str) -> Any:
    """The raw value at a dotted key such as `a.b[0]` (None when it is not there)."""
    for part in re.findall(r"[^.\[\]]+", key):
        try:
            tree = tree[int(part)] if isinstance(tree, list) else tree[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return tree


def _suggest(key: str) -> str:
    """'; did you mean ...' with the nearest known dotted key or section name."""
    known = [k for k, *_ in _leaves(Config)] + [f.name for f in dataclasses.fields(Config)]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


# ---------------------------------------------------------------------------------- writing


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of `cfg` (for JSON metrics headers and the run directory)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """YAML text of the resolved config; `load_config` of it gives back an equal `Config`."""
    return OmegaConf.to_yaml(OmegaConf.create(_escape(to_dict(cfg))))


def _escape(tree: Any) -> Any:
    """Escape `${` in strings, so that a literal `${x}` is not read back as an interpolation."""
    if isinstance(tree, str):  # OmegaConf: \${ is a literal ${, and \\ before ${ one backslash
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", tree)
    if isinstance(tree, dict):
        return {k: _escape(v) for k, v in tree.items()}
    return [_escape(v) for v in tree] if isinstance(tree, list) else tree


# ---------------------------------------------------------------------------- documentation


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, comment) of every leaf field, in declaration order."""
    out = []
    hints, comments = typing.get_type_hints(cls), _field_comments().get(cls.__name__, {})
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _leaves(hint, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out.append((prefix + f.name, hint, default, comments.get(f.name, "")))
    return out


@functools.cache
def _field_comments() -> dict[str, dict[str, str]]:
    """Comment of each dataclass field in this file: trailing, else on the line just above."""
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    out: dict[str, dict[str, str]] = {}
    for cls in [n for n in ast.parse("\n".join(lines)).body if isinstance(n, ast.ClassDef)]:
        for stmt in [s for s in cls.body if isinstance(s, ast.AnnAssign)]:
            code, above = lines[stmt.end_lineno - 1], lines[stmt.lineno - 2].strip()
            own_line = above.partition("#")[2] if above.startswith("#") else ""
            text = code.split("  # ", 1)[1] if "  # " in code else own_line
            out.setdefault(cls.name, {})[ast.unparse(stmt.target)] = text.strip()
    return out


def _yaml_value(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return yaml.safe_dump(value, default_flow_style=True).splitlines()[0]


def config_keys_doc() -> str:
    """Markdown table of every dotted key: type, default and meaning (from the field comments)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, hint, default, comment in _leaves(Config):
        meaning = comment + (" (stable key)" if key in STABLE_KEYS else "")
        cells = (f"`{key}`", f"`{type_name(hint)}`", f"`{_yaml_value(default)}`", meaning)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
