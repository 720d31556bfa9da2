"""The addition task's actor (``model.actor_path: demo_arith``): an SFT on the train split,
cached on disk, and its held-out exact-match accuracy.

The SFT teacher writes the carry-less sum 60% of the time (``ArithSpec.carry_drop``): greedy,
the actor gets the sums without a carry right and few others; sampled, it sometimes carries.
That leaves RL on the exact answer the carries to learn.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from oppo_jax.data.arith_task import ArithSpec, encode, sample_sft_pairs, split_pairs
from oppo_jax.data.demo_task import EOS_ID, PAD_ID, pad_batch
from oppo_jax.demo.assets import MARKER, build_lock
from oppo_jax.demo.common import (
    demo_model_config,
    join_batch,
    run_training,
    save_checkpoint,
    sequence_width,
)
from oppo_jax.demo.sft import sft_loss
from oppo_jax.models.api import load_hf_model
from oppo_jax.pipeline.kernels import sample
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.rollout.spec import RolloutSpec

ARITH_ACTOR = "demo_arith"  # the model.actor_path value
ARITH_BATCH = 64  # sequences per SFT step
ARITH_LR = 3e-3  # peak SFT learning rate
ARITH_SIZES = {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128}


def _batches(spec: ArithSpec, rng: np.random.Generator):
    """Fresh train-split examples every step, padded to one width (a single compilation)."""
    while True:
        rows = sample_sft_pairs(spec, ARITH_BATCH, rng)
        part = join_batch(
            [r.prompt for r in rows], [r.response for r in rows], sequence_width(spec)
        )
        yield ((part,),)


def exact_match_rate(actor_dir: str | os.PathLike, spec: ArithSpec, n: int = 512) -> float:
    """Greedy exact-match accuracy of a saved actor on the first ``n`` held-out sums."""
    model = load_hf_model(actor_dir)
    pairs = split_pairs(spec, "test")[:n]
    examples = [encode(int(a), int(b)) for a, b in pairs]
    prompts, lens = pad_batch([e.prompt for e in examples], PAD_ID, spec.max_prompt_len)
    greedy = SamplingConfig(greedy=True)
    rollout = RolloutSpec(greedy, spec.max_prompt_len, spec.max_response_len, (EOS_ID,), PAD_ID)
    state = sample(model.config, rollout, model.params, prompts, lens, jax.random.key(0), 8)
    tokens, count = np.asarray(state.tokens), np.asarray(state.num_generated)
    right = [
        list(t[:c]) == list(e.response) for t, c, e in zip(tokens, count, examples, strict=True)
    ]
    return float(np.mean(right))


def ensure_arith_actor(
    cache_dir: str | os.PathLike, steps: int, seed: int = 0, progress: bool = True
) -> Path:
    """The actor after ``steps`` SFT steps (``train.sft_steps``) in ``<cache_dir>/actor``,
    trained first unless a complete build of the same recipe is there (its marker is written
    last, as for the demo's assets)."""
    cache, spec = Path(cache_dir), ArithSpec()
    cfg = demo_model_config(spec, "lm", **ARITH_SIZES)
    recipe = {"spec": repr(spec), "model": repr(cfg), "steps": steps, "seed": seed}
    recipe |= {"batch": ARITH_BATCH, "lr": ARITH_LR}
    actor_dir = cache / "actor"
    with build_lock(cache):
        try:
            if json.loads((cache / MARKER).read_text())["recipe"] == recipe:
                return actor_dir
        except (OSError, ValueError, KeyError):
            pass  # no complete build: (re)build
        (cache / MARKER).unlink(missing_ok=True)
        if progress:
            print(f"Building the addition task's SFT actor in {cache} (runs once, then cached)")
        start, rng = time.perf_counter(), np.random.default_rng([seed, 1])
        params, stats = run_training(
            cfg, sft_loss, _batches(spec, rng), steps, ARITH_LR, seed, "SFT arith actor", progress
        )
        save_checkpoint(params, cfg, spec, actor_dir)
        stats |= {"seconds": time.perf_counter() - start}
        stats |= {"heldout_exact_match": exact_match_rate(actor_dir, spec)}
        if progress:
            print(
                f"SFT: loss {stats['final_loss']:.3f}, held-out exact match "
                f"{stats['heldout_exact_match']:.3f}, {stats['seconds']:.0f}s"
            )
        tmp = cache / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"recipe": recipe, "sft": stats}, indent=2))
        os.replace(tmp, cache / MARKER)
    return actor_dir
