"""The training loop: steps of the configured schedule, metrics, checkpoints and resume."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from oppo_jax.checkpoint import RunCheckpointer, abstract_like
from oppo_jax.config import Config, to_yaml
from oppo_jax.pipeline.chunk_control import ChunkSizeController
from oppo_jax.pipeline.schedule import PromptBatch, run_step
from oppo_jax.pipeline.timeline import Timeline, TraceWriter
from oppo_jax.ppo.kl_control import make_kl_controller
from oppo_jax.run_log import RunLog, read_metrics
from oppo_jax.run_setup import RunContext, prepare_run

# Update metrics copied into metrics.jsonl under the same name.
_UPDATE_KEYS = (
    "policy_loss", "value_loss", "clipfrac", "vf_clipfrac", "approx_kl", "entropy",
    "actor_grad_norm", "critic_grad_norm",
)  # fmt: skip


@dataclasses.dataclass
class LoopState:
    """Host-side state that a checkpoint must carry besides the arrays."""

    step: int
    kl_coef: float
    prompt_state: dict
    chunk_state: dict

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _step_keys(seed: int, step: int):
    """(sampling base key, update key): the former is fixed per run, so a token's randomness
    depends on (seed, prompt id, sample index, position) only; the latter changes every step."""
    return jax.random.key(seed), jax.random.fold_in(jax.random.key(seed + 1), step)


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


def _restore(ctx: RunContext, ckpt: RunCheckpointer) -> LoopState:
    state, extra = ckpt.restore(None, abstract_like(ctx.train_state))
    ctx.train_state = state
    return LoopState(**extra["loop"])


def train(cfg: Config, out_dir: str | Path, resume: bool = False, progress: bool = True) -> dict:
    """Run ``cfg.train.steps`` PPO steps, writing the run directory; returns a summary."""
    if cfg.pipeline.mode == "oppo" and cfg.pipeline.overcommit > 0:
        raise NotImplementedError(
            f"pipeline.overcommit={cfg.pipeline.overcommit}: carrying sequences across steps "
            "(inter-step overlap) is not implemented yet; use pipeline.overcommit=0"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = prepare_run(cfg, progress)
    (out / "config.yaml").write_text(to_yaml(cfg))
    ckpt = RunCheckpointer(out / "checkpoints", max_to_keep=cfg.train.max_to_keep)
    p = cfg.pipeline
    chunks = ChunkSizeController(
        p.chunk_size, tuple(p.chunk_candidates), p.chunk_tuning_every, p.chunk_tuning
    )
    loop = LoopState(0, cfg.ppo.kl_coef, ctx.prompt_iterator().state(), chunks.state())
    if resume and ckpt.latest_step() is not None:
        loop = _restore(ctx, ckpt)
        chunks.restore(loop.chunk_state)
    kl_ctl = make_kl_controller(
        loop.kl_coef, cfg.ppo.adaptive_kl, cfg.ppo.target_kl, cfg.ppo.kl_horizon
    )
    prompts = ctx.prompt_iterator(loop.prompt_state)
    log = RunLog(out, cfg.train.steps, loop.step, progress)
    timeline, trace = Timeline(), TraceWriter(out / "trace.json")
    sample_key_base = _step_keys(cfg.seed, 0)[0]
    try:
        for step in range(loop.step, cfg.train.steps):
            batch = PromptBatch.from_pairs(
                prompts.take(cfg.rollout.batch_size), cfg.rollout.max_prompt_len,
                ctx.kernels.rollout.pad_id,
            )  # fmt: skip
            kl_coef = float(kl_ctl.value)
            chunk_size = chunks.size_for(step)
            result = run_step(
                ctx.kernels, ctx.placement, timeline, cfg.pipeline.mode, chunk_size,
                ctx.train_state, ctx.ref_params, ctx.reward_params, batch, sample_key_base,
                _step_keys(cfg.seed, step)[1], kl_coef,
            )  # fmt: skip
            ctx.train_state = result.train_state
            trace.add_step(step, result.events, result.wall_s)
            record = _record(ctx, step, result, kl_coef, chunk_size)
            kl_ctl = kl_ctl.update(record["kl"], cfg.rollout.batch_size)
            chunks.observe(step, chunk_size, result.wall_s)
            log.write(record)
            loop = LoopState(step + 1, float(kl_ctl.value), prompts.state(), chunks.state())
            every = cfg.train.checkpoint_every
            if every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps):
                ckpt.save(step + 1, ctx.train_state, {"loop": loop.to_json()})
    finally:
        trace.write()
        ckpt.wait()
        ckpt.close()
        log.close()
    return summarize(out / "metrics.jsonl")


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
            summary[f"{key}_start"] = float(np.mean([r[key] for r in records[:window]]))
            summary[f"{key}_end"] = float(np.mean([r[key] for r in records[-window:]]))
    return summary
