"""``load_hf_model``: a Hugging Face directory as a JAX model with ``.logits`` / ``.score``."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from oppo_jax.models.heads import apply_head, gather_rows
from oppo_jax.models.hf_io import CheckpointError, load_params, read_config
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.tokenizer import load_tokenizer
from oppo_jax.models.transformer import Transformer

# Public inputs may be NumPy or JAX integer arrays.
Ids = Int[Array | np.ndarray, "B T"]
# (parameter path, host array) -> the array where it belongs (see load_hf_model's placement)
PlaceFn = Callable[[tuple[str, ...], np.ndarray], Any]


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg: ModelConfig, params, input_ids):
    out, _ = Transformer(cfg).apply({"params": params}, input_ids)
    return out.astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _score_at(cfg: ModelConfig, params, input_ids, index):
    """The score head at one position per row only (not at every token)."""
    hidden, _ = Transformer(cfg).apply({"params": params}, input_ids, return_hidden=True)
    return apply_head(cfg, params, gather_rows(hidden, index[:, None]))[:, 0].astype(jnp.float32)


def last_valid_index(attention_mask: Int[Array, "B T"]) -> Int[Array, " B"]:
    """Index of each row's last valid token in a right-padded mask.

    Example: [[1, 1, 0], [1, 1, 1]] -> [1, 2]. A row with no valid token gives 0.
    """
    return jnp.maximum(jnp.sum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


@dataclasses.dataclass
class HFModel:
    """A loaded model: its architecture, parameter pytree, and tokenizer (if the folder has one)."""

    config: ModelConfig
    params: dict
    path: Path
    tokenizer: object | None = None

    def _check_inputs(self, input_ids, attention_mask):
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T]; got shape {input_ids.shape}")
        mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids {input_ids.shape}")
        if int(jnp.max(input_ids)) >= self.config.vocab_size or int(jnp.min(input_ids)) < 0:
            raise ValueError(f"input_ids outside the vocabulary [0, {self.config.vocab_size})")
        return input_ids, mask

    def logits(self, input_ids: Ids, attention_mask: Ids | None = None) -> Float[Array, "B T V"]:
        """Next-token logits (float32) for right-padded inputs; padded positions are arbitrary."""
        if self.config.head != "lm":
            raise ValueError(f"{self.path}: .logits needs a CausalLM; this is a score model")
        input_ids, _ = self._check_inputs(input_ids, attention_mask)
        return _forward(self.config, self.params, input_ids)

    def score(self, input_ids: Ids, attention_mask: Ids | None = None) -> Float[Array, " B"]:
        """Sequence score read at each row's last valid token (first label for num_labels > 1)."""
        if self.config.head != "score":
            raise ValueError(f"{self.path}: .score needs a SequenceClassification model")
        input_ids, mask = self._check_inputs(input_ids, attention_mask)
        return _score_at(self.config, self.params, input_ids, last_valid_index(mask))[:, 0]


def load_hf_model(
    path: str | os.PathLike,
    dtype: str = "float32",
    param_dtype: str | None = None,
    trust_remote_code: bool = False,
    placement: Callable[[ModelConfig], PlaceFn] | None = None,
) -> HFModel:
    """Load a local Qwen2/Llama CausalLM or SequenceClassification directory.

    Args:
      path: directory with config.json, model.safetensors (or a sharded index) and, optionally,
        tokenizer files.
      dtype: activation dtype, "float32" or "bfloat16".
      param_dtype: parameter dtype (default: same as dtype).
      trust_remote_code: passed to transformers; off by default.
      placement: given the model's config, a ``(param_path, array) -> array`` that puts each
        tensor straight onto its devices as it is read (e.g. its sharding over a mesh), so no
        device ever holds the whole model unless that is the target; None: the default device.
    Returns:
      An ``HFModel`` whose ``.logits(ids, mask)`` gives ``[B, T, V]`` and ``.score(ids, mask)``
      gives ``[B]``.
    """
    path = Path(path)
    cfg = read_config(path, dtype, param_dtype, trust_remote_code)
    params = load_params(path, cfg, place=None if placement is None else placement(cfg))
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = load_tokenizer(path, trust_remote_code)
        if len(tokenizer) > cfg.vocab_size:
            raise CheckpointError(
                f"{path}: tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                f"{cfg.vocab_size}"
            )
    return HFModel(config=cfg, params=params, path=path, tokenizer=tokenizer)


__all__ = ["HFModel", "last_valid_index", "load_hf_model"]
