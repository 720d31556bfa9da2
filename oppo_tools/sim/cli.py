"""``oppo-jax sim``: predicted step time of sync / intra / inter / oppo, and the best (C, Δ).

The cost model comes from measurements (``--bench`` bench.json with timelines, or ``--metrics``
a run's metrics.jsonl, a rougher fit) or from a roofline projection (``--project
qwen2.5-7b:gh200``, labelled PROJECTION). A projection takes the run's settings (B, G, prompt
and response widths, PPO epochs and minibatches, trained models and scorers, C, Δ, placement,
chips) from ``--config`` (with ``--set``), else from flags whose defaults it states, prints
them with every table, and ends with a regime map: OPPO's speedup over PPO epochs × median
response length, or, for a run of groups (G > 1: the GRPO family), the group map: intra, inter
and oppo's speedups over Δ groups × median response length. ``--engine`` picks what the kernels
compute (``built``: this engine as it runs now, with the token-proportional engine changes that
have landed; ``active``: token-proportional; ``fixed``: the fixed-shape engine before those
changes; ``padded``: the one before the decode stopped at the cut); ``--with`` switches the
remaining changes on (a what-if).
Lengths come from a file (JSON list, or numbers separated by spaces, commas or newlines),
``bench`` (the measured batches of the bench's sync schedule, in order), ``demo`` (the demo
task's long-tailed mixture) or ``longtail`` (log-normal, median 103, σ 0.94, capped at R).
``--validate`` checks the simulator against a bench: fitted on some steps (even ones, or the
first half), it predicts the median step times of the others.
A projection also prices every row busy (issue 44; the engine runs the same policy, docs/REFILL.md):
continuous refill, shared prompt prefill, ``keep`` vs ``replay``, bounded staleness, each beside
its bound, and the regime map with and without refill (``--refill-every``, ``--slots``,
``--shared-prefill``, ``--carry-kv``, ``--max-staleness``, ``--on-stale``; ``--no-refill``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from oppo_jax.base.errors import ConfigError
from oppo_jax.base.help_text import plain
from oppo_tools.sim.engines import ACTIVE, BUILT, ENGINES, FEATURES, Engine, recorded_engine
from oppo_tools.sim.events import PLACEMENTS, SCHEDULES, Workload, compare, recommend
from oppo_tools.sim.fitting import bench_records, calibrate, calibrate_from_bench
from oppo_tools.sim.group_map import format_group_map, group_regime_map
from oppo_tools.sim.lengths import LogNormal, demo_lengths, describe, longtail_lengths, read_lengths
from oppo_tools.sim.model import CostModel
from oppo_tools.sim.project import build_projection, format_regime_map, regime_map
from oppo_tools.sim.refill_report import add_args as add_refill_args
from oppo_tools.sim.refill_report import report as report_refill
from oppo_tools.sim.validation import SPLITS, format_table, validate

__all__ = ["demo_lengths", "longtail_lengths", "main", "read_lengths"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oppo-jax sim", description=plain(__doc__))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--bench", help="bench.json of `oppo-jax bench` (with per-step timelines)")
    src.add_argument("--metrics", help="metrics.jsonl of a run (its config.yaml is read too)")
    src.add_argument("--project", help="MODEL:HARDWARE roofline PROJECTION, e.g. qwen2.5-7b:gh200")
    p.add_argument("--config", help="--project: the run config whose settings to project")
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="--project: overrides of --config, as `oppo-jax train --set`",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="with --bench: fit on some steps, predict the others",
    )
    p.add_argument(
        "--fit-schedules",
        default=",".join(SCHEDULES),
        help="--validate: the schedules whose steps the fit may use",
    )
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="alternate",
        help="--validate: fit on even steps, test on odd (alternate), or fit on "
        "the first half, test on the second (halves)",
    )
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default=None,
        help="what the kernels compute (default: the engine that recorded --bench; "
        "built for --metrics; built and active for --project)",
    )
    p.add_argument(
        "--with",
        dest="features",
        default="",
        help=f"features switched on (what-if), comma-separated: {', '.join(FEATURES)}; or all",
    )
    p.add_argument("--batch", type=int, default=None, help="B, sequences per PPO batch")
    p.add_argument("--lengths", default=None, help="file, 'bench', 'demo' or 'longtail'")
    p.add_argument("--median", type=float, default=None, help="--project: log-normal median")
    p.add_argument("--sigma", type=float, default=None, help="--project: log-normal σ (0.94)")
    p.add_argument("--placement", choices=PLACEMENTS, default=None)
    p.add_argument("--chunk", type=int, default=None, help="C to compare at")
    p.add_argument("--delta", type=int, default=None, help="Δ to compare at (groups when G > 1)")
    p.add_argument("--candidates-c", default="64,128,256,512", help="Cs tried, and its own")
    p.add_argument("--candidates-delta", default="0,2,4,8,16", help="Δs tried (≤ B/G), and its own")
    p.add_argument("--prompt-len", type=int, default=None, help="P, prompt tokens")
    p.add_argument("--capacity", type=int, default=None, help="R, response capacity")
    p.add_argument("--epochs", type=int, default=None, help="--project: PPO epochs")
    p.add_argument("--minibatches", type=int, default=None, help="--project: per epoch")
    p.add_argument("--trained", default=None, help="--project: trained models, e.g. actor,critic")
    p.add_argument("--lora-rank", type=int, default=None, help="--project: LoRA rank (0: none)")
    p.add_argument(
        "--group-size", type=int, default=None, help="--project: G responses per prompt (1)"
    )
    p.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--project: the reference scores (β > 0); --no-reference: β = 0",
    )
    p.add_argument(
        "--reward-model",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--project: a reward model scores; --no-reward-model: reward functions only",
    )
    p.add_argument(
        "--regime-map",
        choices=("epochs", "groups"),
        default=None,
        help="--project: PPO epochs × median, or Δ groups × median (default: groups when G > 1)",
    )
    p.add_argument("--steps", type=int, default=None, help="simulated steps per schedule (200)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-deferrals", type=int, default=None)
    p.add_argument("--mfu", type=float, default=None, help="prefill/update MFU (0.5)")
    p.add_argument("--chips", type=int, default=None, help="chips per group (config's mesh, 1)")
    p.add_argument("--no-regime-map", action="store_true", help="--project: skip the map")
    p.add_argument("--skip-steps", type=int, default=2, help="--metrics: first steps left out")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _engine(args, default: Engine, built: Engine = BUILT) -> Engine:
    base = (built if args.engine == "built" else ENGINES[args.engine]) if args.engine else default
    return base.with_features(_feature_names(args))


def _feature_names(args) -> tuple[str, ...]:
    """``--with``'s features (all of ``FEATURES`` for "all")."""
    names = tuple(x.strip() for x in args.features.split(",") if x.strip())
    return FEATURES if "all" in names else names


def _print_table(cost: CostModel, engine: Engine, table: dict, rec: dict, tag: str) -> None:
    print(f"{tag}engine: {engine.describe()}")
    print(f"{tag}{'schedule':>8}  {'step mean s':>12}  {'median s':>10}  {'speedup':>8}  busy")
    for name in SCHEDULES:
        s = table["schedules"][name]
        speed = table["speedup_vs_sync"].get(name, 1.0)
        busy = ", ".join(f"{g} {v:.0%}" for g, v in sorted(s["busy_fraction"].items()))
        print(
            f"{tag}{name:>8}  {s['step_time_mean_s']:>12.4g}  {s['step_time_median_s']:>10.4g}"
            f"  {speed:>7.2f}×  {busy}"
        )
    cs, ds = (sorted({g[k] for g in rec["grid"]}) for k in ("chunk_size", "delta"))
    print(  # the table's mean (its row's C and Δ are among the candidates), sync at the best C
        f"{tag}best (C, Δ) for {rec['schedule']} of C {_csv(cs)} × Δ {_csv(ds)}: "
        f"C={rec['chunk_size']} Δ={rec['delta']}: {rec['step_time_s']:.4g} s/step mean, "
        f"{rec['speedup_vs_sync']:.2f}× vs sync at C={rec['chunk_size']}"
    )


def _csv(xs) -> str:
    return ",".join(str(x) for x in xs)


class _Progress:
    """Progress lines on stderr while a projection works (with its regime map it takes
    minutes, silent before): what starts now, and the seconds since the start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, what: str) -> None:
        seconds = time.perf_counter() - self.start
        print(f"oppo-jax sim: {what} ({seconds:.0f} s)", file=sys.stderr, flush=True)


def _tables(cost: CostModel, engines, workload: Workload, lengths, args, progress=None) -> dict:
    """Per engine: the four schedules at the workload's (C, Δ) and the best (C, Δ)."""
    tag = "PROJECTION " if cost.label.startswith("PROJECTION") else ""
    out = {}
    for engine in engines:
        cands = (_ints(args.candidates_c), _ints(args.candidates_delta))
        if progress:
            progress(f"engine {engine.name}: the four schedules, then the best (C, Δ)")
        rec = recommend(cost, workload, lengths, engine, *cands)
        table = compare(cost, workload, lengths, engine)
        _print_table(cost, engine, table, rec, tag)
        out[engine.name] = {"engine": engine.to_dict(), **table, "recommendation": rec}
    return out


def _project(args) -> dict:
    """--project: settings, a table per engine, the regime map."""
    lengths = None if args.median is None else LogNormal(args.median, args.sigma or 0.94)
    trained = None if args.trained is None else tuple(args.trained.split(","))
    given = {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "capacity": args.capacity,
        "epochs": args.epochs,
        "minibatches": args.minibatches,
        "trained": trained,
        "chunk": args.chunk,
        "delta": args.delta,
        "placement": args.placement,
        "max_deferrals": args.max_deferrals,
        "chips": args.chips,
        "mfu": args.mfu,
        "steps": args.steps,
        "seed": args.seed,
        "lengths": lengths,
        "lora_rank": args.lora_rank,
        "group_size": args.group_size,
        "reference": args.reference,
        "reward_model": args.reward_model,
    }
    progress = _Progress()
    proj = build_projection(args.project, args.config, args.set, given)
    cost = proj.cost_model()
    # "built" is the engine as built on the projection's hardware (engines.built_for), with
    # --with's what-ifs in every table, map and refill row
    if not args.engine:
        proj = dataclasses.replace(proj, features=_feature_names(args))
    built = proj.built_engine
    engines = [_engine(args, built, built)] + ([] if args.engine else [ACTIVE])
    w = proj.workload
    progress(f"projecting {args.project}: {len(engines)} engine(s), {w.steps} steps a schedule")
    drawn = proj.lengths.sample(seed=w.seed or 0)
    lengths = drawn if args.lengths is None else read_lengths(args.lengths, w.seed or 0)
    print(f"cost model: {cost.label}")
    print("PROJECTION settings (each with where it came from):")
    print("\n".join(proj.lines()))
    print(f"PROJECTION lengths simulated: {describe(lengths)}")
    out = {"projection": True, "settings": _settings_json(proj), "cost_model": cost.to_dict()}
    out["engines"] = _tables(cost, engines, w, lengths, args, progress)
    if not args.no_regime_map:
        kind = args.regime_map or ("groups" if w.group_size > 1 else "epochs")
        if kind == "groups":
            out["regime_map"] = group_regime_map(proj, engines, progress=progress)
            print("\n".join(format_group_map(out["regime_map"])))
        else:
            out["regime_map"] = regime_map(proj, engines, progress=progress)
            print("\n".join(format_regime_map(out["regime_map"])))
    if not args.no_refill:  # every row busy: what refill buys, and its regime map
        out["refill"] = report_refill(args, proj, progress)
    progress("done")
    return out


def _settings_json(proj) -> dict:
    return {
        "spec": proj.spec,
        "workload": dataclasses.asdict(proj.workload),
        "train": dataclasses.asdict(proj.train),
        "lengths": dataclasses.asdict(proj.lengths),
        "chips": proj.chips,
        "mfu": proj.mfu,
        "sources": dict(proj.sources),
    }


def _fitted(args, bench: dict | None) -> tuple[CostModel, Engine, dict]:
    """(cost model, engine, run config) fitted to --bench (as the engine that recorded it) or
    to --metrics (stage sums; the engine as built)."""
    if bench is not None:
        recs = [r for rs in bench_records(bench).values() for r in rs if "trace" in r]
        engine = _engine(args, recorded_engine([r["trace"] for r in recs]) if recs else BUILT)
        return calibrate_from_bench(bench), engine, bench.get("workload", {}).get("config", {})
    path = Path(args.metrics)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = records[args.skip_steps :]  # the first steps compile
    cfg = _run_config(path)
    rollout, pipeline = cfg.get("rollout", {}), cfg.get("pipeline", {})
    streamed = pipeline.get("mode", "oppo") in ("intra", "oppo")
    batch, prompt = rollout.get("batch_size", args.batch), int(rollout.get("max_prompt_len", 0))
    return calibrate(records, batch, prompt, streamed), _engine(args, BUILT), cfg


def _measured(args, bench: dict | None) -> dict:
    """--bench or --metrics: a fitted cost model and the run's own settings."""
    cost, engine, cfg = _fitted(args, bench)
    rollout, pipeline = cfg.get("rollout", {}), cfg.get("pipeline", {})
    batch = args.batch or rollout.get("batch_size")
    if not batch:
        raise ValueError("--batch is needed (no run config gives it)")
    spec = args.lengths or ("bench" if bench else "demo")
    sync_records = bench_records(bench).get("sync") if bench else None
    lengths = read_lengths(spec, args.seed or 0, sync_records)

    def given(flag, key: str, default):
        return type(default)(pipeline.get(key, rollout.get(key, default)) if flag is None else flag)

    workload = Workload(
        batch=int(batch),
        chunk_size=given(args.chunk, "chunk_size", 128),
        delta=given(args.delta, "overcommit", 0),
        prompt_len=given(args.prompt_len, "max_prompt_len", 0),
        capacity=args.capacity or rollout.get("max_response_len"),
        placement=given(args.placement, "placement", "disaggregated"),
        max_deferrals=given(args.max_deferrals, "max_deferrals", 2),
        steps=args.steps or 200,
        seed=args.seed or 0,
        group_size=int(rollout.get("group_size", 1)),
    )
    print(f"cost model: {cost.label}")
    print(
        f"lengths: {describe(lengths)}; B={workload.batch}, prompt {workload.prompt_len} "
        f"tokens, {workload.placement}, C={workload.chunk_size}, Δ={workload.delta}"
    )
    tables = _tables(cost, [engine], workload, lengths, args)
    return {
        "projection": False,
        "cost_model": cost.to_dict(),
        "workload": dataclasses.asdict(workload),
        "engines": tables,
    }


def _run_config(path: Path) -> dict:
    """The run's config.yaml beside a metrics.jsonl, or {}."""
    cfg = path.parent / "config.yaml"
    if not cfg.exists():
        return {}
    import yaml

    return yaml.safe_load(cfg.read_text()) or {}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``oppo-jax sim``: print the tables and the recommendation."""
    parser = _parser()
    add_refill_args(parser)
    args = parser.parse_args(argv)
    try:
        if (args.config or args.set) and not args.project:
            raise ValueError("--config and --set go with --project (a measured run has its own)")
        bench = json.loads(Path(args.bench).read_text()) if args.bench else None
        if args.validate:
            if bench is None:
                raise ValueError("--validate needs --bench")
            out = validate(bench, tuple(_schedule_names(args.fit_schedules)), args.split)
            print(format_table(out))
        elif args.project:
            out = _project(args)
        elif bench is not None or args.metrics:
            out = _measured(args, bench)
        else:
            raise ValueError("give --project, --bench or --metrics")
    except (ValueError, KeyError, OSError, ConfigError) as e:
        print(f"oppo-jax sim: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2, default=_json_default))
        print(f"wrote {args.out}")
    return 0


def _json_default(x):
    return x.tolist() if isinstance(x, np.ndarray) else str(x)


def _schedule_names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise ValueError(f"--fit-schedules {text!r}: expected names from {list(SCHEDULES)}")
    return names


if __name__ == "__main__":
    sys.exit(main())
