"""Hugging Face checkpoints in and out: config.json + safetensors <-> ModelConfig + param pytree.

Only safetensors are read or written (never pickle), and ``trust_remote_code`` is off unless a
caller turns it on. Supported: Qwen2 and Llama, as *ForCausalLM (head "lm") and
*ForSequenceClassification (head "score").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import safe_open

from oppo_jax.base.errors import InputError
from oppo_jax.models.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from oppo_jax.models.transformer import init_params

# Tensors some checkpoints carry that the model recomputes; safe to ignore on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_HEAD_NAMES = ("lm_head", "score")


class CheckpointError(InputError):
    """A model directory that cannot be loaded; the message names the file and the problem."""


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", None):
        raise CheckpointError(f"rope scaling type {rope_type!r} is not supported (only default)")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def model_config_from_hf(hf_config, dtype: str = "float32", param_dtype: str | None = None):
    """Translate a transformers config object into a ModelConfig (head from `architectures`)."""
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise CheckpointError("sliding-window attention (use_sliding_window=true) is not supported")
    archs = getattr(hf_config, "architectures", None) or [f"{model_type}ForCausalLM"]
    head = "score" if archs[0].endswith("ForSequenceClassification") else "lm"
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rope_theta=_rope_theta(hf_config),
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        max_position_embeddings=hf_config.max_position_embeddings,
        head=head,
        num_labels=getattr(hf_config, "num_labels", 1) if head == "score" else 1,
        pad_token_id=getattr(hf_config, "pad_token_id", None),
        model_type=model_type,
        dtype=dtype,
        param_dtype=param_dtype or dtype,
    )


def read_config(
    path: str | os.PathLike, dtype="float32", param_dtype=None, trust_remote_code=False
):
    """Read ``path/config.json`` through transformers' AutoConfig (local files only)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    try:
        hf_config = AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as e:  # bad JSON, unknown model_type, remote code
        hint = "" if trust_remote_code else " (model.trust_remote_code is off)"
        raise CheckpointError(f"{path / 'config.json'}: {_first_line(e)}{hint}") from None
    return model_config_from_hf(hf_config, dtype, param_dtype)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def hf_names(path: tuple[str, ...], num_layers: int) -> tuple[list[str], bool]:
    """Our parameter path -> (the Hugging Face tensor names it holds, whether each is transposed).

    The blocks' parameters are stacked on a leading layer axis (the model scans over layers),
    so a path under "layers" holds one tensor per layer, in layer order.

    Examples:
      ("layers", "mlp", "up_proj", "kernel"), 2 layers ->
        (["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"], True)
      ("norm", "scale") -> (["model.norm.weight"], False)
    """
    parts = list(path)
    leaf = parts[-1]
    parts[-1] = "bias" if leaf == "bias" else "weight"
    prefix = [] if parts[0] in _HEAD_NAMES else ["model"]
    if parts[0] != "layers":
        return [".".join(prefix + parts)], leaf == "kernel"
    rest = ".".join(parts[1:])
    return [".".join(prefix + [f"layers.{i}", rest]) for i in range(num_layers)], leaf == "kernel"


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise CheckpointError(
            f"{path}: only pickle weights (*.bin/*.pt) found; convert to safetensors"
        )
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _read_tensors(files: dict[str, Path], names: list[str]) -> dict[str, np.ndarray]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for fname, group in by_file.items():
        if not fname.is_file():
            raise CheckpointError(f"{fname}: listed in the index but missing")
        with safe_open(fname, framework="numpy") as f:
            for name in group:
                out[name] = f.get_tensor(name)
    return out


def load_params(
    path: str | os.PathLike,
    cfg: ModelConfig,
    fresh_head_key: jax.Array | None = None,
    place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None,
):
    """Read the safetensors weights of ``path`` into our parameter pytree for ``cfg``.

    Args:
      path: a Hugging Face model directory.
      cfg: the architecture to fill (its ``head`` decides whether lm_head or score is read).
      fresh_head_key: if given, a head absent from the checkpoint (e.g. a critic started from a
        CausalLM) is initialised randomly instead of being an error.
      place: optional ``(param_path, array) -> array`` that puts each tensor on its devices.
    Returns:
      The parameter pytree (same structure as ``init_params(cfg)``).
    """
    path = Path(path)
    files = _tensor_files(path)
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    leaves = [
        (tuple(k.key for k in kp), spec)
        for kp, spec in jax.tree_util.tree_flatten_with_path(abstract)[0]
    ]
    wanted = {key: hf_names(key, cfg.num_layers) for key, _ in leaves}
    known = [n for names, _ in wanted.values() for n in names]
    known_set = set(known)
    missing = [n for n in known if n not in files]
    fresh = None
    if (
        missing
        and fresh_head_key is not None
        and all(m.split(".")[0] in _HEAD_NAMES for m in missing)
    ):
        fresh = init_params(cfg, fresh_head_key)
    elif missing:
        raise CheckpointError(
            f"{path}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    ignorable = lambda n: n.endswith(_IGNORED_SUFFIXES) or n.split(".")[0] in _HEAD_NAMES  # noqa: E731
    extra = [n for n in files if n not in known_set and not ignorable(n)]
    if extra:
        raise CheckpointError(f"{path}: unexpected tensors {extra[:8]} (architecture mismatch?)")
    tensors = _read_tensors(files, [n for n in known if n in files])
    flat = {}
    for key, spec in leaves:
        names, transposed = wanted[key]
        if names[0] not in tensors:  # a fresh head (heads are never stacked)
            value = np.asarray(_get(fresh, key))
        else:
            stacked = key[0] == "layers"
            shape = spec.shape[1:] if stacked else spec.shape
            parts = [_oriented(path, n, tensors[n], transposed, shape) for n in names]
            value = np.stack(parts) if stacked else parts[0]
        value = value.astype(spec.dtype)
        flat[key] = place(key, value) if place else jax.numpy.asarray(value)
    return _unflatten(flat)


def _oriented(path: Path, name: str, tensor: np.ndarray, transposed: bool, shape: tuple):
    """A checkpoint tensor in our orientation, checked against our (per-layer) shape."""
    value = tensor.T if transposed else tensor
    if value.shape != tuple(shape):
        raise CheckpointError(
            f"{path}: tensor {name} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(shape)[::-1] if transposed else tuple(shape)}"
        )
    return value


def _get(tree, key):
    for k in key:
        tree = tree[k]
    return tree


def _unflatten(flat: dict[tuple[str, ...], Any]) -> dict:
    root: dict = {}
    for key, value in flat.items():
        node = root
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = value
    return root
