"""Live-prefix decode vs full-cache decode, side by side in one process (issue #13 item 3).

The rollout of one step at the shapes of ``configs/bench_longtail_cpu.yaml``: demo-shaped
models (D 64, 2 layers, 4 heads, 2 kv-heads, vocabulary 52; random weights: timing does not
depend on them), S = B + Δ = 24 slots, prompts of 16 tokens, responses up to 512 with
log-normal lengths (median 56, p99 448), chunks of 32, cut at B = 16 finished. Each round
decodes a fresh set of prompts (other ids, so other lengths) to the cut, streaming every chunk
to the three scorers (reference log-probs, critic values, reward score) as ``run_step`` does,
reading the whole P + R cache of every slot ("full"), its live prefix ("live",
``Kernels.live_prefix``), the live prefix with slot compaction ("live+compact",
``Kernels.compact_slots``) and with compaction into buckets of at least 4 slots
("live+compact>=4", ``pipeline.compact_min_slots``), in rotated order. Reported: median
seconds per step of the decode chunks alone (with the compaction gathers) and of the scorer
chunks alone, and the median of the per-round ratios full / variant. Tokens and
log-probs of the two are checked equal (log-probs within 1e-5) before anything is timed.

    .venv/bin/python benchmarks/live_prefix.py --rounds 7 --out live_prefix.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from oppo_jax.config import OptimConfig, PPOConfig  # noqa: E402
from oppo_jax.models import ModelConfig, init_params  # noqa: E402
from oppo_jax.pipeline.decode_loop import SlotMap  # noqa: E402
from oppo_jax.pipeline.kernels import Kernels, build_kernels, oppo_streamed_scoring  # noqa: E402
from oppo_jax.ppo.optimizer import make_optimizer  # noqa: E402
from oppo_jax.ppo.update import UpdateSpec  # noqa: E402
from oppo_jax.rollout import Admission, RolloutSpec, SamplingConfig  # noqa: E402
from oppo_jax.rollout.decode import CutRule  # noqa: E402
from oppo_jax.rollout.lengths import LengthSpec  # noqa: E402

ROLES = ("reference", "critic", "reward")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (steps) per variant")
    p.add_argument("--slots", type=int, default=24, help="S = B + Δ")
    p.add_argument("--batch", type=int, default=16, help="B, sequences the cut waits for")
    p.add_argument("--chunk", type=int, default=32, help="C, tokens per decode chunk")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--median", type=float, default=56.0)
    p.add_argument("--p99", type=float, default=448.0)
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    return p.parse_args(argv)


def demo_shaped(head: str = "lm") -> ModelConfig:
    return ModelConfig(
        vocab_size=52, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, qkv_bias=True, head=head, num_labels=1,
    )  # fmt: skip


def make_kernels(args) -> Kernels:
    actor, critic = demo_shaped(), demo_shaped("score")
    optim = OptimConfig()
    tx = make_optimizer(optim, optim.actor_lr, 100)
    spec = UpdateSpec(
        actor=actor, critic=critic, ppo=PPOConfig(), temperature=0.7, actor_tx=tx, critic_tx=tx
    )
    rollout = RolloutSpec(
        SamplingConfig(temperature=0.7),
        args.prompt_len,
        args.response_len,
        eos_ids=(1,),
        lengths=LengthSpec(args.median, args.p99),
    )
    return build_kernels(spec, rollout, reward_model=critic, update=lambda *a: None)


def run_rollout(kernels: Kernels, params: dict, admission: Admission, args) -> dict:
    """One step's rollout to the cut; returns the decode and scorer seconds and the state.
    With ``kernels.compact_slots``, running slots move into smaller buckets as others finish
    (``SlotMap``, as ``run_step`` does), timed with the decode."""
    rule = CutRule(admission.active, admission.must_finish, jnp.int32(args.batch))
    state, _ = kernels.prefill_actor(
        params["actor"], admission, jax.random.key(0), ()
    )  # new prompts
    held = types.SimpleNamespace(states={r: kernels.prefill_prompts(r, params[r], admission)[0]
                                         for r in ROLES})  # fmt: skip
    jax.block_until_ready((state, held.states))
    floor = kernels.compaction_floor  # None: this variant does not compact
    slot_map = None if floor is None else SlotMap(args.slots, floor)
    longest = int(np.max(np.asarray(admission.context_len)))
    decode_s = score_s = 0.0
    for i in range(args.response_len + 1):
        width = kernels.chunk_width(longest, args.chunk, i)
        t0 = time.perf_counter()
        state, tokens = kernels.decode_tokens(params["actor"], state, rule, args.chunk, width)
        running = int(jax.block_until_ready(tokens.running))
        t1 = time.perf_counter()
        for r in ROLES:
            spec = getattr(kernels.scorer_specs, r)  # every slot, as before packing
            full = tokens if slot_map is None else slot_map.full_chunk(tokens)
            held.states[r] = oppo_streamed_scoring(
                params[r], held.states[r], full, None, spec=spec, kv_width=width, packed=False
            )[0]
        jax.block_until_ready(held.states)
        t2 = time.perf_counter()
        if slot_map is not None and running >= 0:
            state, _, rule = slot_map.maybe_compact(running, tokens.finished, state, tokens, rule)
            jax.block_until_ready(state)
        t3 = time.perf_counter()
        decode_s, score_s = decode_s + t1 - t0 + t3 - t2, score_s + t2 - t1
        if running < 0:
            break
    if slot_map is not None:
        state = slot_map.restore(state)
    out = dict(decode_s=decode_s, score_s=score_s, state=state, scorers=held.states)
    return out | {"chunks": i + 1}


def admission_for(round_index: int, args) -> Admission:
    rng = np.random.default_rng(round_index)
    prompts = rng.integers(4, 52, (args.slots, args.prompt_len)).astype(np.int32)
    ids = jnp.arange(args.slots, dtype=jnp.int32) + round_index * args.slots
    lens = jnp.full((args.slots,), args.prompt_len, jnp.int32)
    return Admission.fresh(jnp.asarray(prompts), lens, args.response_len, prompt_id=ids)


def check_same(live: dict, full: dict) -> None:
    a, b = live["state"], full["state"]
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    for r in ROLES:
        np.testing.assert_allclose(live["scorers"][r].per_token, full["scorers"][r].per_token,
                                   atol=1e-5, rtol=0)  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    live_k = make_kernels(args)
    variants = {
        "full": dataclasses.replace(live_k, live_prefix=False, compact_slots=False),
        "live": dataclasses.replace(live_k, compact_slots=False),
        "live+compact": dataclasses.replace(live_k, compact_slots=True),
        # buckets of at least 4 slots (pipeline.compact_min_slots): fewer compiled buckets
        "live+compact>=4": dataclasses.replace(live_k, compact_slots=True, compact_min_slots=4),
    }
    keys = jax.random.split(jax.random.key(0), 3)
    params = {
        "actor": init_params(demo_shaped(), keys[0]),
        "critic": init_params(demo_shaped("score"), keys[1]),
        "reward": init_params(demo_shaped("score"), keys[2]),
    }
    params["reference"] = params["actor"]
    # Warm-up: every round once per variant (compiles every width met), checking parity.
    t0 = time.perf_counter()
    for r in range(args.rounds):
        out = {name: run_rollout(k, params, admission_for(r, args), args)
               for name, k in variants.items()}  # fmt: skip
        check_same(out["live"], out["full"])
        check_same(out["live+compact"], out["full"])
        check_same(out["live+compact>=4"], out["full"])
    print(f"warm-up and parity check: {time.perf_counter() - t0:.1f}s", flush=True)
    times = {name: {"decode_s": [], "score_s": []} for name in variants}
    ratios = {f"{key} {name}": [] for key in ("decode_s", "score_s")
              for name in variants if name != "full"}  # fmt: skip
    chunks = []
    for r in range(args.rounds):
        order = list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]
        out = {name: run_rollout(variants[name], params, admission_for(r, args), args)
               for name in order}  # fmt: skip
        chunks.append(out["live"]["chunks"])
        for key in ("decode_s", "score_s"):
            for name in variants:
                times[name][key].append(out[name][key])
                if name != "full":
                    ratios[f"{key} {name}"].append(out["full"][key] / out[name][key])
    result = dict(config=vars(args) | {"out": str(args.out)}, chunks_per_step=chunks,
                  times=times, ratios=ratios)  # fmt: skip
    for key in ("decode_s", "score_s"):
        print(key + ": " + ", ".join(f"{n} {statistics.median(times[n][key]):.3f}s"
                                     for n in variants) + " per step (median)")  # fmt: skip
    for key, values in ratios.items():
        print(
            f"full / {key.split()[1]} ({key.split()[0]}), per round: median "
            f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
