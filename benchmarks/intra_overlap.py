"""Sync vs OPPO intra-step overlap (no overcommit) on the demo workload, side by side.

Both schedules run in one process on two fake CPU devices (generation/training on device 0,
the three scorers on device 1), step by step interleaved from identical states with the same
prompts and keys. With Δ = 0 the two produce the same batches and updates, so every step is
the same workload under both schedules. Reports median step time, the time until the batch
is ready (rollout + scoring), their ratios, and each device group's busy fraction.

    python benchmarks/intra_overlap.py --steps 12 [--set key=value ...] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


class iter_of:  # noqa: N801 (a tiny prompt source over a fixed list)
    def __init__(self, pairs):
        self.pairs = list(pairs)

    def take(self, k):
        taken, self.pairs = self.pairs[:k], self.pairs[k:]
        return taken


def _time_to_batch(result) -> float:
    starts = [e.start for e in result.events if e.stage == "build batch"]
    return starts[0] if starts else result.wall_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="measured steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps (compilation)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from oppo_jax.config import load_config
    from oppo_jax.pipeline.carry import CarryBuffer
    from oppo_jax.pipeline.host_state import update_key
    from oppo_jax.pipeline.schedule import SCHEDULES
    from oppo_jax.pipeline.step import StepPlan, run_step
    from oppo_jax.pipeline.timeline import Timeline
    from oppo_jax.run.setup import prepare_run

    cfg = load_config(None, [
        "pipeline.placement=disaggregated", "mesh.scoring_devices=1", "pipeline.overcommit=0",
        "pipeline.adaptive_overcommit=false",
        *args.overrides,
    ])  # fmt: skip
    ctx, state = prepare_run(cfg)
    # "oppo" here is OPPO without overcommit: the intra schedule.
    schedules = {"sync": SCHEDULES["sync"], "oppo": SCHEDULES["intra"]}
    states = {mode: jax.tree.map(jnp.copy, state) for mode in schedules}
    prompts = ctx.prompt_iterator()
    timeline = Timeline()
    rows = {mode: [] for mode in states}
    b, chunk = cfg.rollout.batch_size, cfg.pipeline.chunk_size
    for step in range(args.warmup + args.steps):
        pairs = prompts.take(b)
        plan = StepPlan(step, b, 0, b, chunk, cfg.ppo.kl_coef, update_key(cfg.seed, step))
        order = ("sync", "oppo") if step % 2 == 0 else ("oppo", "sync")
        for mode in order:
            states[mode], _, result = run_step(
                ctx.engine, schedules[mode], plan, states[mode], CarryBuffer(), iter_of(pairs),
                timeline,
            )  # fmt: skip
            if step >= args.warmup:
                rows[mode].append({
                    "step_time_s": result.wall_s, "time_to_batch_s": _time_to_batch(result),
                    "busy_fraction": result.busy_fraction,
                    "response_len_mean": float(result.response_len.mean()),
                })  # fmt: skip
    summary = {"config_overrides": args.overrides, "chunk_size": cfg.pipeline.chunk_size}
    for mode, recs in rows.items():
        summary[mode] = {
            "step_time_median_s": statistics.median(r["step_time_s"] for r in recs),
            "time_to_batch_median_s": statistics.median(r["time_to_batch_s"] for r in recs),
            "busy_fraction": {
                g: statistics.median(r["busy_fraction"].get(g, 0.0) for r in recs)
                for g in ("generation", "scoring")
            },
            "response_len_mean": statistics.mean(r["response_len_mean"] for r in recs),
        }
    s, o = summary["sync"], summary["oppo"]
    summary["step_time_ratio_sync_over_oppo"] = s["step_time_median_s"] / o["step_time_median_s"]
    summary["time_to_batch_ratio_sync_over_oppo"] = (
        s["time_to_batch_median_s"] / o["time_to_batch_median_s"]
    )
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
