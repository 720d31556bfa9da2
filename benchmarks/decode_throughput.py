"""Greedy decode throughput: oppo_jax ``decode_chunk`` vs transformers ``generate`` on CPU.

Both sides run the SAME tiny random Qwen2 model (built with transformers in a temp dir and loaded
into JAX with ``oppo_jax.load_hf_model``), the same equal-length prompts (so ``generate`` needs no
padding), greedy decoding, and the same number of new tokens, with EOS disabled so every row makes
exactly ``--new-tokens`` tokens. The two token arrays are asserted identical before any timing.

What is timed, per sample (one full generation of ``batch x new_tokens`` tokens):
  * jax:   ``start`` (prefill into a fresh KV cache) + ceil(new/chunk) calls of the jitted,
           state-donating ``decode_chunk``, blocked on with ``jax.block_until_ready``;
           "jax decode" is the decode-chunk part alone (prefill excluded).
  * torch: ``model.generate(..., do_sample=False)`` under ``torch.inference_mode``, which
           includes its own prefill.
Compilation is excluded by warm-up runs. Samples are interleaved in one process (each round runs
every jax chunk size and every torch thread count once, in a rotated order) and we report medians
of tokens/s and the median (min-max) of the per-round ratios jax/torch (see
shared/reference/PITFALLS.md on timing here).

``--threads`` sets torch's intra-op threads only; XLA's CPU client keeps its own pool. With tiny
ops, torch's OpenMP at 2 threads is far slower than at 1 whenever another process holds a core
(each parallel region waits on a descheduled thread), so ``--threads 1,2`` is worth a look.

    .venv/bin/python benchmarks/decode_throughput.py                  # default sweep
    .venv/bin/python benchmarks/decode_throughput.py --batch 8 --chunk 16 --threads 1,2 --out r.json
"""

from __future__ import annotations

import os
import sys

# Before JAX is imported: CPU only, one host device (drop any fake-device count a shell may set).
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import oppo_jax  # noqa: E402
from oppo_jax.rollout import RolloutSpec, SamplingConfig  # noqa: E402
from tests.oracles import scan_decode, start_decode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import PAD_ID, save_tiny_qwen2  # noqa: E402

# Parity with the float32 PyTorch reference: no reduced-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=_ints, default=[1, 8, 32], help="comma list (default 1,8,32)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    p.add_argument("--chunk", type=_ints, default=[16, 64], help="decode chunk sizes (16,64)")
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (all equal)")
    p.add_argument("--hidden", type=int, default=64, help="model width (multiple of 16)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument(
        "--threads",
        type=_ints,
        default=[2],
        help="torch.set_num_threads; a comma list (1,2) times torch at each, interleaved",
    )
    p.add_argument("--rounds", type=int, default=7, help="timed interleaved rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs of each before timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    return p.parse_args(argv)


class JaxRunner:
    """One (batch, chunk) configuration of oppo_jax's prefill + chunked greedy decode."""

    def __init__(self, model, prompts: np.ndarray, new_tokens: int, chunk: int):
        cfg = model.config
        batch, width = prompts.shape
        # EOS = vocab_size: an id the model can never produce, so no row stops early.
        greedy = SamplingConfig(greedy=True)
        rollout = RolloutSpec(greedy, width, new_tokens, (cfg.vocab_size,), PAD_ID)
        self.start = start_decode(cfg, rollout)
        self.step = scan_decode(cfg, greedy, chunk)
        self.n_calls = math.ceil(new_tokens / chunk)
        self.params = model.params
        self.start_args = (
            jnp.asarray(prompts, jnp.int32),
            jnp.full((batch,), width, jnp.int32),
            jax.random.key(0),
        )

    def run(self):
        """Return (state, seconds for prefill + decode, seconds for decode alone)."""
        t0 = time.perf_counter()
        state = self.start(self.params, *self.start_args)
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        for _ in range(self.n_calls):
            state = self.step(self.params, state)  # donates the previous state
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        return state, t2 - t0, t2 - t1


def run_torch(model, input_ids: torch.Tensor, new_tokens: int, threads: int):
    """Return (generated tokens [B, new], seconds) for one greedy ``generate``."""
    torch.set_num_threads(threads)
    mask = torch.ones_like(input_ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=PAD_ID,
        )
    seconds = time.perf_counter() - t0
    return out[:, input_ids.shape[1] :], seconds


def check_identical(jax_tokens: np.ndarray, torch_tokens: np.ndarray, label: str):
    assert torch_tokens.shape == jax_tokens.shape, (
        f"{label}: torch made {torch_tokens.shape}, jax {jax_tokens.shape} (EOS not disabled?)"
    )
    bad = np.argwhere(jax_tokens != torch_tokens)
    assert bad.size == 0, (
        f"{label}: greedy tokens differ at {len(bad)} positions; first (row, pos) = "
        f"{tuple(bad[0])}: jax {jax_tokens[tuple(bad[0])]} vs torch {torch_tokens[tuple(bad[0])]}"
    )


def bench_batch(args, jax_model, torch_model, batch: int) -> list[dict]:
    rng = np.random.default_rng(args.seed + batch)
    prompts = rng.integers(3, args.vocab, (batch, args.prompt_len))
    input_ids = torch.as_tensor(prompts, dtype=torch.long)
    n_tokens = batch * args.new_tokens
    runners = {c: JaxRunner(jax_model, prompts, args.new_tokens, c) for c in args.chunk}

    # Warm-up (compiles every jitted function) and the parity check.
    for threads in args.threads:
        for _ in range(max(args.warmup, 1)):
            torch_tokens, _ = run_torch(torch_model, input_ids, args.new_tokens, threads)
    for chunk, runner in runners.items():
        for _ in range(max(args.warmup, 1)):
            state, _, _ = runner.run()
        assert np.all(np.asarray(state.num_generated) == args.new_tokens)
        check_identical(
            np.asarray(state.tokens), torch_tokens.numpy(), f"batch={batch} chunk={chunk}"
        )

    # Timed, interleaved rounds: every jax chunk size and torch thread count once per round,
    # in an order rotated from round to round.
    names = [("jax", c) for c in args.chunk] + [("torch", t) for t in args.threads]
    times = {name: [] for name in names}
    decode_times = {c: [] for c in args.chunk}
    for r in range(args.rounds):
        k = r % len(names)
        for kind, value in names[k:] + names[:k]:
            if kind == "jax":
                _, total, decode = runners[value].run()
                times[kind, value].append(total)
                decode_times[value].append(decode)
            else:
                _, seconds = run_torch(torch_model, input_ids, args.new_tokens, value)
                times[kind, value].append(seconds)

    rows = []
    for c in args.chunk:
        jax_s = times["jax", c]
        torch_rows = []
        for t in args.threads:
            torch_s = times["torch", t]
            # Per-round speed-up: (tokens/s of jax) / (tokens/s of torch) = torch time / jax time.
            ratios = [ts / js for js, ts in zip(jax_s, torch_s, strict=True)]
            torch_rows.append(
                dict(
                    threads=t,
                    tok_s=n_tokens / statistics.median(torch_s),
                    ratio=statistics.median(ratios),
                    ratio_min=min(ratios),
                    ratio_max=max(ratios),
                    seconds=torch_s,
                )
            )
        rows.append(
            dict(
                batch=batch,
                new_tokens=args.new_tokens,
                chunk=c,
                tokens=n_tokens,
                jax_tok_s=n_tokens / statistics.median(jax_s),
                jax_decode_tok_s=n_tokens / statistics.median(decode_times[c]),
                jax_seconds=jax_s,
                jax_decode_seconds=decode_times[c],
                torch=torch_rows,
            )
        )
    return rows


def print_table(rows: list[dict]):
    cols = [("batch", 5), ("new", 4), ("chunk", 5), ("jax tok/s", 10), ("jax dec tok/s", 13)]
    for t in rows[0]["torch"]:
        cols += [(f"torch@{t['threads']} tok/s", 13), (f"jax/torch@{t['threads']} (min-max)", 23)]
    head = " ".join(f"{name:>{w}}" for name, w in cols)
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = [
            f"{r['batch']}",
            f"{r['new_tokens']}",
            f"{r['chunk']}",
            f"{r['jax_tok_s']:.0f}",
            f"{r['jax_decode_tok_s']:.0f}",
        ]
        for t in r["torch"]:
            cells += [
                f"{t['tok_s']:.0f}",
                f"{t['ratio']:.2f} ({t['ratio_min']:.2f}-{t['ratio_max']:.2f})",
            ]
        print(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols, strict=True)))


def main(argv=None):
    args = parse_args(argv)
    env = dict(
        jax=jax.__version__,
        torch=torch.__version__,
        transformers=transformers.__version__,
        jax_devices=[str(d) for d in jax.devices()],
        cpu_count=os.cpu_count(),
        torch_threads=args.threads,
        python=platform.python_version(),
    )
    print(
        f"model: qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
        f"prompt_len={args.prompt_len} float32 | torch threads={args.threads} "
        f"(jax: XLA's own pool) cpus={env['cpu_count']} | jax {env['jax']} "
        f"{env['jax_devices']}, torch {env['torch']}, transformers {env['transformers']}",
        flush=True,
    )
    max_positions = max(512, args.prompt_len + args.new_tokens)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        torch_model = save_tiny_qwen2(
            Path(tmp), args.hidden, args.layers, args.vocab, max_positions, seed=args.seed
        )
        jax_model = oppo_jax.load_hf_model(tmp)
    rows = []
    for batch in args.batch:
        t0 = time.perf_counter()
        rows.extend(bench_batch(args, jax_model, torch_model, batch))
        print(f"  batch {batch}: done in {time.perf_counter() - t0:.1f}s", flush=True)
    print(f"greedy tokens identical (jax vs torch) for every configuration; rounds={args.rounds}")
    print_table(rows)
    print(f"total {time.perf_counter() - t_start:.1f}s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps(dict(config=config, env=env, results=rows), indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
