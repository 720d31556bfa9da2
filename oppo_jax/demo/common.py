"""Shared pieces of the demo trainers: model shape, optimiser, train loop, checkpoint writing."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int
from tqdm.auto import tqdm

from oppo_jax.data.demo_task import BOS_ID, EOS_ID, PAD_ID, WordTask, pad_batch, save_tokenizer
from oppo_jax.models.hf_export import export_hf, hf_config_for
from oppo_jax.models.model_config import HeadKind, ModelConfig
from oppo_jax.models.transformer import Transformer, init_params

# initial_loss / final_loss average this fraction of the steps (at most 20 steps each).
_LOSS_WINDOW = 0.1
SHORT_WIDTH = 32  # pad width of a batch's short part, in tokens, when its rows fit


def demo_model_config(
    spec: WordTask,
    head: HeadKind = "lm",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
) -> ModelConfig:
    """A tiny Qwen2-layout decoder over the demo vocabulary (``head="score"`` for the RM);
    ``max_position_embeddings`` is the context a run may use (prompt + response), tokens."""
    return ModelConfig(
        vocab_size=spec.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        qkv_bias=True,
        max_position_embeddings=max_position_embeddings,
        head=head,
        num_labels=1,
        pad_token_id=PAD_ID,
        model_type="qwen2",
    )


def sequence_width(spec: WordTask) -> int:
    """Longest prompt + response in tokens."""
    return spec.max_prompt_len + spec.max_response_len


def split_by_length(
    lengths: Int[np.ndarray, " B"], cap: int, long_fraction: float = 0.25
) -> list[tuple[np.ndarray, int]]:
    """Split a batch into its shortest rows and its ``long_fraction`` longest: [(rows, width)].

    A long-tailed batch padded whole is as wide as its longest row; padding the short part
    separately (almost always to ``SHORT_WIDTH``) roughly halves the work. The batch itself
    stays a random mix of lengths: with whole batches grouped by length (cheaper still) the
    actor was slower to learn that responses opened by a long-marker word stop later. Each part
    has at most two widths, so there are few compilations.

    Example: lengths [40, 5, 7, 9], cap 74 -> [([1, 2, 3], 32), ([0], 74)].
    """
    order = np.argsort(lengths, kind="stable")
    n_short = len(order) - max(1, round(len(order) * long_fraction))
    short, long = order[:n_short], order[n_short:]
    short_width = SHORT_WIDTH if lengths[short].max() <= SHORT_WIDTH else cap
    return [(short, short_width), (long, cap)]


def join_batch(
    prompts: list[np.ndarray], responses: list[np.ndarray], width: int
) -> tuple[Int[np.ndarray, "B T"], Int[np.ndarray, " B"], Int[np.ndarray, " B"]]:
    """Concatenate prompt and response rows and right-pad: (ids, prompt_lens, total_lens)."""
    seqs = [np.concatenate([p, r]) for p, r in zip(prompts, responses, strict=True)]
    ids, total = pad_batch(seqs, PAD_ID, width)
    prompt_lens = np.array([len(p) for p in prompts], np.int32)
    return ids, prompt_lens, total


def forward(cfg: ModelConfig, params, ids: Int[Array, "B T"]) -> Float[Array, "B T O"]:
    """Full causal forward pass, head output in float32."""
    out, _ = Transformer(cfg).apply({"params": params}, ids)
    return out.astype(jnp.float32)


def lr_schedule(lr: float, steps: int) -> optax.Schedule:
    """Linear warmup (10% of the steps, at most 100) to ``lr``, then cosine decay to 5% of it."""
    warmup = max(1, min(100, steps // 10))
    return optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.05
    )


def _adamw(learning_rate):
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.01)
    )


# The learning rate is a state entry set on every step, not a closure over a schedule, so one
# compiled train step serves every run of a model (the test suite trains several).
OPTIMIZER = optax.inject_hyperparams(_adamw)(learning_rate=0.0)


# Jitted: one compilation instead of many small eager ones (seconds on a busy CPU).
_init_params = jax.jit(init_params, static_argnums=0)


@flax.struct.dataclass
class TrainState:
    """Parameters and optimiser state, replaced whole by each train step."""

    params: Any  # parameter pytree
    opt_state: Any  # OPTIMIZER's state for ``params``


@functools.cache
def train_step_for(loss_fn: Callable, cfg: ModelConfig):
    """Jitted ``(state, lr, *batch) -> (state, loss)`` for ``loss_fn(cfg, params, *batch)``.

    Cached per (loss, model) so that repeated trainings reuse their compilations.
    """

    def step(state: TrainState, lr: Float[Array, ""], *batch):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(cfg, state.params, *batch)
        opt_state = state.opt_state
        opt_state.hyperparams["learning_rate"] = lr  # a fresh copy inside the trace
        updates, opt_state = OPTIMIZER.update(grads, opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=(0,))


def loss_window(steps: int) -> int:
    """Steps averaged in ``initial_loss`` and ``final_loss``: 10% of them, 1 to 20."""
    return max(1, min(20, int(steps * _LOSS_WINDOW)))


def summary_lines(what: str, out: str | os.PathLike, steps: int, stats: dict) -> list[str]:
    """What ``oppo-jax sft`` / ``oppo-jax rm`` print at the end: what was trained, for how long,
    where it went, its loss and (the reward model) its held-out accuracy.

    Example: ["SFT actor: 3000 steps in 95.2 s (compilation and saving included)",
    "  saved to /c/actor (Hugging Face format)", "  loss 5.51 -> 3.73 (means of the
    first and last 20 steps)"].
    """
    window = loss_window(steps)
    over = "first and last step" if window == 1 else f"means of the first and last {window} steps"
    lines = [
        f"{what}: {steps} steps in {stats['seconds']:.1f} s (compilation and saving included)",
        f"  saved to {out} (Hugging Face format)",
        f"  loss {stats['initial_loss']:.4g} -> {stats['final_loss']:.4g} ({over})",
    ]
    if "pair_accuracy" in stats:
        lines.append(
            f"  held out: picks the preferred response of {stats['pair_accuracy']:.1%} of pairs; "
            f"correlation with the gold score {stats['gold_corr']:.3f}"
        )
    return lines


def run_training(
    cfg: ModelConfig,
    loss_fn: Callable,
    batches: Iterator[tuple],
    steps: int,
    lr: float,
    seed: int,
    desc: str,
    progress: bool,
) -> tuple[Any, dict]:
    """Train fresh parameters for ``steps`` steps over ``batches``; return (params, losses).

    ``losses`` is {"initial_loss", "final_loss"}: means over the first / last ``loss_window``.
    """
    params = _init_params(cfg, jax.random.key(seed))
    state = TrainState(params, OPTIMIZER.init(params))
    train_step, schedule = train_step_for(loss_fn, cfg), lr_schedule(lr, steps)
    losses = []
    bar = tqdm(total=steps, desc=desc, disable=not progress, mininterval=1.0)
    for i in range(steps):
        # The next batch is sampled on the host while the previous step runs on the device.
        state, loss = train_step(state, np.float32(schedule(i)), *next(batches))
        losses.append(loss)
        if i == 0:  # the first step compiles: restart the bar's clock so its ETA leaves it out
            jax.block_until_ready(loss)
            bar.reset()
        bar.update(1)
        if progress and (i % 100 == 99 or i == steps - 1):
            bar.set_postfix(loss=f"{float(loss):.4f}")  # syncing only every 100 steps
    bar.close()
    losses = np.asarray(jax.device_get(losses), np.float64)
    window = loss_window(steps)
    stats = {
        "initial_loss": float(losses[:window].mean()),
        "final_loss": float(losses[-window:].mean()),
    }
    return state.params, stats


def save_checkpoint(params, cfg: ModelConfig, spec: WordTask, out_dir: str | os.PathLike):
    """Write weights, config.json (with the demo's special ids) and the demo tokenizer."""
    out = Path(out_dir)
    save_tokenizer(spec, out)
    export_hf(params, cfg, out)
    # export_hf leaves the special ids unset; samplers and HF generate() read them from here.
    hf_config = hf_config_for(cfg)
    hf_config.eos_token_id, hf_config.bos_token_id = EOS_ID, BOS_ID
    hf_config.pad_token_id = PAD_ID
    hf_config.save_pretrained(out)
    generation = {"eos_token_id": EOS_ID, "bos_token_id": BOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
