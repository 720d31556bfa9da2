"""The demo's trained actor and reward model: build once, cache on disk, and check their shape."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from jaxtyping import Int

from oppo_jax.data.demo_task import (
    EOS_ID,
    PAD_ID,
    DemoTaskSpec,
    gold_scores,
    pad_batch,
    sample_prompts,
)
from oppo_jax.demo.common import demo_model_config
from oppo_jax.demo.reward_model import train_reward_model
from oppo_jax.demo.sft import train_sft
from oppo_jax.models.api import load_hf_model
from oppo_jax.pipeline.kernels import sample
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.rollout.spec import RolloutSpec

# The SFT loss flattens within a few hundred steps, but the actor learns only late that
# responses opened by a long-marker word stop later; that is what gives its sampled lengths a
# mixture-like tail, so SFT runs well past the flat loss (BENCHMARKS.md, "The demo's cached
# models").
DEFAULT_SFT_STEPS = 3000  # SFT optimiser steps of 32 sequences for the cached demo actor
DEFAULT_RM_STEPS = 500  # Bradley–Terry steps of 32 pairs for the cached demo reward model
MARKER = "assets.json"  # written last: its presence means both checkpoints are complete
_DECODE_CHUNK = 16  # decode steps per compiled chunk when sampling for length statistics

__all__ = [
    "DEFAULT_RM_STEPS",
    "DEFAULT_SFT_STEPS",
    "demo_model_config",
    "ensure_demo_assets",
    "response_length_stats",
    "sample_responses",
    "train_reward_model",
    "train_sft",
]


def _recipe(spec: DemoTaskSpec, sft_steps: int, rm_steps: int, seed: int, configs) -> dict:
    """Everything that determines the cached checkpoints; any change means a rebuild."""
    recipe = {
        "spec": dataclasses.asdict(spec),
        "sft_steps": sft_steps,
        "rm_steps": rm_steps,
        "seed": seed,
        "actor_config": dataclasses.asdict(configs[0]),
        "reward_config": dataclasses.asdict(configs[1]),
    }
    return json.loads(json.dumps(recipe))  # tuples become lists, as in the saved marker


def _cached_recipe(cache: Path) -> dict | None:
    try:
        return json.loads((cache / MARKER).read_text())["recipe"]
    except (OSError, ValueError, KeyError):
        return None  # missing or half-written marker: treat as no cache


def ensure_demo_assets(
    cache_dir: str | os.PathLike,
    spec: DemoTaskSpec = DemoTaskSpec(),  # noqa: B008 (frozen dataclass, safe default)
    sft_steps: int = DEFAULT_SFT_STEPS,
    rm_steps: int = DEFAULT_RM_STEPS,
    seed: int = 0,
    progress: bool = True,
    model_sizes: dict | None = None,
) -> tuple[Path, Path]:
    """Return (actor_dir, reward_dir) under ``cache_dir``, training both first if not cached.

    The cache is valid only when its marker file records the same spec, step counts, seed and
    architectures; the marker is written last (atomically), so an interrupted build is redone.
    ``model_sizes`` overrides ``demo_model_config``'s size arguments (tests use a smaller model).
    """
    cache = Path(cache_dir)
    configs = [demo_model_config(spec, head, **(model_sizes or {})) for head in ("lm", "score")]
    recipe = _recipe(spec, sft_steps, rm_steps, seed, configs)
    with build_lock(cache):
        return _ensure_built(cache, recipe, spec, sft_steps, rm_steps, seed, progress, configs)


@contextlib.contextmanager
def build_lock(cache: Path):
    """Hold an exclusive lock on ``<cache>/.lock`` while the cache is checked and built: two
    processes sharing a cache directory (two runs, or parallel test workers) would otherwise
    delete each other's half-built models; the second waits and then finds them built. The
    holder writes its pid into the lock file, and a process that has to wait says whom for."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "a+") as lock:  # "a+": the holder's pid stays readable
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: say by whom and for what, then wait
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            print(
                f"oppo-jax: waiting for {holder} to finish checking or building the demo's "
                f"models in {cache} (lock {cache / '.lock'}); Ctrl-C stops this run",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} ({os.path.basename(sys.argv[0])})\n")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure_built(cache, recipe, spec, sft_steps, rm_steps, seed, progress, configs):
    actor_dir, reward_dir = cache / "actor", cache / "reward"
    complete = all((d / "model.safetensors").is_file() for d in (actor_dir, reward_dir))
    if complete and _cached_recipe(cache) == recipe:
        return actor_dir, reward_dir
    (cache / MARKER).unlink(missing_ok=True)  # invalid from here until the rebuild finishes
    for d in (actor_dir, reward_dir):
        shutil.rmtree(d, ignore_errors=True)
    if progress:
        print(f"Building demo actor and reward model in {cache} (runs once, then cached)")
    sft = train_sft(spec, actor_dir, sft_steps, seed=seed, progress=progress, model_cfg=configs[0])
    rm = train_reward_model(
        spec, reward_dir, rm_steps, seed=seed, progress=progress, model_cfg=configs[1]
    )
    if progress:
        print(
            f"SFT: loss {sft['final_loss']:.3f} in {sft['seconds']:.0f}s; RM: loss "
            f"{rm['final_loss']:.3f}, pair accuracy {rm['pair_accuracy']:.3f}, gold corr "
            f"{rm['gold_corr']:.3f} in {rm['seconds']:.0f}s"
        )
    tmp = cache / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"recipe": recipe, "sft": sft, "reward": rm}, indent=2))
    os.replace(tmp, cache / MARKER)
    return actor_dir, reward_dir


def sample_responses(
    actor_dir: str | os.PathLike,
    spec: DemoTaskSpec,
    n_prompts: int = 256,
    temperature: float = 0.7,
    seed: int = 0,
) -> tuple[Int[np.ndarray, "N R"], Int[np.ndarray, " N"]]:
    """One sampled response per random prompt from the saved actor: (tokens, lengths incl. eos)."""
    model = load_hf_model(actor_dir)
    prompts, prompt_lens = pad_batch(
        sample_prompts(spec, n_prompts, np.random.default_rng([seed, 4])), PAD_ID
    )
    sampling = SamplingConfig(temperature=temperature)
    rollout = RolloutSpec(sampling, prompts.shape[1], spec.max_response_len, (EOS_ID,), PAD_ID)
    # Slot i holds prompt i: its sampling key depends on (seed, i, position) only.
    key = jax.random.key(seed)
    state = sample(model.config, rollout, model.params, prompts, prompt_lens, key, _DECODE_CHUNK)
    return np.asarray(state.tokens), np.asarray(state.num_generated)


def response_length_stats(
    actor_dir: str | os.PathLike,
    spec: DemoTaskSpec,
    n_prompts: int = 256,
    temperature: float = 0.7,
    seed: int = 0,
) -> dict:
    """Length distribution (tokens incl. eos) and mean gold of the actor's sampled responses.

    Returns {"median", "p99", "ratio" (p99 / median), "mean_gold"}.
    """
    tokens, lengths = sample_responses(actor_dir, spec, n_prompts, temperature, seed)
    median = float(np.median(lengths))
    p99 = float(np.percentile(lengths, 99))
    return {
        "median": median,
        "p99": p99,
        "ratio": p99 / max(median, 1.0),
        "mean_gold": float(np.mean(gold_scores(tokens, lengths, spec))),
    }
