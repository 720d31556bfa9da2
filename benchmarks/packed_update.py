"""The PPO update, padded vs packed, side by side in one process, at a bench config's shapes.

For each config (default: configs/bench_cpu.yaml and configs/bench_longtail_cpu.yaml) it builds
the demo-sized actor and critic (random weights: the update's cost depends on shapes and
lengths, not on what the weights are), draws ``--steps`` batches of B sequences with that
config's length distribution, and times one update of each batch in both layouts after a
warm-up call that compiles it (compilation is reported apart: the packed update compiles once
per packed shape). Lengths: prompts uniform in the demo task's range (with its template
tokens); responses log-normal, bench_longtail_cpu's median 56 / p99 448 (its length sampler)
and, for bench_cpu, median 4 / p99 30 (what BENCHMARKS.md reports of the SFT actor there),
capped at R. Prints, per config and layout, the median update time, the time ratio, and the
update's efficiency = real tokens / computed token slots; ``--out`` writes them as JSON.

    python benchmarks/packed_update.py --steps 5 --out packed_update.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from oppo_jax.config import load_config  # noqa: E402
from oppo_jax.data.demo_task import DemoTaskSpec  # noqa: E402
from oppo_jax.demo.common import demo_model_config  # noqa: E402
from oppo_jax.models import init_params  # noqa: E402
from oppo_jax.ppo.experience import ScoredRollout, build_batch  # noqa: E402
from oppo_jax.ppo.packed_update import make_update  # noqa: E402
from oppo_jax.ppo.update import init_train_state  # noqa: E402
from oppo_jax.run.specs import update_spec  # noqa: E402
from tests.padded_update import make_padded_update  # noqa: E402

# (median, p99) of the response lengths per config, tokens (see the module docstring).
LENGTHS = {"bench_cpu": (4.0, 30.0), "bench_longtail_cpu": (56.0, 448.0)}


def _lengths(rng, cfg, name: str):
    """Prompt and response lengths [B] of one batch."""
    r = cfg.rollout
    task = DemoTaskSpec()
    lo, hi = task.prompt_len_range
    prompt = np.minimum(rng.integers(lo, hi + 1, r.batch_size) + 3, r.max_prompt_len)
    median, p99 = LENGTHS[name]
    sigma = (math.log(p99) - math.log(median)) / 2.3263
    resp = np.exp(math.log(median) + sigma * rng.standard_normal(r.batch_size))
    return prompt, np.clip(np.round(resp), 1, r.max_response_len).astype(int)


def _batch(rng, cfg, name: str, spec):
    """A PPO batch of random tokens with the config's shapes and lengths."""
    r = cfg.rollout
    b, p, w = r.batch_size, r.max_prompt_len, r.max_response_len
    prompt, resp = _lengths(rng, cfg, name)
    tokens = np.zeros((b, p + w), np.int32)
    for i in range(b):
        tokens[i, : prompt[i] + resp[i]] = rng.integers(
            4, spec.actor.vocab_size, prompt[i] + resp[i]
        )
    mask = np.arange(w)[None, :] < resp[:, None]
    noise = jnp.asarray(rng.normal(-2.0, 0.5, (b, w)), jnp.float32)
    rollout = ScoredRollout(
        jnp.asarray(tokens), jnp.asarray(prompt), jnp.asarray(mask),
        scores=jnp.asarray(rng.normal(size=b), jnp.float32),
        ended_with_eos=jnp.ones(b, bool), old_logp=noise, behaviour_logp=noise,
        ref_logp=noise + 0.01, values=jnp.zeros((b, w), jnp.float32),
    )  # fmt: skip
    return build_batch(spec.ppo, rollout, jnp.float32(cfg.ppo.kl_coef))[0], (prompt, resp)


def _time(update, state, batch, lengths, key):
    """Seconds of one update call (it donates ``state``: a copy goes in)."""
    copy = jax.tree.map(jnp.copy, state)
    jax.block_until_ready(copy)
    start = time.perf_counter()
    new, metrics = update(copy, batch, key, jnp.float32(0.1), lengths=lengths)
    jax.block_until_ready((new, metrics))
    return time.perf_counter() - start, metrics


def bench(name: str, steps: int, seed: int) -> dict:
    cfg = load_config(name)
    width = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    task = DemoTaskSpec()
    actor = demo_model_config(task, "lm", max_position_embeddings=max(width, 128))
    critic = demo_model_config(task, "score", max_position_embeddings=max(width, 128))
    spec = update_spec(cfg, actor, critic)
    state = init_train_state(
        spec, init_params(actor, jax.random.key(0)), init_params(critic, jax.random.key(1))
    )
    updates = {"padded": make_padded_update(spec), "packed": make_update(spec)}
    rng = np.random.default_rng(seed)
    times = {k: [] for k in updates}
    compile_s = {k: 0.0 for k in updates}
    tokens = {k: [0.0, 0.0] for k in updates}
    for step in range(steps):
        batch, lengths = _batch(rng, cfg, name, spec)
        key = jax.random.key(step)
        order = list(updates) if step % 2 == 0 else list(reversed(updates))
        for kind in order:  # warm-up (compiles a new shape), then the timed call
            compile_s[kind] += _time(updates[kind], state, batch, lengths, key)[0]
        for kind in order:
            seconds, metrics = _time(updates[kind], state, batch, lengths, key)
            times[kind].append(seconds)
            tokens[kind][0] += metrics["update_tokens_real"]
            tokens[kind][1] += metrics["update_tokens_computed"]
    out = {"config": name, "steps": steps, "packed_shapes": sorted(updates["packed"].shapes)}
    for kind in updates:
        out[kind] = {
            "median_s": float(np.median(times[kind])),
            "first_calls_s": compile_s[kind],
            "efficiency": tokens[kind][0] / tokens[kind][1],
        }
    out["packed_vs_padded_time"] = out["packed"]["median_s"] / out["padded"]["median_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="bench_cpu,bench_longtail_cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = [bench(name, args.steps, args.seed) for name in args.configs.split(",")]
    for r in results:
        print(
            f"{r['config']}: update padded {r['padded']['median_s']:.3f} s "
            f"(efficiency {r['padded']['efficiency']:.2f}), packed {r['packed']['median_s']:.3f} s "
            f"(efficiency {r['packed']['efficiency']:.2f}); packed/padded time "
            f"{r['packed_vs_padded_time']:.2f}; {len(r['packed_shapes'])} packed shapes "
            f"{r['packed_shapes']}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
