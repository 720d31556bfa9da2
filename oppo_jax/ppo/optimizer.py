"""The optimizer each trained model gets: AdamW behind global-norm clipping, on a schedule."""

from __future__ import annotations

import optax

from oppo_jax.config.schema import OptimConfig


def make_optimizer(optim: OptimConfig, lr: float, total_updates: int):
    """AdamW with global-norm clipping and a warm-up then constant/cosine/linear schedule."""
    warmup = max(optim.warmup_steps, 0)
    decay_steps = max(total_updates - warmup, 1)
    after = {
        "constant": optax.constant_schedule(lr),
        "cosine": optax.cosine_decay_schedule(lr, decay_steps),
        "linear": optax.linear_schedule(lr, 0.0, decay_steps),
    }[optim.schedule]
    schedule = optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])
    return optax.chain(
        optax.clip_by_global_norm(optim.max_grad_norm),
        optax.adamw(
            schedule, optim.adam_b1, optim.adam_b2, optim.adam_eps, weight_decay=optim.weight_decay
        ),
    )
