"""The word-problem task's actor (``model.actor_path: demo_word_problems``): an SFT on the
train split's problems, cached on disk, and its held-out accuracy.

As for the addition task, the SFT teacher forgets the carries (borrows) of 60% of its
rationales (``WordProblemSpec.carry_drop``): greedy, the actor answers the problems without
one and few others; sampled, it sometimes carries, which GRPO on the verified answer
reinforces.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from oppo_jax.data.answers import after_hashes
from oppo_jax.data.demo_task import EOS_ID, PAD_ID, pad_batch
from oppo_jax.data.word_problems import (
    WordProblemSpec,
    build_tokenizer,
    encode,
    rationale,
    sample_sft,
    save_tokenizer,
    split_problems,
)
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

WORD_ACTOR = "demo_word_problems"  # the model.actor_path value
WORD_BATCH = 64  # sequences per SFT step
WORD_LR = 3e-3  # peak SFT learning rate
WORD_SIZES = {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128}


def _batches(spec: WordProblemSpec, rng: np.random.Generator):
    """Fresh train-split examples every step, padded to one width (a single compilation)."""
    while True:
        rows = sample_sft(spec, WORD_BATCH, rng)
        part = join_batch(
            [r.prompt for r in rows], [r.response for r in rows], sequence_width(spec)
        )
        yield ((part,),)


def heldout_accuracy(actor_dir: str | os.PathLike, spec: WordProblemSpec, n: int = 512) -> float:
    """Greedy accuracy of a saved actor on the first ``n`` held-out problems: the share whose
    answer after ``####`` is the true result."""
    model, tokenizer = load_hf_model(actor_dir), build_tokenizer(spec)
    rows = split_problems(spec, "test")[:n]
    examples = [encode(tokenizer, row) for row in rows]
    prompts, lens = pad_batch([e.prompt for e in examples], PAD_ID, spec.max_prompt_len)
    greedy = SamplingConfig(greedy=True)
    rollout = RolloutSpec(greedy, spec.max_prompt_len, spec.max_response_len, (EOS_ID,), PAD_ID)
    state = sample(model.config, rollout, model.params, prompts, lens, jax.random.key(0), 16)
    tokens, count = np.asarray(state.tokens), np.asarray(state.num_generated)
    right = [
        after_hashes(tokenizer.decode([int(x) for x in t[:c]])) == rationale(row).split()[-1]
        for t, c, row in zip(tokens, count, rows, strict=True)
    ]
    return float(np.mean(right))


def ensure_word_actor(
    cache_dir: str | os.PathLike, steps: int, seed: int = 0, progress: bool = True
) -> Path:
    """The actor after ``steps`` SFT steps (``train.sft_steps``) in ``<cache_dir>/actor``,
    trained first unless a complete build of the same recipe is there (its marker is written
    last, as for the demo's assets)."""
    cache, spec = Path(cache_dir), WordProblemSpec()
    cfg = demo_model_config(spec, "lm", **WORD_SIZES)
    recipe = {"spec": repr(spec), "model": repr(cfg), "steps": steps, "seed": seed}
    recipe |= {"batch": WORD_BATCH, "lr": WORD_LR, "task": "word_problems"}
    actor_dir = cache / "actor"
    with build_lock(cache):
        try:
            if json.loads((cache / MARKER).read_text())["recipe"] == recipe:
                return actor_dir
        except (OSError, ValueError, KeyError):
            pass  # no complete build: (re)build
        (cache / MARKER).unlink(missing_ok=True)
        if progress:
            print(f"Building the word problems' SFT actor in {cache} (runs once, then cached)")
        start, rng = time.perf_counter(), np.random.default_rng([seed, 1])
        params, stats = run_training(
            cfg, sft_loss, _batches(spec, rng), steps, WORD_LR, seed, "SFT word actor", progress
        )
        save_checkpoint(params, cfg, spec, actor_dir)
        save_tokenizer(spec, actor_dir)  # the WordPiece tokenizer in place of the word-level one
        stats |= {"seconds": time.perf_counter() - start}
        stats |= {"heldout_accuracy": heldout_accuracy(actor_dir, spec)}
        if progress:
            print(
                f"SFT: loss {stats['final_loss']:.3f}, held-out accuracy "
                f"{stats['heldout_accuracy']:.3f}, {stats['seconds']:.0f}s"
            )
        tmp = cache / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"recipe": recipe, "sft": stats}, indent=2))
        os.replace(tmp, cache / MARKER)
    return actor_dir
