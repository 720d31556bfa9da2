"""Loading a run configuration: dataclass defaults <- YAML file <- ``--set`` overrides.

YAML files hold values only. They are merged over the dataclass defaults with OmegaConf
structured configs, so an unknown key, a wrong type or a bad value is a ``ConfigError`` that
names the key. The YAML files live in the top-level ``configs/`` directory beside the package;
``load_config(None)`` reads ``configs/demo_cpu.yaml`` from there (a source or editable install).
"""

import dataclasses
import difflib
import functools
import os
import re
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from oppo_jax.base.errors import ConfigError
from oppo_jax.config.docs import leaves
from oppo_jax.config.schema import Config
from oppo_jax.config.validate import validate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "demo_cpu.yaml"
# Plain exceptions OmegaConf raises for some malformed inputs (e.g. a list index in a key).
_PLAIN_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError)


def _tis_or_none(on: Any) -> str:
    if not isinstance(on, bool):
        raise ConfigError(f"ppo.importance_correction={on!r}: expected bool")
    return "tis" if on else "none"


# Renamed keys: old dotted key -> (new key, the new key's value for the old one's). A file or
# override naming the old key still loads (with a FutureWarning), and so does a run directory's
# config.yaml written before the rename (``run.log.config_differences`` reads it through this).
RENAMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "ppo.importance_correction": ("ppo.off_policy_correction", _tis_or_none),
    "pipeline.max_deferrals": ("rollout.max_staleness", lambda deferrals: deferrals),
}


def migrate_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (dotted keys) with each ``RENAMED`` key under its new name and value.

    Example: {"ppo.importance_correction": True} -> {"ppo.off_policy_correction": "tis"}.
    """
    out = dict(flat)
    for old, (new, convert) in RENAMED.items():
        if old in out:
            value = out.pop(old)
            if new in flat:
                raise ConfigError(f"{old} and {new} both given: {old} is now {new}; keep {new}")
            out[new] = convert(value)
    return out


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
    merged = _merge(_schema(), _renamed(_read_yaml(file), str(file)), str(file))
    for item in overrides:
        merged = _merge(merged, _renamed(_parse_override(item), f"--set {item}"), f"--set {item}")
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


def _renamed(update: DictConfig, origin: str) -> DictConfig:
    """``update`` with its ``RENAMED`` keys moved to their new names, each with a warning."""
    tree = OmegaConf.to_container(update, resolve=False)
    flat = {}
    for old in RENAMED:
        section, _, name = old.rpartition(".")
        if isinstance(parent := tree.get(section), dict) and name in parent:
            flat[old] = parent.pop(name)
    if not flat:
        return update
    for old, (new, _) in RENAMED.items():
        section, _, name = new.rpartition(".")
        if old in flat and name in (tree.get(section) or {}):
            flat[new] = tree[section][name]  # both given: migrate_flat refuses
    for key, value in migrate_flat(flat).items():
        section, _, name = key.rpartition(".")
        tree.setdefault(section, {})[name] = value
        old = next(o for o, (n, _) in RENAMED.items() if n == key)
        warnings.warn(f"{origin}: {old} is now {key}; read as {key}={value!r}", FutureWarning, 3)
    return OmegaConf.create(tree)


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
        raise ConfigError(f"{file}: config file not found; {_shipped()}") from None
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


def _shipped() -> str:
    """The config names a bare name may give (the YAML files in configs/)."""
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    if not names:
        return f"give a YAML path ({CONFIG_DIR} holds no config)"
    return f"give a YAML path or one of the names in {CONFIG_DIR}: {', '.join(names)}"


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
    _check_lists(update, origin)
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


def _check_lists(update: DictConfig, origin: str) -> None:
    """A list key given one value (``--set reward.functions=pkg.mod:fn``) is an error that
    names the key and the list it takes; a single value is not taken as a one-element list,
    and OmegaConf's own message names its internals (AnyNode, ListConfig)."""
    tree = OmegaConf.to_container(update, resolve=False)
    for key in _list_keys():
        section, _, name = key.rpartition(".")
        parent = _lookup(tree, section)
        if not isinstance(parent, dict) or name not in parent:
            continue
        value = parent[name]
        if isinstance(value, list) or (isinstance(value, str) and "${" in value):
            continue
        item = "..." if value is None or isinstance(value, dict) else value
        if origin.startswith("--set"):
            where, example = origin, f"--set '{key}=[{item}]'"
        else:
            where, example = f"{origin}: {key}={value!r}", f"{name}: [{item}]"
        raise ConfigError(f"{where}: {key} takes a list, e.g. {example}")


@functools.cache
def _list_keys() -> tuple[str, ...]:
    """The dotted keys whose type is a list."""
    return tuple(k for k, hint, *_ in leaves(Config) if typing.get_origin(hint) is list)


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
    known = [k for k, *_ in leaves(Config)] + [f.name for f in dataclasses.fields(Config)]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


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
