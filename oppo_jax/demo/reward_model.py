"""Bradley–Terry training of the demo reward model on gold-labelled preference pairs."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from oppo_jax.data.demo_task import (
    DemoTaskSpec,
    gold_score,
    sample_preference_pairs,
    sample_sft_corpus,
)
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

# Held-out evaluation sizes: enough that accuracy/correlation are known to about ±0.02.
_EVAL_PAIRS = 512
_EVAL_SAMPLES = 512
_EVAL_BATCH = 256
_LONG_PAIR_FRACTION = 0.375  # share of a batch's pairs padded to the full width


def sequence_scores(
    cfg: ModelConfig, params, ids: Int[Array, "B T"], total_lens: Int[Array, " B"]
) -> Float[Array, " B"]:
    """Score head read at each row's last valid token (the response's eos)."""
    per_token = forward(cfg, params, ids)[..., 0]
    last = jnp.maximum(total_lens - 1, 0)
    return jnp.take_along_axis(per_token, last[:, None], axis=1)[:, 0]


def bradley_terry_loss(cfg: ModelConfig, params, parts: tuple) -> Float[Array, ""]:
    """Mean over pairs of -log σ(r_chosen - r_rejected).

    ``parts`` is the batch of pairs split by length into (ids[2P_i, T_i], total_lens[2P_i])
    parts, each holding its pairs' chosen rows first, then their rejected rows.
    """
    losses = []
    for ids, total_lens in parts:
        chosen, rejected = jnp.split(sequence_scores(cfg, params, ids, total_lens), 2)
        losses.append(jax.nn.softplus(rejected - chosen))  # softplus(-x) = -log σ(x)
    return jnp.mean(jnp.concatenate(losses))


def _pair_rows(spec: DemoTaskSpec, pairs, width: int | None = None) -> tuple[np.ndarray, ...]:
    """Pairs as one padded batch: chosen rows first, then rejected rows."""
    prompts = [p.prompt for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    ids, _, total = join_batch(prompts, responses, width or sequence_width(spec))
    return ids, total


def _pair_batches(spec: DemoTaskSpec, batch_size: int, rng: np.random.Generator) -> Iterator:
    """Fresh preference pairs for every step, split by the longer sequence of each pair."""
    cap = sequence_width(spec)
    while True:
        pairs = sample_preference_pairs(spec, batch_size, rng)
        longest = np.array([len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs])
        # A pair is as long as its longer sequence, so more pairs than rows are long.
        parts = split_by_length(longest, cap, long_fraction=_LONG_PAIR_FRACTION)
        yield (tuple(_pair_rows(spec, [pairs[i] for i in idx], width) for idx, width in parts),)


_scores = jax.jit(sequence_scores, static_argnums=0)


def score_rows(cfg: ModelConfig, params, ids: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Scores of many padded rows, in batches of one fixed shape (one compile)."""
    n = len(ids)
    pad = -n % _EVAL_BATCH
    ids, total = np.pad(ids, ((0, pad), (0, 0))), np.pad(total, (0, pad), constant_values=1)
    out = [
        np.asarray(_scores(cfg, params, ids[i : i + _EVAL_BATCH], total[i : i + _EVAL_BATCH]))
        for i in range(0, len(ids), _EVAL_BATCH)
    ]
    return np.concatenate(out)[:n]


def evaluate_reward_model(
    cfg: ModelConfig, params, spec: DemoTaskSpec, rng: np.random.Generator
) -> dict:
    """Held-out pair accuracy and Pearson correlation of the RM score with the gold score."""
    pairs = sample_preference_pairs(spec, _EVAL_PAIRS, rng)
    scores = score_rows(cfg, params, *_pair_rows(spec, pairs))
    chosen, rejected = np.split(scores, 2)
    corpus = sample_sft_corpus(spec, _EVAL_SAMPLES, rng)
    ids, _, total = join_batch(
        [e.prompt for e in corpus], [e.response for e in corpus], sequence_width(spec)
    )
    rm = score_rows(cfg, params, ids, total)
    gold = np.array([gold_score(e.response, spec) for e in corpus])
    return {
        "pair_accuracy": float(np.mean(chosen > rejected)),
        "gold_corr": float(np.corrcoef(rm, gold)[0, 1]),
    }


def train_reward_model(
    spec: DemoTaskSpec,
    out_dir: str | os.PathLike,
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
    model_cfg: ModelConfig | None = None,
) -> dict:
    """Train the demo reward model and save it as a Qwen2ForSequenceClassification directory.

    Args:
      spec: the demo task.
      out_dir: where the checkpoint and tokenizer are written.
      steps: optimiser steps; batch_size: preference pairs per step; lr: peak learning rate.
      seed: seeds the initial parameters, the training pairs and the held-out data.
      progress: show a progress bar with the loss.
      model_cfg: architecture (default ``demo_model_config(spec, "score")``).
    Returns:
      {"initial_loss", "final_loss", "pair_accuracy", "gold_corr" (held-out), "seconds"}.
    """
    start = time.perf_counter()
    cfg = model_cfg or demo_model_config(spec, "score")
    if cfg.head != "score" or cfg.num_labels != 1:
        raise ValueError("train_reward_model needs a score-head model config with num_labels=1")
    batches = _pair_batches(spec, batch_size, np.random.default_rng([seed, 2]))
    params, stats = run_training(
        cfg, bradley_terry_loss, batches, steps, lr, seed, "reward model", progress
    )
    # A separate stream from training, so the evaluation data is held out.
    stats |= evaluate_reward_model(cfg, params, spec, np.random.default_rng([seed, 3]))
    save_checkpoint(params, cfg, spec, out_dir)
    return stats | {"seconds": time.perf_counter() - start}
