"""Scoring at real widths and kept frozen-scorer caches, before/after, side by side in one process.

    .venv/bin/python benchmarks/scoring_kept_bench.py configs/bench_longtail_cpu.yaml --steps 6

Four lanes from one prepared run, interleaved step by step (who goes first rotates):
``sync`` scoring every slot R wide (before) and packed (after); ``oppo`` re-prefilling the
frozen scorers' carried rows (before) and keeping their caches (after). Per step it records
the scorers' stage times (prefill + score, from the timeline), the step's wall time, the
scoring and admission tokens computed / real (the work ledger) and the carried rows whose
frozen-scorer prefill was skipped. Prints medians and per-step paired ratios as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from oppo_jax.cli import _ensure_cpu_devices
from oppo_jax.config import load_config

LANES = {  # name: (schedule, engine switches)
    "sync R-wide": ("sync", {"packed_scoring": False}),
    "sync packed": ("sync", {"packed_scoring": True}),
    "oppo re-prefill": ("oppo", {"keep_frozen_caches": False}),
    "oppo kept": ("oppo", {"keep_frozen_caches": True}),
}
SCORERS = ("reference", "critic", "reward")


def _scoring_s(stage_times: dict) -> float:
    """Seconds the scorers were busy: their admission prefills and their scoring calls."""
    return sum(
        t for name, t in stage_times.items() if name.split(" ")[-1] in SCORERS and " " in name
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    cfg = load_config(args.config)
    _ensure_cpu_devices(cfg)  # fake CPU devices for the placement, before JAX loads
    _run(cfg, args)


def _run(cfg, args) -> None:
    import jax
    import jax.numpy as jnp

    import oppo_jax.pipeline.step as step_module
    from oppo_jax.pipeline.host_state import HostState
    from oppo_jax.pipeline.schedule import SCHEDULES
    from oppo_jax.pipeline.timeline import Timeline
    from oppo_jax.run.setup import prepare_run
    from oppo_jax.train import train_step

    ctx, state = prepare_run(cfg, progress=False)
    lanes = []
    for name, (schedule, switches) in LANES.items():
        lane_ctx = dataclasses.replace(ctx, engine=dataclasses.replace(ctx.engine, **switches))
        host = HostState.fresh(cfg, SCHEDULES[schedule], lane_ctx.prompt_iterator())
        lane_state = jax.tree.map(jnp.copy, state)  # each lane's update donates its own
        lanes.append([name, SCHEDULES[schedule], lane_ctx, host, lane_state])
    reused = []  # kept rows restored per call (spy on the step's restore)
    real_restore = step_module.restore_rows

    def spy(state, kept, n):
        reused.append(n)
        return real_restore(state, kept, n)

    step_module.restore_rows = spy
    records = {name: [] for name in LANES}
    timeline = Timeline()
    for step in range(args.warmup + args.steps):
        order = lanes[step % len(lanes) :] + lanes[: step % len(lanes)]
        for lane in order:
            name, schedule, lane_ctx, host, lane_state = lane
            reused.clear()
            lane[4], record, result = train_step(lane_ctx, schedule, host, lane_state, timeline)
            if step < args.warmup:
                continue
            work = result.work
            records[name].append({
                "scoring_s": _scoring_s(result.stage_time_s),
                "step_s": result.wall_s,
                "scoring_computed": work.computed.get("scoring", 0),
                "scoring_real": work.real.get("scoring", 0),
                "admission_computed": work.computed.get("admission", 0),
                "frozen_rows_kept": 2 * (reused[0] if reused else 0),  # reference + reward
                "carried_in": int((result.slots.deferrals > 0).sum()),
            })  # fmt: skip
    print(json.dumps({"config": args.config, "steps": args.steps, "lanes": _summary(records)},
                     indent=2))  # fmt: skip


def _summary(records: dict) -> dict:
    """Medians per lane, pooled scoring efficiency, and the paired before/after ratios."""
    summary = {}
    for name, rs in records.items():
        summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary[name]["scoring_efficiency"] = sum(r["scoring_real"] for r in rs) / max(
            1, sum(r["scoring_computed"] for r in rs)
        )
        summary[name]["frozen_prefills_saved_total"] = sum(r["frozen_rows_kept"] for r in rs)
    for before, after in (("sync R-wide", "sync packed"), ("oppo re-prefill", "oppo kept")):
        pairs = zip(records[before], records[after], strict=True)
        ratios = [(a["scoring_s"] / b["scoring_s"], a["step_s"] / b["step_s"]) for a, b in pairs]
        summary[f"{after} vs {before}"] = {
            "scoring_time_ratio_median": statistics.median(r[0] for r in ratios),
            "step_time_ratio_median": statistics.median(r[1] for r in ratios),
        }
    return summary


if __name__ == "__main__":
    main()
