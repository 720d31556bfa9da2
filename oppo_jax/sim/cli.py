"""``oppo-jax sim``: predicted step time of sync / intra / inter / oppo, and the best (C, Δ).

The cost model comes from measurements (``--bench`` bench.json with timelines, or
``--metrics`` a run's metrics.jsonl, a rougher fit) or from a roofline projection
(``--project qwen2.5-7b:gh200``, labelled PROJECTION). Lengths come from a file (JSON list,
or numbers separated by spaces, commas or newlines), ``bench`` (the measured batches of the
bench's sync schedule, in order), ``demo`` (the demo task's long-tailed mixture) or
``longtail`` (log-normal, median 103, p99 ≈ 920, capped at 1024 tokens). ``--validate``
checks the simulator against the bench: fitted on some steps (even ones, or the first half),
it predicts the median step times of the others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from oppo_jax.sim.events import PLACEMENTS, SCHEDULES, compare, recommend
from oppo_jax.sim.fitting import bench_records, calibrate, calibrate_from_bench
from oppo_jax.sim.model import CostModel, project_cost_model
from oppo_jax.sim.validation import SPLITS, format_table, validate


def demo_lengths(n: int = 10_000, seed: int = 0, cap: int = 64) -> np.ndarray:
    """Response lengths like the demo task's: 85% geometric(0.12), 15% geometric(0.05), ≤ cap."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.15
    words = np.minimum(rng.geometric(np.where(long, 0.05, 0.12)), cap - 1)
    return words + 1  # the closing <eos> is a token too


def longtail_lengths(n: int = 10_000, seed: int = 0, cap: int = 1024) -> np.ndarray:
    """Log-normal response lengths, median 103 and σ 0.94 (p99 ≈ 920), capped at ``cap``."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(103.0), 0.94, n)), 1, cap).astype(np.int64)


def read_lengths(spec: str, seed: int = 0, bench: dict | None = None) -> np.ndarray:
    """``demo``, ``longtail``, ``bench`` or a file of response lengths (JSON or separated)."""
    if spec == "demo":
        return demo_lengths(seed=seed)
    if spec == "longtail":
        return longtail_lengths(seed=seed)
    if spec == "bench":
        if bench is None:
            raise ValueError("--lengths bench needs --bench")
        recs = bench_records(bench).get("sync", [])
        return np.asarray([n for r in recs for n in r.get("trace", {}).get("lengths", [])])
    text = Path(spec).read_text()
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        values = text.replace(",", " ").split()
    return np.asarray([int(v) for v in values], np.int64)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oppo-jax sim", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--bench", help="bench.json of `oppo-jax bench` (with per-step timelines)")
    src.add_argument("--metrics", help="metrics.jsonl of a run (its config.yaml is read too)")
    src.add_argument("--project", help="MODEL:HARDWARE roofline PROJECTION, e.g. qwen2.5-7b:gh200")
    p.add_argument(
        "--validate",
        action="store_true",
        help="with --bench: fit on the first half of the steps, predict the second",
    )
    p.add_argument("--fit-schedules", default=",".join(SCHEDULES),
                   help="--validate: the schedules whose steps the fit may use")  # fmt: skip
    p.add_argument("--split", choices=SPLITS, default="alternate",
                   help="--validate: fit on even steps, test on odd (alternate), or fit on "
                   "the first half, test on the second (halves)")  # fmt: skip
    p.add_argument("--batch", type=int, default=None, help="B, sequences per PPO batch")
    p.add_argument("--lengths", default=None, help="file, 'bench', 'demo' or 'longtail'")
    p.add_argument("--placement", choices=PLACEMENTS, default=None,
                   help="default: the run's, else disaggregated")  # fmt: skip
    p.add_argument("--chunk", type=int, default=None, help="C to compare at (default: best)")
    p.add_argument("--delta", type=int, default=None, help="Δ to compare at (default: best)")
    p.add_argument("--candidates-c", default="64,128,256,512")
    p.add_argument("--candidates-delta", default="0,2,4,8,16")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: run's)")
    p.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="R, response capacity (default: run's, else the longest length)",
    )
    p.add_argument("--steps", type=int, default=200, help="simulated steps per schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-deferrals", type=int, default=2)
    p.add_argument("--mfu", type=float, default=0.5, help="prefill/update MFU of a projection")
    p.add_argument("--chips", type=int, default=1, help="chips per group of a projection")
    p.add_argument("--engine", choices=("auto", "padded", "active"), default="auto",
                   help="padded: fixed-shape decode (this project's JAX engine; default for "
                   "measurements); active: finished slots stop costing (default for "
                   "projections)")  # fmt: skip
    p.add_argument("--skip-steps", type=int, default=2, help="--metrics: first steps left out")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def _run_config(path: Path) -> dict:
    """The run's config.yaml beside a metrics.jsonl, or {}."""
    cfg = path.parent / "config.yaml"
    if not cfg.exists():
        return {}
    import yaml

    return yaml.safe_load(cfg.read_text()) or {}


def _cost_model(args, bench: dict | None) -> tuple[CostModel, dict]:
    """(cost model, run config or {}) from --bench, --metrics or --project."""
    padded = {"auto": None, "padded": True, "active": False}[args.engine]
    if bench is not None:
        cfg = bench.get("workload", {}).get("config", {})
        return calibrate_from_bench(bench, padded_decode=padded is not False), cfg
    if args.metrics:
        path = Path(args.metrics)
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        records = records[args.skip_steps :]  # the first steps compile
        cfg = _run_config(path)
        rollout, pipeline = cfg.get("rollout", {}), cfg.get("pipeline", {})
        cost = calibrate(
            records, rollout.get("batch_size", args.batch), int(rollout.get("max_prompt_len", 0)),
            streamed=pipeline.get("mode", "oppo") == "oppo", padded_decode=padded is not False,
        )  # fmt: skip
        return cost, cfg
    if not args.batch:
        raise ValueError("--batch is needed (no run config gives it)")
    cost = project_cost_model(args.project or "qwen2.5-7b:gh200", args.batch, args.mfu, args.chips)
    if padded:
        cost = CostModel(**{**cost.to_dict(), "padded_decode": True})
    return cost, {}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _print_table(cost: CostModel, lengths, table: dict, rec: dict, common: dict) -> str:
    tag = "PROJECTION " if cost.label.startswith("PROJECTION") else ""
    print(f"cost model: {cost.label}")
    print(f"lengths: n={lengths.size} mean={lengths.mean():.1f} median={np.median(lengths):g} "
          f"p99={np.percentile(lengths, 99):g} max={lengths.max()}; B={common['batch']}, prompt "
          f"{common['prompt_len']} tokens, {common['placement']}, C={table['chunk_size']}, "
          f"Δ={table['delta']}")  # fmt: skip
    print(f"{tag}{'schedule':>8}  {'step mean s':>12}  {'median s':>10}  {'speedup':>8}  busy")
    for name in SCHEDULES:
        s = table["schedules"][name]
        speed = table["speedup_vs_sync"].get(name, 1.0)
        busy = ", ".join(f"{g} {v:.0%}" for g, v in sorted(s["busy_fraction"].items()))
        print(f"{tag}{name:>8}  {s['step_time_mean_s']:>12.4g}  {s['step_time_median_s']:>10.4g}"
              f"  {speed:>7.2f}×  {busy}")  # fmt: skip
    print(f"{tag}recommendation ({rec['schedule']}): C={rec['chunk_size']} Δ={rec['delta']}: "
          f"{rec['step_time_s']:.4g} s/step, {rec['speedup_vs_sync']:.2f}× vs sync")  # fmt: skip
    return tag


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``oppo-jax sim``: print the schedule table and the recommendation."""
    args = _parser().parse_args(argv)
    try:
        bench = json.loads(Path(args.bench).read_text()) if args.bench else None
        if args.validate:
            if bench is None:
                raise ValueError("--validate needs --bench")
            result = validate(bench, tuple(_schedule_names(args.fit_schedules)), args.split)
            print(format_table(result))
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2))
            return 0
        cost, cfg = _cost_model(args, bench)
        lengths = read_lengths(args.lengths or ("bench" if bench else "demo"), args.seed, bench)
    except (ValueError, KeyError, OSError) as e:
        print(f"oppo-jax sim: {e}", file=sys.stderr)
        return 2
    rollout, pipeline = cfg.get("rollout", {}), cfg.get("pipeline", {})
    batch = args.batch or rollout.get("batch_size")
    if not batch:
        print("oppo-jax sim: --batch is needed (no run config gives it)", file=sys.stderr)
        return 2
    common = {
        "batch": int(batch),
        "placement": args.placement or pipeline.get("placement", "disaggregated"),
        "prompt_len": int(rollout.get("max_prompt_len", 0) if args.prompt_len is None
                          else args.prompt_len),
        "capacity": args.capacity or rollout.get("max_response_len"),
    }  # fmt: skip
    sim = {"steps": args.steps, "seed": args.seed, "max_deferrals": args.max_deferrals,
           "placement": common["placement"], "prompt_len": common["prompt_len"],
           "capacity": common["capacity"]}  # fmt: skip
    rec = recommend(cost, lengths, common["batch"], _ints(args.candidates_c),
                    _ints(args.candidates_delta), **sim)  # fmt: skip
    chunk = args.chunk or rec["chunk_size"]
    delta = rec["delta"] if args.delta is None else args.delta
    table = compare(cost, lengths, common["batch"], chunk_size=chunk, delta=delta, **sim)
    table |= {"chunk_size": chunk, "delta": delta}
    tag = _print_table(cost, lengths, table, rec, common)
    if args.out:
        out = {"projection": bool(tag), "cost_model": cost.to_dict(), **common, **table,
               "recommendation": rec}  # fmt: skip
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
    return 0


def _schedule_names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise ValueError(f"--fit-schedules {text!r}: expected names from {list(SCHEDULES)}")
    return names


if __name__ == "__main__":
    sys.exit(main())
