"""Supervised fine-tuning of the demo actor on the long-tailed demo corpus."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from oppo_jax.data.demo_task import DemoTaskSpec, sample_sft_corpus
from oppo_jax.demo.common import (
    demo_model_config,
    forward,
    join_batch,
    run_training,
    save_checkpoint,
    sequence_width,
    split_by_length,
)
from oppo_jax.models.model_config import ModelConfig


def response_target_mask(
    prompt_lens: Int[Array, " B"], total_lens: Int[Array, " B"], width: int
) -> Float[Array, "B W"]:
    """1.0 where the next-token target (token ``j + 1``) is a response token, incl. the eos.

    Example: prompt_lens [2], total_lens [4], width 5 (targets are tokens 1..4) -> [[0, 1, 1, 0]].
    """
    target_pos = jnp.arange(1, width)[None, :]
    inside = (target_pos >= prompt_lens[:, None]) & (target_pos < total_lens[:, None])
    return inside.astype(jnp.float32)


def _response_nll(cfg: ModelConfig, params, ids, prompt_lens, total_lens):
    """(summed response-token negative log-likelihood, number of response tokens) of one part."""
    logits = forward(cfg, params, ids[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    token_logp = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    mask = response_target_mask(prompt_lens, total_lens, ids.shape[1])
    return -jnp.sum(token_logp * mask), jnp.sum(mask)


def sft_loss(cfg: ModelConfig, params, parts: tuple) -> Float[Array, ""]:
    """Mean next-token cross-entropy over the batch's response tokens: -mean log p(y_t | x, y_<t).

    ``parts`` is the batch split by length into (ids[B_i, T_i], prompt_lens, total_lens) parts.
    """
    nll, count = zip(*(_response_nll(cfg, params, *part) for part in parts), strict=True)
    return sum(nll) / jnp.maximum(sum(count), 1.0)


def _sft_batches(spec: DemoTaskSpec, batch_size: int, rng: np.random.Generator) -> Iterator:
    """Fresh corpus samples every step (nothing repeats, so nothing overfits), split by length."""
    cap = sequence_width(spec)
    while True:
        corpus = sample_sft_corpus(spec, batch_size, rng)
        total = np.array([len(e.prompt) + len(e.response) for e in corpus])
        parts = []
        for idx, width in split_by_length(total, cap):
            rows = [corpus[i] for i in idx]
            parts.append(join_batch([e.prompt for e in rows], [e.response for e in rows], width))
        yield (tuple(parts),)


def train_sft(
    spec: DemoTaskSpec,
    out_dir: str | os.PathLike,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
    model_cfg: ModelConfig | None = None,
) -> dict:
    """Train the demo actor with SFT and save it as a Hugging Face Qwen2ForCausalLM directory.

    Args:
      spec: the demo task.
      out_dir: where the checkpoint and tokenizer are written.
      steps: optimiser steps; batch_size: sequences per step; lr: peak learning rate.
      seed: seeds the initial parameters and the sampled corpus.
      progress: show a progress bar with the loss.
      model_cfg: architecture (default ``demo_model_config(spec, "lm")``).
    Returns:
      {"initial_loss", "final_loss", "seconds"}: mean losses over the first / last 10% of the
      steps (at most 20), and the wall time including compilation and saving.
    """
    start = time.perf_counter()
    cfg = model_cfg or demo_model_config(spec, "lm")
    if cfg.head != "lm":
        raise ValueError(f"train_sft needs an lm-head model config; got head={cfg.head!r}")
    batches = _sft_batches(spec, batch_size, np.random.default_rng([seed, 1]))
    params, stats = run_training(cfg, sft_loss, batches, steps, lr, seed, "SFT actor", progress)
    save_checkpoint(params, cfg, spec, out_dir)
    return stats | {"seconds": time.perf_counter() - start}
