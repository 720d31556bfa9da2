"""The Pallas attention kernels on this machine's accelerator, before a benchmark relies on them.

    python benchmarks/ragged_check.py [--smoke] [--out FILE]

One decode step's attention over a Qwen2.5-7B-shaped cache layer (28 query heads, 4 kv heads,
head width 128, bf16; 120 slots, 4,096 cache columns, 2 layers), half the slots finished (no
keys) and the rest at drawn lengths, at live widths 1,024 and 4,096:
- correct: the ragged kernel (``oppo_jax.models.ragged_decode``) against a float32 softmax over
  each row's keys (max abs error; fails above 0.03, what bf16 inputs allow);
- timed, side by side in this process: the ragged kernel against XLA's attention over the live
  width (what ``model.attention=xla`` runs), median of 20 calls each, reported as a ratio.

Then the segment attention of packed rows (``oppo_jax.models.segment_attention``, what the
packed update runs on a GPU) at the 7B config's packed-update shapes (4 rows of 1,536 columns
holding long-tailed sequences, 28 / 4 heads of 128, bf16): its output and the gradients of q,
k and v against XLA's same-segment causal attention in float32 (max abs error, relative to the
reference's largest magnitude; fails above 0.03), and forward + backward timed beside XLA's
masked attention (what ran before it), median of 10 calls each, as a ratio.

Exit 0 and a JSON report when correct; 1 when the kernel fails to compile or is wrong (the
message says which). ``benchmarks/gpu_bench.sh`` runs it first and, when it fails, measures
with ``model.attention=cudnn`` instead of letting a broken kernel sink the run. ``--smoke``:
tiny shapes on the CPU (Pallas's interpreter), no timing, so a test keeps the script working.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.models import ragged_decode as rd
from oppo_jax.models.kv_cache import read_layer
from oppo_jax.models.query_blocks import attention as xla_attention

TOLERANCE = 0.03


def _reference(q, k_cache, v_cache, lengths, width):
    """float32 softmax over each row's keys 0 .. lengths[s] - 1 (kv heads repeated)."""
    k = read_layer(k_cache, jnp.int32(1), width).astype(jnp.float32)  # [S W K Dh]
    v = read_layer(v_cache, jnp.int32(1), width).astype(jnp.float32)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("shd,swhd->shw", q[:, 0].astype(jnp.float32), k) / q.shape[-1] ** 0.5
    seen = jnp.arange(width)[None, None, :] < lengths[:, None, None]
    weights = jnp.where(seen, jax.nn.softmax(jnp.where(seen, logits, -1e30), axis=-1), 0.0)
    return jnp.einsum("shw,swhd->shd", weights, v)[:, None]


def _dense(q, k_cache, v_cache, lengths, width):
    """XLA's attention over the live width, as the model runs it without the ragged kernel."""
    k = read_layer(k_cache, jnp.int32(1), width)
    v = read_layer(v_cache, jnp.int32(1), width)
    mask = (jnp.arange(width)[None, :] < lengths[:, None])[:, None, None, :]
    return xla_attention(q, k, v, mask, False)


def _packed_segments(rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Segment ids of packed rows: long-tailed sequences first-fit from column 0 until a row is
    full, the unused tail padding (-1), as ``ppo.packing`` lays them out."""
    rng = np.random.default_rng(seed)
    seg = np.full((rows, width), -1, np.int32)
    next_id = 0
    for r in range(rows):
        offset = 0
        while offset < width - 16:
            n = int(min(rng.lognormal(np.log(width / 6), 0.9) + 1, width - offset))
            seg[r, offset : offset + n] = next_id
            offset, next_id = offset + n, next_id + 1
    return seg


def _segment_check(smoke: bool) -> dict:
    """The segment attention's errors against float32 XLA and (not ``smoke``) its time."""
    from oppo_jax.models import segment_attention as sa

    rows, width, heads, kv, dh, dtype = (
        (2, 64, 4, 2, 16, jnp.float32) if smoke else (4, 1536, 28, 4, 128, jnp.bfloat16)
    )
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (rows, width, heads, dh), dtype)
    k, v = (jax.random.normal(key, (rows, width, kv, dh), dtype) for key in keys[1:3])
    seg = jnp.asarray(_packed_segments(rows, width))
    real = (seg >= 0)[:, :, None, None]
    weight = jax.random.normal(keys[3], q.shape, jnp.float32) * real  # padding is read by none
    same = (seg[:, None, :, None] == seg[:, None, None, :]) & (seg >= 0)[:, None, :, None]

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * weight)

    kernel = lambda q, k, v: sa.segment_attention(q, k, v, seg)  # noqa: E731
    xla = lambda q, k, v: xla_attention(q, k, v, same, True)  # noqa: E731
    both = {name: jax.jit(jax.value_and_grad(functools.partial(loss, fn), (0, 1, 2)))
            for name, fn in (("kernel", kernel), ("xla", xla))}  # fmt: skip
    out = jax.jit(kernel)(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out = xla(*f32)
    _, got = both["kernel"](q, k, v)
    _, want = jax.jit(jax.value_and_grad(functools.partial(loss, xla), (0, 1, 2)))(*f32)
    errors = {"out": (out * real, want_out * real)}
    errors |= {f"d{n}": (g, w) for n, g, w in zip("qkv", got, want, strict=True)}
    row = {
        f"{name}_error": float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
        / max(float(jnp.max(jnp.abs(b))), 1e-30)
        for name, (a, b) in errors.items()
    }
    if not smoke:
        t_kernel = _median_s(both["kernel"], q, k, v, calls=10)
        t_xla = _median_s(both["xla"], q, k, v, calls=10)
        row |= {"segment_s": t_kernel, "xla_s": t_xla, "xla_over_segment": t_xla / t_kernel}
    return row


def _median_s(fn, *args, calls: int) -> float:
    jax.block_until_ready(fn(*args))  # compiled and warm
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no timing")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.smoke:
        slots, heads, kv, dh, capacity, widths, dtype = 6, 4, 2, 16, 64, (32, 64), jnp.float32
    else:
        slots, heads, kv, dh, capacity, widths, dtype = (
            120,
            28,
            4,
            128,
            4096,
            (1024, 4096),
            jnp.bfloat16,
        )
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (2, slots, kv, capacity, dh)
    k_cache = jax.random.normal(keys[0], shape, dtype)
    v_cache = jax.random.normal(keys[1], shape, dtype)
    q = jax.random.normal(keys[2], (slots, 1, heads, dh), dtype)
    report = {"device": str(jax.devices()[0]), "smoke": args.smoke, "widths": {}}
    for width in widths:
        drawn = jax.random.randint(keys[3], (slots,), 1, width + 1)
        lengths = jnp.where(jnp.arange(slots) % 2 == 0, drawn, 0).astype(jnp.int32)
        ragged = jax.jit(rd.ragged_decode_attention, static_argnums=5)
        try:
            got = ragged(q, k_cache, v_cache, jnp.int32(1), lengths, width)
        except Exception as e:  # noqa: BLE001 - any compile or launch failure is the finding
            print(f"ragged_check: the ragged kernel failed at width {width}: {e}", file=sys.stderr)
            return 1
        want = _reference(q, k_cache, v_cache, lengths, width)
        error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
        row = {
            "max_abs_error": error,
            "keys_read_ragged_over_dense": float(lengths.sum() / (slots * width)),
        }
        if not args.smoke:
            dense = jax.jit(_dense, static_argnums=4)
            t_ragged = _median_s(
                ragged, q, k_cache, v_cache, jnp.int32(1), lengths, width, calls=20
            )
            t_dense = _median_s(dense, q, k_cache, v_cache, lengths, width, calls=20)
            row |= {"ragged_s": t_ragged, "xla_s": t_dense, "xla_over_ragged": t_dense / t_ragged}
        report["widths"][str(width)] = row
        print(f"ragged_check: width {width}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()))
        if error > TOLERANCE:
            print(f"ragged_check: max abs error {error:.3g} > {TOLERANCE}", file=sys.stderr)
            return 1
    try:
        row = _segment_check(args.smoke)
    except Exception as e:  # noqa: BLE001 - any compile or launch failure is the finding
        print(f"ragged_check: the segment attention failed: {e}", file=sys.stderr)
        return 1
    report["segment"] = row
    print("ragged_check: segment attention: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()))
    worst = max(v for name, v in row.items() if name.endswith("_error"))
    if worst > TOLERANCE:
        print(f"ragged_check: segment attention error {worst:.3g} > {TOLERANCE}", file=sys.stderr)
        return 1
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
