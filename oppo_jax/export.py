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
from oppo_jax.ppo.estimators import estimator
from oppo_jax.run.checkpoint import RunCheckpointer, abstract_like, committed_steps
from oppo_jax.run.setup import prepare_run


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    critic: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write the actor of ``run_dir``'s latest (or ``step``'s) checkpoint to ``out_dir``.

    The tokenizer files of the run's actor checkpoint are copied beside the weights, so the
    result loads with ``transformers`` (and vLLM) like the checkpoint it started from. With
    ``critic``, the critic goes to ``out_dir/critic`` as a sequence classifier. A non-empty
    ``out_dir`` needs ``overwrite`` (files of the same names are replaced, no other is
    deleted); a run directory, or a directory inside one, is never written to. Raises
    ``InputError`` naming the directory or the step (and the steps there are) before any
    model is built.
    """
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        what = "no such directory" if not run.exists() else "no config.yaml"
        raise InputError(f"{run}: not a run directory ({what}); give the --out of a training run")
    steps = committed_steps(run / "checkpoints")
    if not steps:
        raise InputError(f"{run}: no checkpoint to export ({run / 'checkpoints'} holds no step)")
    if step is not None and step not in steps:
        raise InputError(
            f"{run}: no checkpoint at step {step}; available steps: {', '.join(map(str, steps))}"
        )
    check_export_dir(out_dir, overwrite)
    cfg = load_config(run / "config.yaml")
    if critic and not estimator(cfg.ppo).needs_critic:
        raise InputError(f"{run}: ppo.advantage={cfg.ppo.advantage} trains no critic to export")
    ctx, initial = prepare_run(cfg, progress=False)
    with RunCheckpointer(run / "checkpoints") as ckpt:
        state, _ = ckpt.restore(step, abstract_like(initial))
    spec = ctx.kernels.spec
    out = export_hf(*dense(state.actor_model_params, spec.actor), out_dir, ctx.actor_dir)
    if critic:
        export_hf(
            *dense(state.critic_model_params, spec.critic), Path(out_dir) / "critic", ctx.actor_dir
        )
    return out


def check_export_dir(out_dir: str | Path, overwrite: bool) -> None:
    """Refuse an export directory that is a file, a run directory (it holds config.yaml or
    checkpoints/), inside one (an ancestor holds both), or not empty without ``overwrite``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"export directory {out} is a file")
    runs = [d for d in out.resolve().parents if _is_run_dir(d, both=True)]
    if _is_run_dir(out, both=False) or runs:
        where = f"{out} is" if not runs else f"{out} is inside {runs[0]}, which is"
        raise InputError(
            f"{where} a run directory (holds config.yaml/checkpoints); an export is never "
            "written into a run, choose another --out"
        )
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if entries and not overwrite:
        raise InputError(
            f"export directory {out} is not empty (holds {', '.join(entries[:5])}); pass "
            "--overwrite to write over the files of an earlier export, or choose another --out"
        )


def _is_run_dir(d: Path, both: bool) -> bool:
    """Whether ``d`` holds config.yaml and (``both``) or (not ``both``) checkpoints/."""
    marks = ((d / "config.yaml").is_file(), (d / "checkpoints").is_dir())
    return all(marks) if both else any(marks)


def dense(params, cfg: ModelConfig) -> tuple[dict, ModelConfig]:
    """Full weights of a (possibly LoRA-adapted) model and its plain architecture: adapters
    merged into their kernels (in float32) and every leaf in the trained dtype
    (``cfg.param_dtype``, the master dtype), so the export carries the update's precision."""
    if cfg.lora_rank:
        params, cfg = lora.merged(params, cfg), cfg.replace(lora_rank=0)
    return jax.tree.map(lambda x: jnp.asarray(x, cfg.jnp_param_dtype), params), cfg
