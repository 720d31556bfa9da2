"""``oppo-jax export``: a run's trained actor (and optionally critic) in Hugging Face format."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from oppo_jax.base.errors import InputError
from oppo_jax.config import load_config
from oppo_jax.models import lora
from oppo_jax.models.hf_export import export_hf
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.run.checkpoint import RunCheckpointer, abstract_like
from oppo_jax.run.setup import prepare_run


def export_run(
    run_dir: str | Path, out_dir: str | Path, step: int | None = None, critic: bool = False
) -> Path:
    """Write the actor of ``run_dir``'s latest (or ``step``'s) checkpoint to ``out_dir``.

    The tokenizer files of the run's actor checkpoint are copied beside the weights, so the
    result loads with ``transformers`` (and vLLM) like the checkpoint it started from. With
    ``critic``, the critic goes to ``out_dir/critic`` as a sequence classifier.
    """
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run}: not a run directory (no config.yaml)")
    cfg = load_config(run / "config.yaml")
    if critic and not cfg.ppo.uses_critic:
        raise InputError(f"{run}: ppo.advantage={cfg.ppo.advantage} trains no critic to export")
    ctx, initial = prepare_run(cfg, progress=False)
    with RunCheckpointer(run / "checkpoints") as ckpt:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"{run}/checkpoints: no checkpoint to export")
        state, _ = ckpt.restore(step, abstract_like(initial))
    spec = ctx.kernels.spec
    out = export_hf(*dense(state.actor_model_params, spec.actor), out_dir, ctx.actor_dir)
    if critic:
        export_hf(
            *dense(state.critic_model_params, spec.critic), Path(out_dir) / "critic", ctx.actor_dir
        )
    return out


def dense(params, cfg: ModelConfig) -> tuple[dict, ModelConfig]:
    """Full weights of a (possibly LoRA-adapted) model and its plain architecture: adapters
    merged into their kernels (in float32) and every leaf in the trained dtype
    (``cfg.param_dtype``, the master dtype), so the export carries the update's precision."""
    if cfg.lora_rank:
        params, cfg = lora.merged(params, cfg), cfg.replace(lora_rank=0)
    return jax.tree.map(lambda x: jnp.asarray(x, cfg.jnp_param_dtype), params), cfg
