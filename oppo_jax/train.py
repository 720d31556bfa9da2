"""The training loop: steps of the configured schedule, metrics, checkpoints and resume."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.checkpoint import RunCheckpointer, abstract_like
from oppo_jax.config import Config, to_yaml
from oppo_jax.data.prompts import PromptIterator
from oppo_jax.errors import NonFiniteError, Preempted
from oppo_jax.pipeline.carry import CarryBuffer, SlotBatch, admit, carry_out
from oppo_jax.pipeline.chunk_control import ChunkSizeController
from oppo_jax.pipeline.overcommit import OvercommitController
from oppo_jax.pipeline.schedule import run_step
from oppo_jax.pipeline.timeline import Timeline, TraceWriter
from oppo_jax.ppo.kl_control import make_kl_controller
from oppo_jax.preemption import StopOnSignal
from oppo_jax.run_log import RunLog, read_metrics
from oppo_jax.run_setup import RunContext, prepare_run

# Update metrics copied into metrics.jsonl under the same name.
_UPDATE_KEYS = (
    "policy_loss", "value_loss", "clipfrac", "vf_clipfrac", "approx_kl", "entropy",
    "actor_grad_norm", "critic_grad_norm", "nonfinite_batch", "nonfinite_update",
)  # fmt: skip


@dataclasses.dataclass
class HostState:
    """Everything host-side that a checkpoint must carry besides the arrays."""

    step: int  # next step to run
    kl_ctl: object  # KL controller (its coefficient is the only state)
    prompts: PromptIterator  # position in the prompt stream
    chunks: ChunkSizeController
    deltas: OvercommitController
    buffer: CarryBuffer  # sequences carried into the next step
    nonfinite_in_a_row: int = 0  # consecutive steps whose update was skipped (NaN/Inf)
    nonfinite_total: int = 0  # all skipped updates of the run

    @classmethod
    def fresh(cls, cfg: Config, ctx: RunContext) -> HostState:
        p, oppo = cfg.pipeline, cfg.pipeline.mode == "oppo"
        return cls(
            step=0,
            kl_ctl=make_kl_controller(
                cfg.ppo.kl_coef, cfg.ppo.adaptive_kl, cfg.ppo.target_kl, cfg.ppo.kl_horizon
            ),
            prompts=ctx.prompt_iterator(),
            chunks=ChunkSizeController(
                p.chunk_size, tuple(p.chunk_candidates), p.chunk_tuning_every, p.chunk_tuning
            ),
            # The sync baseline never overcommits: Δ is an OPPO setting.
            deltas=OvercommitController(
                p.overcommit if oppo else 0,
                p.overcommit_min,
                p.overcommit_max,
                p.overcommit_window,
                p.adaptive_overcommit and oppo,
            ),  # fmt: skip
            buffer=CarryBuffer(),
        )

    def to_json(self) -> dict:
        return {
            "step": self.step, "kl_coef": float(self.kl_ctl.value),
            "prompts": self.prompts.state(), "chunks": self.chunks.state(),
            "deltas": self.deltas.state(), "buffer": self.buffer.state(),
            "nonfinite_in_a_row": self.nonfinite_in_a_row, "nonfinite_total": self.nonfinite_total,
        }  # fmt: skip

    def restore(self, data: dict, ctx: RunContext) -> None:
        self.step = int(data["step"])
        self.kl_ctl = self.kl_ctl.replace(value=jnp.float32(data["kl_coef"]))
        self.prompts = ctx.prompt_iterator(data["prompts"])
        self.chunks.restore(data["chunks"])
        self.deltas.restore(data["deltas"])
        self.buffer = CarryBuffer.from_state(data["buffer"])
        self.nonfinite_in_a_row = int(data.get("nonfinite_in_a_row", 0))
        self.nonfinite_total = int(data.get("nonfinite_total", 0))


def _step_keys(seed: int, step: int):
    """(sampling base key, update key): the former is fixed per run, so a token's randomness
    depends on (seed, prompt id, sample index, position) only; the latter changes every step."""
    return jax.random.key(seed), jax.random.fold_in(jax.random.key(seed + 1), step)


def _staleness(slots: SlotBatch, result, carried: int, delta: int) -> dict:
    """Inter-step overlap metrics of the batch (DESIGN.md §4, §6)."""
    rows = result.selection.batch
    tokens = max(int(result.response_len.sum()), 1)
    return {
        "carried": carried,
        "overcommit": delta,
        "deferral_age_mean": float(slots.deferrals[rows].mean()),
        "deferral_age_max": int(slots.deferrals[rows].max()),
        "stale_token_frac": float(slots.prefix_len[rows].sum()) / tokens,
    }


def _record(ctx: RunContext, step: int, result, kl_coef: float, chunk_size: int) -> dict:
    metrics = {k: float(v) for k, v in jax.device_get(result.metrics).items()}
    lengths = result.response_len
    record = {
        "step": step,
        "reward": metrics["reward"],
        "kl": metrics["kl"],
        "kl_coef": kl_coef,
        "non_score_reward": metrics["non_score_reward"],
        "value_mean": metrics["value_mean"],
        "response_len_mean": float(np.mean(lengths)),
        "response_len_max": int(np.max(lengths)),
        "step_time_s": result.wall_s,
        "stage_time_s": result.stage_time_s,
        "busy_fraction": result.busy_fraction,
        "chunk_size": chunk_size,
        **{k: metrics[k] for k in _UPDATE_KEYS if k in metrics},
    }
    if ctx.gold_fn is not None:
        record["gold"] = float(np.mean(ctx.gold_fn(result.responses, lengths)))
    return record


def _files_dir(out: Path) -> Path:
    """Where this process writes config, metrics, trace and TensorBoard: the run directory for
    process 0; ``processes/<i>/`` inside it for the others of a multi-host run (every process
    runs the same loop and computes the same records). Checkpoints are shared by all."""
    i = jax.process_index()
    return out if i == 0 else out / "processes" / str(i)


def train(cfg: Config, out_dir: str | Path, resume: bool = False, progress: bool = True) -> dict:
    """Run ``cfg.train.steps`` PPO steps, writing the run directory; returns a summary."""
    ckpt_dir, out = Path(out_dir) / "checkpoints", _files_dir(Path(out_dir))
    out.mkdir(parents=True, exist_ok=True)
    ctx = prepare_run(cfg, progress)
    (out / "config.yaml").write_text(to_yaml(cfg))
    ckpt = RunCheckpointer(ckpt_dir, max_to_keep=cfg.train.max_to_keep)
    host = HostState.fresh(cfg, ctx)
    if resume and ckpt.latest_step() is not None:
        ctx.train_state, extra = ckpt.restore(None, abstract_like(ctx.train_state))
        host.restore(extra["host"], ctx)
    log = RunLog(out, cfg.train.steps, host.step, progress)
    trace = TraceWriter(out / "trace.json")
    try:
        with StopOnSignal() as stop:
            _loop(cfg, ctx, host, ckpt, log, trace, stop)
    finally:
        trace.write()
        ckpt.wait()
        ckpt.close()
        log.close()
    summary = summarize(out / "metrics.jsonl")
    summary.update(nonfinite_skipped=host.nonfinite_total, prompts_truncated=ctx.prompts_truncated)
    return summary


def step_once(cfg: Config, ctx: RunContext, host: HostState, train_state, timeline, stream: bool):
    """One step of a run: admit, roll out (streaming the scorers or not), update, carry, and
    feed the controllers. Returns (new train state, metrics record, StepResult)."""
    b, r = cfg.rollout.batch_size, cfg.rollout.max_response_len
    step, delta = host.step, host.deltas.delta
    num_slots = ctx.placement.num_slots(b + host.deltas.slots_needed)  # even slot shards
    slots = admit(
        host.buffer, host.prompts, b + delta, num_slots,
        cfg.rollout.max_prompt_len, r, host.deltas.slots_needed > 0,
        cfg.pipeline.max_deferrals, ctx.kernels.rollout.pad_id,
    )  # fmt: skip
    kl_coef, chunk_size = float(host.kl_ctl.value), host.chunks.size_for(step)
    result = run_step(
        ctx.kernels, ctx.placement, timeline, "oppo" if stream else "sync", chunk_size,
        train_state, ctx.ref_params, ctx.reward_params, slots, b,
        _step_keys(cfg.seed, 0)[0], _step_keys(cfg.seed, step)[1], kl_coef,
    )  # fmt: skip
    carried = carry_out(slots, result.selection, result.tokens, result.logprobs,
                        result.num_generated, result.finish_step, step)  # fmt: skip
    host.buffer.extend(carried)
    record = _record(ctx, step, result, kl_coef, chunk_size)
    record.update(_staleness(slots, result, len(carried), delta))
    skipped = bool(record["nonfinite_batch"] or record["nonfinite_update"])
    host.nonfinite_in_a_row = host.nonfinite_in_a_row + 1 if skipped else 0
    host.nonfinite_total += skipped
    record["update_skipped"], record["nonfinite_total"] = skipped, host.nonfinite_total
    if not skipped:  # a NaN reward or KL would poison the controllers for good
        host.kl_ctl = host.kl_ctl.update(record["kl"], b)
        host.deltas.observe(record["reward"])
    host.chunks.observe(step, chunk_size, result.wall_s)
    host.step = step + 1
    return result.train_state, record, result


def _loop(cfg: Config, ctx: RunContext, host: HostState, ckpt, log, trace, stop) -> None:
    """Steps from ``host.step`` to the end, with records and checkpoints.

    Raises ``Preempted`` after checkpointing when ``stop`` saw a signal, and ``NonFiniteError``
    after ``train.max_nonfinite_in_a_row`` skipped updates in a row.
    """
    timeline, saved = Timeline(), host.step
    while host.step < cfg.train.steps:
        if stop.received:
            if saved != host.step:
                ckpt.save(host.step, ctx.train_state, {"host": host.to_json()})
            ckpt.wait()
            raise Preempted(host.step, stop.received, str(ckpt.directory))
        state, record, result = step_once(
            cfg, ctx, host, ctx.train_state, timeline, cfg.pipeline.mode == "oppo"
        )
        ctx.train_state = state
        trace.add_step(record["step"], result.events, result.wall_s)
        log.write(record)
        limit = cfg.train.max_nonfinite_in_a_row
        if host.nonfinite_in_a_row >= limit:
            raise NonFiniteError(
                f"step {record['step']}: {limit} updates in a row were skipped for NaN/Inf values "
                f"({_nonfinite_where(record)}; train.max_nonfinite_in_a_row={limit}). The "
                f"parameters are those before the first skip; checkpoints hold no NaN."
            )
        every = cfg.train.checkpoint_every
        if every and (host.step % every == 0 or host.step == cfg.train.steps):
            ckpt.save(host.step, ctx.train_state, {"host": host.to_json()})
            saved = host.step


def _nonfinite_where(record: dict) -> str:
    """Which stage produced the non-finite values of a skipped step, in words."""
    if record["nonfinite_batch"]:
        return "in the rollout batch: rewards, log-probs or values"
    return "in the loss or gradients of the update"


def summarize(metrics_path: Path, window: int = 5) -> dict:
    """First and last ``window``-step means of the key metrics, and timing."""
    records = read_metrics(metrics_path)
    if not records:
        return {}
    summary = {
        "steps": len(records),
        "mean_step_time_s": np.mean([r["step_time_s"] for r in records]),
    }
    for key in ("reward", "gold", "kl", "response_len_mean"):
        if key in records[0]:
            # null (a skipped step's NaN) is left out of the means
            first = [r[key] for r in records[:window] if r[key] is not None]
            last = [r[key] for r in records[-window:] if r[key] is not None]
            summary[f"{key}_start"] = float(np.mean(first)) if first else float("nan")
            summary[f"{key}_end"] = float(np.mean(last)) if last else float("nan")
    return summary
