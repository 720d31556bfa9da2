"""``oppo-jax bench``: one workload under sync, intra, inter and oppo, side by side, one process.

The four schedules differ in two switches: whether the scorers stream the actor's chunks
(intra-step overlap) and whether B + Δ sequences start each step with stragglers carried
(inter-step overlap). Steps of all schedules and seeds are interleaved, so slow periods of
the machine hit all of them alike. Results go to ``DIR/bench.json`` and plots beside it,
with each schedule's ideal bound and ``sync``'s stage shares (``oppo_tools.bench_bounds``).
Without a gold score (random models) time to target is None and ``no_gold`` says why.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from oppo_jax.base.errors import InputError
from oppo_jax.config import Config, to_dict
from oppo_jax.pipeline import warmup as warm
from oppo_jax.pipeline.host_state import HostState, sampling_key
from oppo_jax.pipeline.schedule import SCHEDULES, Schedule
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.run.plots import plot_gantt, pyplot
from oppo_jax.run.setup import RunContext, prepare_run
from oppo_jax.train import train_step
from oppo_tools.bench_bounds import ideal_bound, pooled_efficiency, stage_shares
from oppo_tools.sim.trace import step_trace

MOVING_AVERAGE = 5  # steps in the gold score's moving average (time to target)
NO_GOLD = (
    "no gold score: these models have no hidden gold rule (random weights or user models); "
    "time to target needs the demo task"
)


@dataclasses.dataclass
class _Lane:
    """One (schedule, seed) run in the interleaved benchmark."""

    schedule: Schedule
    seed: int
    ctx: RunContext
    host: HostState
    state: object
    records: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)  # timeline of the last step


def _lanes(cfg: Config, ctx: RunContext, state, seeds: int, names) -> list[_Lane]:
    """One lane per (seed, schedule of ``names``), each set up exactly as ``train`` sets up a
    run."""
    lanes = []
    for seed in range(cfg.seed, cfg.seed + seeds):
        seed_cfg = dataclasses.replace(cfg, seed=seed)
        engine = dataclasses.replace(ctx.engine, sample_key=sampling_key(seed))
        seed_ctx = dataclasses.replace(ctx, cfg=seed_cfg, engine=engine)
        for schedule in (SCHEDULES[name] for name in names):
            host = HostState.fresh(seed_cfg, schedule, seed_ctx.prompt_iterator())
            lane_state = jax.tree.map(jnp.copy, state)  # each lane's update donates its own
            lanes.append(_Lane(schedule, seed, seed_ctx, host, lane_state))
    return lanes


def _moving_average(xs: list[float], window: int = MOVING_AVERAGE) -> np.ndarray:
    xs = np.asarray(xs, float)
    return np.array([xs[max(0, i - window + 1) : i + 1].mean() for i in range(len(xs))])


def _time_to(target: float | None, lane: _Lane) -> float | None:
    if target is None:
        return None
    wall = np.cumsum([r["step_time_s"] for r in lane.records])
    reached = np.flatnonzero(_moving_average([r["gold"] for r in lane.records]) >= target)
    return float(wall[reached[0]]) if len(reached) else None


def _summary(name: str, lanes: list[_Lane], target: float | None, tail: int) -> dict:
    # The tools import the engine, never the reverse: bench, an entry point, imports them here.

    times = [r["step_time_s"] for lane in lanes for r in lane.records]
    keys = ("reward", "gold") if target is not None else ("reward",)
    finals = {k: [np.mean([r[k] for r in lane.records[-tail:]]) for lane in lanes] for k in keys}
    finals.setdefault("gold", [])
    reach = [_time_to(target, lane) for lane in lanes]
    groups = {g for lane in lanes for r in lane.records for g in r["busy_fraction"]}
    return {
        "step_time_s": [[r["step_time_s"] for r in lane.records] for lane in lanes],
        "reward": [[r["reward"] for r in lane.records] for lane in lanes],
        "gold": [[r.get("gold") for r in lane.records] for lane in lanes],
        "step_time_median_s": statistics.median(times),
        "busy_fraction": {
            g: statistics.median(
                r["busy_fraction"].get(g, 0.0) for lane in lanes for r in lane.records
            )
            for g in sorted(groups)
        },  # fmt: skip
        "time_to_target_s": None if None in reach else float(np.mean(reach)),
        "final_reward": float(np.mean(finals["reward"])),
        "final_reward_spread": float(np.std(finals["reward"])),
        "final_gold": float(np.mean(finals["gold"])) if finals["gold"] else None,
        "final_gold_spread": float(np.std(finals["gold"])) if finals["gold"] else None,
        "response_len_mean": float(
            np.mean([r["response_len_mean"] for lane in lanes for r in lane.records])
        ),  # fmt: skip
        "measured_steps_that_compiled": sum(r["compiles"] > 0 for ln in lanes for r in ln.records),
        "stale_token_frac_mean": float(
            np.mean([r["stale_token_frac"] for lane in lanes for r in lane.records])
        ),
        "ideal_bound": ideal_bound([r for lane in lanes for r in lane.records]),
        "efficiency": pooled_efficiency([r for lane in lanes for r in lane.records]),
        "records": [r for lane in lanes for r in lane.records],  # for the simulator's fit
    }


@dataclasses.dataclass(frozen=True)
class BenchCounts:
    """How long a bench runs: measured ``steps`` per (schedule, seed), ``seeds`` per schedule,
    after ``warmup`` unmeasured steps each."""

    steps: int
    seeds: int = 1
    warmup: int = 2


def run_bench(
    cfg: Config,
    out_dir: str | Path,
    counts: BenchCounts,
    target_gold: float | None = None,
    progress: bool = True,
    precompile: bool = True,
    schedules: Sequence[str] = tuple(SCHEDULES),
) -> dict:
    """Run the ``schedules`` (default: all four; ``sync``, the reference, among them)
    interleaved and write ``bench.json`` and plots to ``out_dir``.

    ``precompile`` compiles every shape each schedule can meet before measuring
    (``pipeline.warmup.warm_up``, as ``train`` does); off, shapes compile when first met,
    inside measured steps (each record's ``compiles`` says which), which saves start-up time
    where compiling is slow."""

    steps, seeds, warmup = counts.steps, counts.seeds, counts.warmup
    check_counts(steps, seeds, warmup)  # before anything is built or written
    names = check_schedules(schedules)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx, state = prepare_run(cfg, progress)
    lanes, timeline, n = _lanes(cfg, ctx, state, seeds, names), Timeline(), len(names)
    if precompile:  # every shape of every schedule (one seed's lanes): ``train``'s warm-up
        _warm_up(lanes[:n], progress)
        for i, lane in enumerate(lanes[n:]):  # other seeds: the same programs
            registry = lanes[i % n].ctx.kernels.registry
            kernels = dataclasses.replace(lane.ctx.kernels, registry=registry)
            engine = dataclasses.replace(lane.ctx.engine, kernels=kernels)
            lane.ctx = dataclasses.replace(lane.ctx, engine=engine)
    compiles = warm.CompileCounter()
    bar = tqdm(total=(warmup + steps) * len(lanes), disable=not progress, unit="step")
    for step in range(warmup + steps):
        rotation = step % n  # who goes first rotates, against order effects
        for lane in lanes[rotation:] + lanes[:rotation]:
            carried = [len(c["response"]) for c in lane.host.buffer.state()]  # for the trace
            # the smallest bucket its decode compacts into, for the trace (0: no compaction)
            compacted = lane.ctx.kernels.compaction_floor or 0
            compiles.take()  # from here: this step's compilations
            lane.state, record, result = train_step(
                lane.ctx, lane.schedule, lane.host, lane.state, timeline
            )
            record["compiles"], record["compile_s"] = compiles.take()
            if step >= warmup:  # the first steps compile
                prompt_width = cfg.rollout.max_prompt_len
                shared = result.slots.shared_prompts(cfg.rollout.group_size)
                record["trace"] = step_trace(result, carried, prompt_width, compacted, shared)
                lane.records.append(record)
                lane.events = result.events
            bar.update(1)
    bar.close()
    return _write(cfg, out, lanes, steps, seeds, target_gold, names)


def _warm_up(lanes: list, progress: bool) -> None:
    """``train``'s warm-up for each lane (``_Lane``), each bar under a line naming its schedule (the
    warm-up's own bar names none)."""
    for i, lane in enumerate(lanes, 1):
        if progress:
            print(
                f"warm-up of {lane.schedule.name} ({i}/{len(lanes)}):", file=sys.stderr, flush=True
            )
        _, lane.ctx = warm.warm_up(lane.ctx, lane.schedule, lane.host, lane.state, progress)


def check_counts(steps: int, seeds: int, warmup: int) -> None:
    """Refuse counts a bench cannot run: ``InputError`` naming the option (``--steps 0`` is
    no default: it ran the config's train.steps)."""
    for flag, value, least in (
        ("--steps", steps, 1),
        ("--seeds", seeds, 1),
        ("--warmup", warmup, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(f"bench {flag} {value}: must be an integer >= {least}")


def check_schedules(schedules: Sequence[str]) -> tuple[str, ...]:
    """The schedules to run, in ``SCHEDULES``' order; ``InputError`` naming an unknown or
    repeated one, or a list without ``sync`` (every ratio is against it)."""
    names = tuple(schedules)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or len(set(names)) != len(names) or "sync" not in names:
        raise InputError(
            f"bench --schedules {','.join(names)}: name each of {', '.join(SCHEDULES)} at most "
            "once, sync included (every speed-up is against it)"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
        )
    return tuple(n for n in SCHEDULES if n in names)


def _paired_ratio(base: list[list[float]], other: list[list[float]]) -> float:
    """Median over (seed, step) of base / other step time."""
    pairs = [a / b for xs, ys in zip(base, other, strict=True) for a, b in zip(xs, ys, strict=True)]
    return statistics.median(pairs)


def _write(cfg, out, lanes, steps, seeds, target_gold, names) -> dict:

    tail = max(1, min(5, steps // 3))
    by_name = {name: [lane for lane in lanes if lane.schedule.name == name] for name in names}
    has_gold = all("gold" in r for lane in lanes for r in lane.records)
    if not has_gold:
        target_gold = None
    elif target_gold is None:  # 70% of the way from the start to the worst schedule's final gold
        start = np.mean([lane.records[0]["gold"] for lane in lanes])
        worst = min(_moving_average([r["gold"] for r in lane.records])[-1] for lane in lanes)
        target_gold = float(start + 0.7 * (worst - start))
    schedules = {name: _summary(name, ls, target_gold, tail) for name, ls in by_name.items()}
    sync = schedules["sync"]

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    result = {
        "workload": {
            "config": to_dict(cfg),
            "steps": steps,
            "seeds": seeds,
            "target_gold": target_gold,
            "no_gold": None if has_gold else NO_GOLD,
        },  # fmt: skip
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "devices": [str(d) for d in jax.devices()],
        },  # fmt: skip
        "schedules": schedules,
        "sync_stage_shares": stage_shares(sync["records"]),
        "measured_over_ideal": {
            n: s["ideal_bound"]["measured_over_ideal"] for n, s in schedules.items()
        },  # fmt: skip
        "speedup_vs_sync": {
            n: ratio(sync["step_time_median_s"], s["step_time_median_s"])
            for n, s in schedules.items()
            if n != "sync"
        },  # fmt: skip
        # Steps of one round (same seed, same step index) run back to back: the median of
        # their ratios is robust to slow phases of a shared machine, which move medians.
        "speedup_vs_sync_paired": {
            n: _paired_ratio(sync["step_time_s"], s["step_time_s"])
            for n, s in schedules.items()
            if n != "sync"
        },
        "time_to_target_speedup_vs_sync": {
            n: ratio(sync["time_to_target_s"], s["time_to_target_s"])
            for n, s in schedules.items()
            if n != "sync"
        },
    }
    (out / "bench.json").write_text(json.dumps(result, indent=2))

    plot_bench(result, {name: ls[0].events for name, ls in by_name.items()}, out)
    return result


def plot_bench(result: dict, events: dict, out: Path) -> None:
    """Write reward_vs_time.png, step_time.png and gantt_<schedule>.png into ``out``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    target = result["workload"]["target_gold"]  # None without a gold score (random models)
    for name, s in result["schedules"].items():
        wall = np.cumsum(s["step_time_s"][0])
        axes[0].plot(wall, s["reward"][0], label=name)
        if target is not None:
            axes[1].plot(wall, s["gold"][0], label=name)
    for ax, what in zip(axes, ("reward-model score", "gold score"), strict=True):
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel(f"mean {what}")
        ax.legend() if ax.lines else ax.set_title("no gold score")
    if target is not None:
        axes[1].axhline(target, color="grey", ls=":", lw=1)
    fig.tight_layout()
    fig.savefig(out / "reward_vs_time.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(result["schedules"])
    ax.boxplot([np.ravel(result["schedules"][n]["step_time_s"]) for n in names])
    ax.set_xticks(range(1, len(names) + 1), names)
    ax.set_ylabel("step time (s)")
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)

    for name, evs in events.items():
        plot_gantt(evs, out / f"gantt_{name}.png", title=f"{name}: one step")


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def bench_summary_lines(result: dict) -> list[str]:
    """The printed summary of a bench: per schedule the median step, the ideal bound and
    measured / ideal, gold and time to target; then the speedups and sync's stage shares."""
    lines, no_gold = [], result["workload"].get("no_gold")
    for name, s in result["schedules"].items():
        bound, ttt = s["ideal_bound"], s["time_to_target_s"]
        gold = f"final gold {_fmt(s['final_gold'], '.3f')} ± {_fmt(s['final_gold_spread'], '.3f')}"
        reach = "n/a" if no_gold else ("not reached" if ttt is None else f"{ttt:.1f}s")
        lines.append(
            f"  {name:>6}: step {s['step_time_median_s']:.3f}s (median), ideal "
            f"{bound['ideal_step_s']:.3f}s, measured/ideal {_fmt(bound['measured_over_ideal'])}, "
            f"{gold}, time to target {reach}"
        )
    lines += _speedup_lines(result)
    if no_gold:
        lines.append(f"  time to target: {no_gold}")
    shares = ", ".join(
        f"{k.replace('_plus_', ' + ')} {v:.1%}" for k, v in result["sync_stage_shares"].items()
    )
    lines.append(f"  sync stage shares: {shares}")
    return lines


# The speedup table's columns: (heading, the result's key)
SPEEDUPS = (
    ("median step", "speedup_vs_sync"),
    ("per-round ratio", "speedup_vs_sync_paired"),
    ("time to target", "time_to_target_speedup_vs_sync"),
)


def _speedup_lines(result: dict) -> list[str]:
    """Each schedule's speedups over sync, aligned under a heading per measure (``-``: none).

    Example::

          speedup vs sync:      median step  per-round ratio   time to target
                     oppo:       1.23x sync       1.20x sync                -
    """
    width = 17  # "per-round ratio" and "1.23x sync" with room between them

    def times(x: float | None) -> str:
        return _fmt(x, ".2f") + ("" if x is None else "x sync")

    lines = ["  speedup vs sync: " + "".join(f"{title:>{width}}" for title, _ in SPEEDUPS)]
    for name in result["speedup_vs_sync"]:
        cells = "".join(f"{times(result[key][name]):>{width}}" for _, key in SPEEDUPS)
        lines.append(f"  {name:>15}: {cells}")
    return lines
