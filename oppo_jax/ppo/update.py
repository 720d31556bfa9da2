"""The PPO update's parts: ``ppo_epochs × num_minibatches`` optimizer steps (the packed update,
``ppo.packed_update``, scans them over its packed chunks).

The actor and the critic are separate models with separate optimizers. The actor minimises
    pg_loss − entropy_coef · entropy (+ β · KL to the reference, when the KL is not in the reward)
and the critic minimises vf_coef · vf_loss, which is TRL's ``pg + vf_coef · vf`` split by model.
A critic-free estimator (the GRPO family) has no critic: ``UpdateSpec.critic`` is None, and so
are the train state's critic parameters and optimizer state; only the actor is trained.
Each optimizer update averages the gradients of ``grad_accum_steps`` microbatches.

On a mesh (``packed_update.make_update``) the update is traced with the logical-axis rules
active, so the model's activation constraints hold (rows over data × fsdp, FSDP weights
gathered per layer), every minibatch and microbatch keeps its rows sharded, and the gradient
accumulators are laid out like the parameters. Non-finite values skip work without a second
copy of the train state: each optimizer step is applied under a ``lax.cond`` (as
``optax.apply_if_finite`` does) only when the batch and its loss, metrics and gradients are
finite, and a bad batch also skips every forward and backward pass; so XLA updates the
donated state in place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from oppo_jax.config.schema import PPOConfig
from oppo_jax.models import lora
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel import offload
from oppo_jax.parallel.sharding import (
    DEFAULT_RULES,
    ShardingRules,
    abstract_params,
    batch_sharding,
    fitted_sharding,
    param_shardings,
    replicated,
    tracing_rules,
)
from oppo_jax.ppo.advantages import kl_estimate
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.finite import all_finite, nan_like, zeros_like
from oppo_jax.ppo.losses import aggregate, policy_loss, sequence_policy_loss


@flax.struct.dataclass
class TrainState:
    """Actor and critic parameters with their optimizer states and the update counter."""

    actor_params: dict
    critic_params: dict | None  # None: a critic-free run
    actor_opt: optax.OptState
    critic_opt: optax.OptState | None
    step: jax.Array  # PPO steps that applied at least one optimizer step (int32 scalar)
    # LoRA: the frozen bases {"actor": ..., "critic": ...} under the trained adapters (the same
    # arrays serve the reference and reward model); never trained, donated or checkpointed.
    frozen: dict | None = None

    __no_type_check__ = True  # rebuilt with sharding leaves by tree maps

    @property
    def actor_model_params(self) -> dict:
        """The actor's whole parameter tree (adapters over the frozen base, with LoRA)."""
        return lora.combine(self.actor_params, self.frozen and self.frozen["actor"])

    @property
    def critic_model_params(self) -> dict:
        """The critic's whole parameter tree (adapters and value head over the frozen base);
        None without a critic."""
        if self.critic_params is None:
            return None
        return lora.combine(self.critic_params, self.frozen and self.frozen["critic"])


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
    """Static description of the update: models, hyper-parameters and optimizers."""

    actor: ModelConfig
    critic: ModelConfig | None  # None: critic-free (``PPOConfig.uses_critic``)
    ppo: PPOConfig
    temperature: float
    actor_tx: optax.GradientTransformation
    critic_tx: optax.GradientTransformation | None


@dataclasses.dataclass(frozen=True)
class UpdateLayout:
    """Where a sharded update's arrays live: the mesh, its rules and the train state's shardings.

    None in place of a layout (single device, plain jit) constrains nothing.
    """

    mesh: Mesh
    rules: ShardingRules
    state: TrainState  # NamedSharding leaves, from ``train_state_shardings``

    def tracing(self):
        """Make ``nn.with_logical_constraint`` act while tracing under jit (see
        ``sharding.tracing_rules``)."""
        return tracing_rules(self.mesh, self.rules)

    def rows(self, tree, axis: int = 0):
        """``tree`` with each leaf's ``axis`` (its rows) over the batch axes, the rest replicated;
        a row count the batch axes do not divide stays replicated."""

        def one(x):
            axes = (None,) * axis + ("batch",) + (None,) * (x.ndim - axis - 1)
            return jax.lax.with_sharding_constraint(
                x, fitted_sharding(self.mesh, x.shape, axes, self.rules)
            )

        return jax.tree.map(one, tree)

    def like_params(self, grads):
        """(actor, critic) gradient trees laid out like the parameters they belong to."""
        targets = (self.state.actor_params, self.state.critic_params)
        return jax.lax.with_sharding_constraint(grads, targets)


def init_train_state(spec: UpdateSpec, actor_params, critic_params) -> TrainState:
    """Fresh optimizer states for the given parameters (follows their shardings under jit)."""
    return TrainState(
        actor_params=actor_params,
        critic_params=critic_params,
        actor_opt=spec.actor_tx.init(actor_params),
        critic_opt=None if spec.critic is None else spec.critic_tx.init(critic_params),
        step=jnp.zeros((), jnp.int32),
    )


def actor_objective(ppo, logp, entropy, mb, kl_coef, weights=None):
    """The actor's loss from per-token log-probs, padded or packed (``weights``)."""
    is_clip = ppo.importance_clip if ppo.importance_correction else None
    clip = ppo.cliprange if ppo.cliprange_high is None else (ppo.cliprange, ppo.cliprange_high)
    if ppo.importance_sampling_level != "token":  # one ratio per sequence (GSPO, TRL's RLOO)
        level = ppo.importance_sampling_level
        pg, aux = sequence_policy_loss(
            logp, mb.old_logp, mb.advantages, mb.mask, clip, ppo.loss_agg, level, weights
        )
    else:
        pg, aux = policy_loss(
            logp,
            mb.old_logp,
            mb.advantages,
            mb.mask,
            clip,
            ppo.loss_agg,
            importance=(mb.behaviour_logp, is_clip) if is_clip else None,
            weights=weights,
        )
    # The entropy is a token mean whatever the loss's aggregation (TRL's GRPO); dapo's
    # normalizer is the minibatch's tokens, as its loss's.
    agg = "dapo" if ppo.loss_agg == "dapo" else "token_mean"
    by_token = None if weights is None or agg == "dapo" else weights.replace(loss=weights.mean)
    mean_entropy = aggregate(entropy, mb.mask, agg, weights if agg == "dapo" else by_token)
    loss = pg - ppo.entropy_coef * mean_entropy
    if not ppo.kl_in_reward:
        kl = kl_estimate(logp, mb.ref_logp, ppo.kl_estimator)
        loss = loss + kl_coef * aggregate(kl, mb.mask, ppo.loss_agg, weights)
    return loss, {"policy_loss": pg, "entropy": mean_entropy, **aux}


@dataclasses.dataclass(frozen=True)
class Losses:
    """What one microbatch costs each model: the padded update's losses, or the packed
    update's (``oppo_jax.ppo.packed_update``). ``prepare`` turns a microbatch's scanned inputs
    into what the losses read (under the layout's constraints)."""

    prepare: Callable  # (microbatch inputs) -> microbatch
    actor: Callable  # (params, microbatch, kl_coef) -> (loss, aux)
    critic: Callable  # (params, microbatch) -> (loss, aux)
    # (microbatch inputs) -> bool: whether it holds any token; one that holds none adds zero
    # gradients and metrics without running the models (None: every microbatch runs)
    runs: Callable | None = None


def _gradients(spec: UpdateSpec, losses: Losses, layout, kl_coef, batch_ok, params, parts):
    """(actor, critic) gradients summed over ``parts`` (leading axis: the microbatches, or the
    packed update's chunks) and divided by ``grad_accum_steps``, and each part's loss metrics
    [parts]; NaN, with no model work at all, when not ``batch_ok``."""
    actor_grad_fn = jax.grad(losses.actor, has_aux=True)
    critic_grad_fn = jax.grad(losses.critic, has_aux=True)
    constrain = (lambda g: g) if layout is None else layout.like_params

    def compute(part):
        mb = losses.prepare(part)
        g_actor, a_aux = actor_grad_fn(params[0], mb, kl_coef)
        if spec.critic is None:  # critic-free: nothing to differentiate
            return constrain((g_actor, None)), a_aux
        g_critic, c_aux = critic_grad_fn(params[1], mb)
        return constrain((g_actor, g_critic)), {**a_aux, **c_aux}

    def guarded(mb):
        if losses.runs is None:
            return jax.lax.cond(batch_ok, compute, lambda _: nan_like(shapes), mb)
        # NaN for a non-finite batch (as above), zeros for an empty chunk, else the models
        branch = jnp.where(batch_ok, jnp.where(losses.runs(mb), 2, 1), 0)
        branches = (lambda _: nan_like(shapes), lambda _: zeros_like(shapes), compute)
        return jax.lax.switch(branch, branches, mb)

    # A divides the sum, whatever the parts (packed: K >= A chunks); one part means A = 1.
    steps = spec.ppo.grad_accum_steps
    shapes = jax.eval_shape(compute, jax.tree.map(lambda x: x[0], parts))
    if jax.tree.leaves(parts)[0].shape[0] == 1:  # no accumulator: one parameter-sized buffer less
        grads, aux = guarded(jax.tree.map(lambda x: x[0], parts))
        return grads, jax.tree.map(lambda v: v[None], aux)

    def micro(carry, mb):
        grads, aux = guarded(mb)
        return constrain(jax.tree.map(jnp.add, carry, grads)), aux

    zeros = constrain(jax.tree.map(jnp.zeros_like, params))
    grads, aux = jax.lax.scan(micro, zeros, parts)
    return jax.tree.map(lambda g: g / steps, grads), aux


def _apply(spec: UpdateSpec, grads, state: TrainState) -> TrainState:
    """One optimizer update of the actor and one of the critic."""
    g_actor, g_critic = grads
    a_updates, actor_opt = spec.actor_tx.update(g_actor, state.actor_opt, state.actor_params)
    state = state.replace(
        actor_params=optax.apply_updates(state.actor_params, a_updates), actor_opt=actor_opt
    )
    if spec.critic is None:
        return state
    c_updates, critic_opt = spec.critic_tx.update(g_critic, state.critic_opt, state.critic_params)
    return state.replace(
        critic_params=optax.apply_updates(state.critic_params, c_updates), critic_opt=critic_opt
    )


def optimizer_step(spec: UpdateSpec, losses: Losses, layout, kl_coef, batch_ok, state, parts):
    """Average gradients over the microbatches ``parts``, then apply one actor and one critic
    update, or neither when the batch, a loss, a metric or a gradient is not finite
    (``applied``)."""
    params = (state.actor_params, state.critic_params)
    losses = lora.over_frozen(losses, state.frozen)  # differentiate the trained tree only
    grads, aux = _gradients(spec, losses, layout, kl_coef, batch_ok, params, parts)
    # Each part's metrics are its share of the mean over A microbatches (as the gradients).
    metrics = jax.tree.map(lambda v: jnp.sum(v) / spec.ppo.grad_accum_steps, aux)
    # A NaN/Inf gradient makes its global norm non-finite, so these checks cover the gradients.
    metrics["actor_grad_norm"] = optax.tree.norm(grads[0])
    if spec.critic is not None:
        metrics["critic_grad_norm"] = optax.tree.norm(grads[1])
    ok = batch_ok & all_finite(metrics)
    # A cond, as in optax.apply_if_finite: XLA then updates the carried (donated) state in
    # place. A select between old and new state kept the new moments as extra temporaries.
    state = jax.lax.cond(ok, functools.partial(_apply, spec, grads), lambda s: s, state)
    metrics["applied"] = ok.astype(jnp.float32)
    return state, metrics


def _mean_metrics(stacked: dict) -> dict:
    """Means over the applied optimizer steps (NaN when none was), and how many were skipped."""
    applied = stacked.pop("applied")
    count = jnp.sum(applied)
    metrics = {
        name: jnp.where(count > 0, jnp.sum(jnp.where(applied > 0, v, 0.0)) / count, jnp.nan)
        for name, v in stacked.items()
    }
    metrics["skipped_steps"] = applied.size - count  # float32, like every metric
    return metrics


def finish_update(spec: UpdateSpec, new_state: TrainState, stacked: dict, batch_ok):
    """The update's metrics from the stacked per-step ones, and the PPO step counter."""
    metrics = _mean_metrics(stacked)
    skipped = metrics["skipped_steps"]
    metrics["nonfinite_batch"] = (~batch_ok).astype(jnp.float32)
    metrics["nonfinite_update"] = (batch_ok & (skipped > 0)).astype(jnp.float32)
    applied_any = skipped < spec.ppo.ppo_epochs * spec.ppo.num_minibatches
    return new_state.replace(step=new_state.step + applied_any.astype(jnp.int32)), metrics


def train_state_shardings(spec: UpdateSpec, mesh, rules: ShardingRules = DEFAULT_RULES):
    """NamedShardings of a TrainState: optimizer moments follow their (trained) parameters."""
    repl = replicated(mesh)

    def model_and_opt(cfg, tx):
        params_sh, frozen_sh = lora.split(param_shardings(cfg, mesh, rules), cfg)
        abstract_opt = jax.eval_shape(tx.init, lora.split(abstract_params(cfg), cfg)[0])
        opt_sh = optax.tree_map_params(
            tx, lambda _, sh: sh, abstract_opt, params_sh, transform_non_params=lambda _: repl
        )
        opt_sh = offload.resting_shardings(tx, opt_sh)  # optim.offload: in host memory
        return params_sh, opt_sh, frozen_sh

    actor_sh, actor_opt_sh, actor_frozen = model_and_opt(spec.actor, spec.actor_tx)
    critic_sh = critic_opt_sh = critic_frozen = None  # critic-free: no critic at all
    if spec.critic is not None:
        critic_sh, critic_opt_sh, critic_frozen = model_and_opt(spec.critic, spec.critic_tx)
    bases = {"actor": actor_frozen, "critic": critic_frozen}
    frozen = None if actor_frozen is None else {k: v for k, v in bases.items() if v is not None}
    return TrainState(actor_sh, critic_sh, actor_opt_sh, critic_opt_sh, step=repl, frozen=frozen)


def batch_shardings(mesh, rules: ShardingRules = DEFAULT_RULES) -> PPOBatch:
    """Every PPOBatch field sharded over its row axis (data × fsdp), the rest replicated."""
    rows = batch_sharding(mesh, 1, rules)
    table = batch_sharding(mesh, 2, rules)
    fields = {f.name: table for f in dataclasses.fields(PPOBatch)}
    return PPOBatch(**{**fields, "prompt_len": rows, "scores": rows})


def make_sharded_init(spec: UpdateSpec, mesh, rules: ShardingRules = DEFAULT_RULES):
    """A jitted ``init_train_state`` whose outputs are born with the train-state shardings."""
    state_sh = train_state_shardings(spec, mesh, rules)
    return jax.jit(
        functools.partial(init_train_state, spec),
        in_shardings=(state_sh.actor_params, state_sh.critic_params),
        out_shardings=state_sh.replace(frozen=None),  # LoRA bases are attached afterwards
    )
