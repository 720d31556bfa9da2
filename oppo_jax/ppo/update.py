"""The jitted PPO update: ``ppo_epochs × num_minibatches`` optimizer steps as nested lax.scans.

The actor and the critic are separate models with separate optimizers. The actor minimises
    pg_loss − entropy_coef · entropy (+ β · KL to the reference, when the KL is not in the reward)
and the critic minimises vf_coef · vf_loss, which is TRL's ``pg + vf_coef · vf`` split by model.
Each optimizer update averages the gradients of ``grad_accum_steps`` microbatches.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import optax

from oppo_jax.config import OptimConfig, PPOConfig
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.ppo.advantages import kl_estimate
from oppo_jax.ppo.batch import PPOBatch, critic_values, policy_logprobs
from oppo_jax.ppo.losses import aggregate, policy_loss, value_loss
from oppo_jax.sharding import (
    DEFAULT_RULES,
    ShardingRules,
    abstract_params,
    batch_sharding,
    param_shardings,
    replicated,
)


@flax.struct.dataclass
class TrainState:
    """Actor and critic parameters with their optimizer states and the update counter."""

    actor_params: dict
    critic_params: dict
    actor_opt: optax.OptState
    critic_opt: optax.OptState
    step: jax.Array  # PPO updates applied so far (int32 scalar)

    __no_type_check__ = True  # rebuilt with sharding leaves by tree maps


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
    """Static description of the update: models, hyper-parameters and optimizers."""

    actor: ModelConfig
    critic: ModelConfig
    ppo: PPOConfig
    temperature: float
    actor_tx: optax.GradientTransformation
    critic_tx: optax.GradientTransformation


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
        optax.adamw(schedule, optim.adam_b1, optim.adam_b2, optim.adam_eps,
                    weight_decay=optim.weight_decay),
    )  # fmt: skip


def init_train_state(spec: UpdateSpec, actor_params, critic_params) -> TrainState:
    """Fresh optimizer states for the given parameters (follows their shardings under jit)."""
    return TrainState(
        actor_params=actor_params,
        critic_params=critic_params,
        actor_opt=spec.actor_tx.init(actor_params),
        critic_opt=spec.critic_tx.init(critic_params),
        step=jnp.zeros((), jnp.int32),
    )


def actor_loss(spec: UpdateSpec, params, mb: PPOBatch, kl_coef):
    """Clipped surrogate (+ entropy bonus, + KL-in-loss) on one microbatch; returns (loss, aux)."""
    ppo = spec.ppo
    logp, entropy = policy_logprobs(
        spec.actor, params, mb.tokens, mb.prompt_len, mb.response_len, spec.temperature
    )
    is_clip = ppo.importance_clip if ppo.importance_correction else None
    pg, aux = policy_loss(
        logp, mb.old_logp, mb.advantages, mb.mask, ppo.cliprange, ppo.loss_agg,
        behaviour_logp=mb.behaviour_logp if is_clip else None, is_clip=is_clip,
    )  # fmt: skip
    mean_entropy = aggregate(entropy, mb.mask, ppo.loss_agg)
    loss = pg - ppo.entropy_coef * mean_entropy
    if not ppo.kl_in_reward:
        kl = aggregate(kl_estimate(logp, mb.ref_logp, ppo.kl_estimator), mb.mask, ppo.loss_agg)
        loss = loss + kl_coef * kl
    return loss, {"policy_loss": pg, "entropy": mean_entropy, **aux}


def critic_loss(spec: UpdateSpec, params, mb: PPOBatch):
    """vf_coef × clipped value loss on one microbatch; returns (loss, aux)."""
    values = critic_values(spec.critic, params, mb.tokens, mb.prompt_len, mb.response_len)
    vf, aux = value_loss(
        values, mb.old_values, mb.returns, mb.mask, spec.ppo.cliprange_value, spec.ppo.loss_agg
    )
    return spec.ppo.vf_coef * vf, {"value_loss": vf, **aux}


def _split(tree, parts: int):
    """[N, ...] leaves -> [parts, N / parts, ...]."""
    return jax.tree.map(lambda x: x.reshape((parts, x.shape[0] // parts) + x.shape[1:]), tree)


def _optimizer_step(spec: UpdateSpec, kl_coef, state: TrainState, minibatch: PPOBatch):
    """Average gradients over microbatches, then apply one actor and one critic update."""
    actor_grad_fn = jax.grad(functools.partial(actor_loss, spec), has_aux=True)
    critic_grad_fn = jax.grad(functools.partial(critic_loss, spec), has_aux=True)

    def micro(carry, mb):
        g_actor, a_aux = actor_grad_fn(state.actor_params, mb, kl_coef)
        g_critic, c_aux = critic_grad_fn(state.critic_params, mb)
        grads = jax.tree.map(jnp.add, carry, (g_actor, g_critic))
        return grads, {**a_aux, **c_aux}

    zeros = jax.tree.map(jnp.zeros_like, (state.actor_params, state.critic_params))
    steps = spec.ppo.grad_accum_steps
    grads, aux = jax.lax.scan(micro, zeros, _split(minibatch, steps))
    g_actor, g_critic = jax.tree.map(lambda g: g / steps, grads)
    a_updates, actor_opt = spec.actor_tx.update(g_actor, state.actor_opt, state.actor_params)
    c_updates, critic_opt = spec.critic_tx.update(g_critic, state.critic_opt, state.critic_params)
    metrics = jax.tree.map(jnp.mean, aux)
    metrics["actor_grad_norm"] = optax.tree.norm(g_actor)
    metrics["critic_grad_norm"] = optax.tree.norm(g_critic)
    new_state = state.replace(
        actor_params=optax.apply_updates(state.actor_params, a_updates),
        critic_params=optax.apply_updates(state.critic_params, c_updates),
        actor_opt=actor_opt,
        critic_opt=critic_opt,
    )
    return new_state, metrics


def ppo_update(spec: UpdateSpec, state: TrainState, batch: PPOBatch, key, kl_coef):
    """All epochs and minibatches of one PPO step; returns the new state and mean metrics.

    Each epoch draws a fresh permutation of the B rows from ``key`` and splits it into
    ``num_minibatches`` minibatches. A step that meets a non-finite value is skipped whole
    (metrics ``nonfinite_batch`` / ``nonfinite_update`` are 1; the state is returned as given).
    """
    num_rows = batch.tokens.shape[0]

    def epoch(state, epoch_key):
        perm = jax.random.permutation(epoch_key, num_rows)
        shuffled = jax.tree.map(lambda x: x[perm], batch)
        step = functools.partial(_optimizer_step, spec, kl_coef)
        return jax.lax.scan(step, state, _split(shuffled, spec.ppo.num_minibatches))

    keys = jax.random.split(key, spec.ppo.ppo_epochs)
    new_state, metrics = jax.lax.scan(epoch, state, keys)
    new_state = new_state.replace(step=new_state.step + 1)
    # A NaN/Inf anywhere (rewards, log-probs, values, losses, gradients) skips the whole step:
    # the state comes back bitwise unchanged and the metrics say why (the host counts these).
    batch_ok = all_finite(batch)
    update_ok = all_finite(metrics)
    ok = batch_ok & update_ok
    state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, state)
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["nonfinite_batch"] = (~batch_ok).astype(jnp.float32)
    metrics["nonfinite_update"] = (~update_ok).astype(jnp.float32)
    return state, metrics


def all_finite(tree) -> jax.Array:
    """True when every floating-point leaf of ``tree`` is free of NaN and Inf."""
    checks = [
        jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.stack(checks).all() if checks else jnp.bool_(True)


def train_state_shardings(spec: UpdateSpec, mesh, rules: ShardingRules = DEFAULT_RULES):
    """NamedShardings of a TrainState: optimizer moments follow their parameters."""
    repl = replicated(mesh)

    def model_and_opt(cfg, tx):
        params_sh = param_shardings(cfg, mesh, rules)
        abstract_opt = jax.eval_shape(tx.init, abstract_params(cfg))
        opt_sh = optax.tree_map_params(
            tx, lambda _, sh: sh, abstract_opt, params_sh, transform_non_params=lambda _: repl
        )
        return params_sh, opt_sh

    actor_sh, actor_opt_sh = model_and_opt(spec.actor, spec.actor_tx)
    critic_sh, critic_opt_sh = model_and_opt(spec.critic, spec.critic_tx)
    return TrainState(actor_sh, critic_sh, actor_opt_sh, critic_opt_sh, step=repl)


def batch_shardings(mesh, rules: ShardingRules = DEFAULT_RULES) -> PPOBatch:
    """Every PPOBatch field sharded over its row axis (data × fsdp), the rest replicated."""
    rows = batch_sharding(mesh, 1, rules)
    table = batch_sharding(mesh, 2, rules)
    fields = {f.name: table for f in dataclasses.fields(PPOBatch)}
    return PPOBatch(**{**fields, "prompt_len": rows, "scores": rows})


def make_sharded_update(spec: UpdateSpec, mesh, rules: ShardingRules = DEFAULT_RULES):
    """``ppo_update`` jitted once over ``mesh`` with explicit shardings, donating the state.

    Returns ``(update, state_shardings)`` where ``update(state, batch, key, kl_coef)``.
    """
    state_sh = train_state_shardings(spec, mesh, rules)
    repl = replicated(mesh)
    update = jax.jit(
        functools.partial(ppo_update, spec),
        in_shardings=(state_sh, batch_shardings(mesh, rules), repl, repl),
        out_shardings=(state_sh, repl),
        donate_argnums=(0,),
    )
    return update, state_sh


def make_sharded_init(spec: UpdateSpec, mesh, rules: ShardingRules = DEFAULT_RULES):
    """A jitted ``init_train_state`` whose outputs are born with the train-state shardings."""
    state_sh = train_state_shardings(spec, mesh, rules)
    return jax.jit(
        functools.partial(init_train_state, spec),
        in_shardings=(state_sh.actor_params, state_sh.critic_params),
        out_shardings=state_sh,
    )
