"""The training loop: steps of the configured schedule, their records, checkpoints and resume."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import jax
import numpy as np

from oppo_jax.base.errors import Interrupted, NonFiniteError, Preempted
from oppo_jax.config import Config, to_yaml
from oppo_jax.pipeline.carry import dropped_slots, staleness_counts
from oppo_jax.pipeline.host_state import HostState
from oppo_jax.pipeline.refill_step import run_refill_step
from oppo_jax.pipeline.schedule import Schedule
from oppo_jax.pipeline.step import StepPlan, StepResult, run_step
from oppo_jax.pipeline.timeline import Timeline, TraceWriter
from oppo_jax.pipeline.warmup import CompileCounter, warm_up
from oppo_jax.run.checkpoint import RunCheckpointer, abstract_like
from oppo_jax.run.evaluate import make_evaluator
from oppo_jax.run.log import RunLog, has_checkpoint, leave_as_found, read_metrics
from oppo_jax.run.preemption import StopOnSignal
from oppo_jax.run.setup import RunContext, prepare_run

WARMUP_ENV = "OPPO_JAX_WARMUP"  # off: no warm-up unless train(warmup=True)
# Update metrics copied into metrics.jsonl under the same name.
_UPDATE_KEYS = (
    "policy_loss",
    "value_loss",
    "clipfrac",
    "vf_clipfrac",
    "approx_kl",
    "entropy",
    "actor_grad_norm",
    "critic_grad_norm",
    "is_weight_mean",  # ppo.off_policy_correction's mean weight over the trained tokens
    "is_masked_token_frac",  # mis: share of the trained tokens masked
    "is_masked_seq_frac",  # mis: share of the batch's sequences masked
    "nonfinite_batch",
    "nonfinite_update",
    "skipped_steps",
)


def _staleness(plan: StepPlan, result: StepResult, carried: int, bound: int) -> dict:
    """Inter-step overlap metrics of the batch (DESIGN.md §4, §6): carried and dropped groups'
    sequences and prompts, and ``staleness_k``, the trained tokens sampled k policy versions
    ago for k = 0..``bound`` (``rollout.max_staleness``: the same keys in every record)."""
    rows, slots = result.selection.batch, result.slots
    tokens = max(int(result.response_len.sum()), 1)
    ages = staleness_counts(slots, rows, result.response_len, plan.step, bound)
    dropped = {int(slots.prompt_ids[i]) for i in dropped_slots(slots, result.selection)}
    dropped = result.refill["dropped"] if result.refill is not None else len(dropped)
    return {
        "carried": carried,
        "dropped": dropped,  # prompts (groups) dropped at the bound (rollout.on_stale)
        "overcommit": plan.overcommit // plan.group_size,  # Δ, groups
        "deferral_age_mean": float(slots.deferrals[rows].mean()),
        "deferral_age_max": int(slots.deferrals[rows].max()),
        "stale_token_frac": float(slots.prefix_len[rows].sum()) / tokens,
        **{f"staleness_{k}": int(n) for k, n in enumerate(ages)},
    }


def step_record(ctx: RunContext, plan: StepPlan, result: StepResult, carried: int) -> dict:
    """The step's line of ``metrics.jsonl`` (before the controllers add theirs)."""
    # np.asarray per value: a quarter of jax.device_get's cost on the dict
    metrics = {k: float(np.asarray(v)) for k, v in result.metrics.items()}
    lengths = result.response_len
    record = {
        "step": plan.step,
        "reward": metrics["reward"],
        "kl": metrics["kl"],
        "kl_coef": plan.kl_coef,
        "non_score_reward": metrics["non_score_reward"],
        "value_mean": metrics["value_mean"],
        "response_len_mean": float(np.mean(lengths)),
        "response_len_max": int(np.max(lengths)),
        "step_time_s": result.wall_s,
        "stage_time_s": result.stage_time_s,
        "busy_fraction": result.busy_fraction,
        "chunk_size": plan.chunk_size,
        **{k: metrics[k] for k in _UPDATE_KEYS if k in metrics},
        **{k: v for k, v in metrics.items() if k.startswith("reward_fn/")},  # reward.functions
    }
    if ctx.gold_fn is not None:
        record["gold"] = float(np.mean(ctx.gold_fn(result.responses, lengths)))
    record.update(_staleness(plan, result, carried, ctx.cfg.rollout.max_staleness))
    if result.work is not None:  # tokens computed / real and efficiency per stage
        record.update(result.work.to_record())
    return record


@dataclasses.dataclass(frozen=True)
class PendingRecord:
    """A step's line of ``metrics.jsonl``, built when called: ``step_record``, then the keys
    the loop noted after the step (``HostState.observe``'s, ``compiles``, ``compile_time_s``),
    in that order. ``RunLog``'s writer thread calls it, so reading the metrics back, the gold
    score and the record's assembly are off the loop's thread."""

    ctx: RunContext
    plan: StepPlan
    result: StepResult  # without its batch: the record never reads it
    carried: int  # sequences carried into the next step
    noted: dict

    def __call__(self) -> dict:
        record = step_record(self.ctx, self.plan, self.result, self.carried)
        record.update(self.noted)
        return record


def step_and_observe(ctx: RunContext, schedule: Schedule, host: HostState, train_state, timeline):
    """One step of a run under ``schedule``: plan it, run it, carry, and feed the controllers.
    Returns (new train state, its PendingRecord, StepResult)."""
    plan = host.plan(ctx.cfg)
    if host.refill is not None:  # the groups in flight stay in the rows (host.refill)
        train_state, carried, result = run_refill_step(
            ctx.engine, schedule, plan, train_state, host.refill, host.prompts, timeline
        )
    else:
        train_state, carried, result = run_step(
            ctx.engine, schedule, plan, train_state, host.buffer, host.prompts, timeline
        )
        host.buffer.extend(carried)
    noted = host.observe(plan, result)
    record = PendingRecord(ctx, plan, dataclasses.replace(result, batch=None), len(carried), noted)
    return train_state, record, result


def train_step(ctx: RunContext, schedule: Schedule, host: HostState, train_state, timeline):
    """``step_and_observe`` with its record built at once. Returns (new train state, metrics
    record, StepResult)."""
    train_state, record, result = step_and_observe(ctx, schedule, host, train_state, timeline)
    return train_state, record(), result


def _files_dir(out: Path) -> Path:
    """Where this process writes config, metrics, trace and TensorBoard: the run directory for
    process 0; ``processes/<i>/`` inside it for the others of a multi-host run (every process
    runs the same loop and computes the same records). Checkpoints are shared by all."""
    i = jax.process_index()
    return out if i == 0 else out / "processes" / str(i)


def train(
    cfg: Config,
    out_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    warmup: bool | None = None,
) -> dict:
    """Run ``cfg.train.steps`` PPO steps, writing the run directory; returns a summary.

    ``warmup`` compiles every shape the run can meet before its first step
    (``pipeline.warmup``; its report goes to ``warmup.json`` and the summary), so that each
    record's ``compiles`` is 0; off, a step that meets a new shape compiles it. None: on
    unless ``$OPPO_JAX_WARMUP`` is ``off`` (the test suite's default).

    A stop signal before step 0 (SIGINT, SIGTERM) raises ``Interrupted`` at once; a run that
    had no checkpoint then leaves ``out_dir`` as it found it, so the same call starts it again.
    From step 0 on, a signal lets the step in flight finish, saves, and raises ``Preempted``."""
    ckpt_dir, out = Path(out_dir) / "checkpoints", _files_dir(Path(out_dir))
    existed, resumable = out.exists(), has_checkpoint(ckpt_dir)
    with StopOnSignal(before_start="loading the models and the prompts") as stop:
        try:
            return _run(cfg, out, ckpt_dir, resume, progress, warmup, stop)
        except Interrupted:
            if not resumable:
                leave_as_found(out, ckpt_dir, existed)
            raise


def _run(cfg: Config, out: Path, ckpt_dir: Path, resume, progress, warmup, stop) -> dict:
    """``train`` inside its signal handler ``stop``."""
    out.mkdir(parents=True, exist_ok=True)
    ctx, train_state = prepare_run(cfg, progress)
    (out / "config.yaml").write_text(to_yaml(cfg))
    ckpt = RunCheckpointer(ckpt_dir, max_to_keep=cfg.train.max_to_keep)
    schedule = Schedule.named(cfg.pipeline.mode)
    host = HostState.fresh(cfg, schedule, ctx.prompt_iterator())
    if resume and ckpt.latest_step() is not None:
        train_state, extra = ckpt.restore(None, abstract_like(train_state))
        host.restore(extra["host"], ctx.prompt_iterator(extra["host"]["prompts"]))
        host.restore_arrays(ckpt.restore_arrays(host.step), ctx.engine.placement)
        print(f"Resuming at step {host.step} from {ckpt.directory / str(host.step)}", flush=True)
    report = {}
    if warmup is None:
        warmup = os.environ.get(WARMUP_ENV, "on").strip().lower() != "off"
    if warmup and host.step < cfg.train.steps:
        stop.before_start = "the warm-up, which compiles the run's programs"
        report, ctx = warm_up(ctx, schedule, host, train_state, progress)
        (out / "warmup.json").write_text(json.dumps(report, indent=2))
    stop.before_start = None  # from here a signal lets the step in flight finish, then saves
    log = RunLog(out, cfg.train.steps, host.step, progress)
    evaluate = make_evaluator(ctx, out, host.step)  # eval.*: held-out decoding (no-op when off)
    trace = TraceWriter(out / "trace.json")
    try:
        _loop(ctx, schedule, host, train_state, (ckpt, log, trace, evaluate), stop)
    finally:
        trace.write()
        ckpt.wait()
        ckpt.close()
        log.close()
        _plot(out, cfg.ppo.uses_reference)  # at the end and on preemption alike
    summary = summarize(out / "metrics.jsonl")
    summary.update(nonfinite_skipped=host.nonfinite_total, prompts_truncated=ctx.prompts_truncated)
    summary.update({k: v for k, v in report.items() if k in ("warmup_s", "warmup_compiles")})
    return summary


def _plot(out: Path, reference: bool) -> None:
    """``plots/`` from metrics.jsonl (a KL plot only with a reference); a plot that fails warns
    and never hides the run's own outcome (this runs in a ``finally``)."""
    from oppo_jax.run.plots import plot_run

    try:
        plot_run(out / "metrics.jsonl", out / "plots", reference)
    except Exception as e:  # plots are a convenience; metrics.jsonl is the record
        warnings.warn(f"could not write {out / 'plots'}: {e}", stacklevel=2)


def _loop(ctx: RunContext, schedule: Schedule, host: HostState, state, outputs, stop) -> None:
    """Steps from ``host.step`` to the end, with records and checkpoints.

    Raises ``Preempted`` after checkpointing when ``stop`` saw a signal, and ``NonFiniteError``
    after ``train.max_nonfinite_in_a_row`` skipped updates in a row.
    """
    cfg, (ckpt, log, trace, evaluate) = ctx.cfg, outputs
    timeline, saved, compiles = Timeline(), host.step, CompileCounter()
    while host.step < cfg.train.steps:
        if stop.received:
            if saved != host.step:
                ckpt.save(host.step, state, {"host": host.to_json()}, arrays=host.arrays())
            ckpt.wait()
            raise Preempted(host.step, stop.received, str(ckpt.directory))
        evaluate(host.step, state)  # at step 0 and every eval.every steps
        compiles.take()  # from here: this step's compilations only (not the checkpoint's)
        state, pending, result = step_and_observe(ctx, schedule, host, state, timeline)
        pending.noted["compiles"], pending.noted["compile_time_s"] = compiles.take()
        trace.add_step(pending.plan.step, result.events, result.wall_s)
        log.write(pending)  # built and written by the log's writer thread
        limit = cfg.train.max_nonfinite_in_a_row
        if host.nonfinite_in_a_row >= limit:
            record = pending()
            raise NonFiniteError(
                f"step {record['step']}: {limit} updates in a row were skipped for NaN/Inf values "
                f"({_nonfinite_where(record)}; train.max_nonfinite_in_a_row={limit}). The "
                f"parameters are those before the first skip; checkpoints hold no NaN."
            )
        every = cfg.train.checkpoint_every
        if every and (host.step % every == 0 or host.step == cfg.train.steps):
            ckpt.save(host.step, state, {"host": host.to_json()}, arrays=host.arrays())
            saved = host.step
    evaluate(host.step, state)  # the final parameters


def _nonfinite_where(record: dict) -> str:
    """Which stage produced the non-finite values of a skipped step, in words."""
    if record["nonfinite_batch"]:
        return "in the rollout batch: rewards, log-probs or values"
    return "in the loss or gradients of the update"


def summarize(metrics_path: Path, window: int = 5) -> dict:
    """Means over the first and last ``window`` steps of the key metrics (``<key>_start``,
    ``<key>_end``; fewer steps in a short run, so the two never share a step: ``window_steps``
    says how many), and timing."""
    records = read_metrics(metrics_path)
    if not records:
        return {}
    window = max(1, min(window, len(records) // 2))
    summary = {
        "steps": len(records),
        "mean_step_time_s": np.mean([r["step_time_s"] for r in records]),
        "window_steps": window,
    }
    for key in ("reward", "gold", "kl", "response_len_mean"):
        if key in records[0]:
            # null (a skipped step's NaN) is left out of the means
            first = [r[key] for r in records[:window] if r[key] is not None]
            last = [r[key] for r in records[-window:] if r[key] is not None]
            summary[f"{key}_start"] = float(np.mean(first)) if first else float("nan")
            summary[f"{key}_end"] = float(np.mean(last)) if last else float("nan")
    evals = metrics_path.parent / "eval.jsonl"  # a verifiable task's held-out accuracy
    evals = read_metrics(evals) if evals.exists() else []
    for key in ("exact_match", "pass@1", "mean@k"):  # "held_out_pass@1", ...
        if evals and key in evals[0]:
            first, last = (f"{e[key]:.3f} (step {e['step']})" for e in (evals[0], evals[-1]))
            summary[f"held_out_{key}"] = f"{first} -> {last}"
    return summary


def summary_lines(summary: dict) -> list[str]:
    """The printed run summary: ``steps`` and the mean step time, then each metric's start and
    end means on one line under a header saying how many steps each mean covers (the plots
    draw every step, so a plot's step 0 is not the start mean), then the rest."""
    metrics = [k.removesuffix("_start") for k in summary if k.endswith("_start")]
    grouped = {f"{k}_{end}" for k in metrics for end in ("start", "end")}
    rest = [k for k in summary if k not in grouped | {"window_steps"}]
    lines = [_line(k, summary[k]) for k in rest[:2]]  # steps, mean_step_time_s
    if metrics:
        n = summary["window_steps"]
        head = f"means of the first {n} and the last {n} steps (the plots show each step)"
        lines.append(f"  start -> end: {head}")
        lines += [_line(k, summary[f"{k}_start"], summary[f"{k}_end"]) for k in metrics]
    return lines + [_line(k, summary[k]) for k in rest[2:]]


def _line(key: str, *values) -> str:
    """``key: value`` (or ``start -> end``), floats to 4 significant digits."""
    text = " -> ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in values)
    return f"  {key:>22}: {text}"
