"""The PPO update's parts: ``ppo_epochs × num_minibatches`` optimizer steps (the packed update,
``ppo.packed_update``, scans them over its packed chunks and computes their gradients).

The trained models (``UpdateSpec.trained``: the actor, and the critic where the advantage
estimator needs one, ``ppo.estimators``) are separate models with separate optimizers. The
actor minimises
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
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.estimators import kl_estimate
from oppo_jax.ppo.finite import all_finite
from oppo_jax.ppo.losses import aggregate, policy_loss, sequence_policy_loss
from oppo_jax.ppo.off_policy import correction_counts, correction_weight


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

    def params(self, model: str) -> dict | None:
        """The trained parameters of ``model`` ("actor" or "critic")."""
        return getattr(self, f"{model}_params")

    def opt(self, model: str) -> optax.OptState | None:
        """The optimizer state of ``model`` ("actor" or "critic")."""
        return getattr(self, f"{model}_opt")

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
    critic: ModelConfig | None  # None: critic-free (``estimators.Estimator.needs_critic``)
    ppo: PPOConfig
    temperature: float
    actor_tx: optax.GradientTransformation
    critic_tx: optax.GradientTransformation | None

    @property
    def trained(self) -> tuple[str, ...]:
        """The models the update trains, in update order: the actor, and the critic where
        the spec has one (``run.specs.update_spec``: where the estimator needs one)."""
        return ("actor",) if self.critic is None else ("actor", "critic")

    def tx(self, model: str) -> optax.GradientTransformation:
        """The optimizer of ``model`` ("actor" or "critic")."""
        return getattr(self, f"{model}_tx")


@dataclasses.dataclass(frozen=True, eq=False)
class UpdateLayout:
    """Where a sharded update's arrays live: the mesh, its rules and the train state's shardings.

    None in place of a layout (single device, plain jit) constrains nothing. A static setting
    of the update's program, compared by identity (``packed_update.make_update`` keeps one per
    spec, mesh and rules).
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

    def place(self, batch, indices):
        """The batch with its rows over the batch axes and the plan's indices replicated, moved
        there before the call (jit moves a mismatched argument itself on one process only)."""
        batch = jax.device_put(batch, batch_shardings(self.mesh, self.rules))
        return batch, jax.device_put(indices, replicated(self.mesh))

    def hold(self, state, batch, indices):
        """Inside the program: (state, batch, indices) held to the shardings ``place`` gives and
        the train state's (what explicit in_shardings would fix)."""
        held = (self.state, batch_shardings(self.mesh, self.rules), replicated(self.mesh))
        return jax.lax.with_sharding_constraint((state, batch, indices), held)

    def hold_outputs(self, state, metrics):
        """Inside the program: the new state on the train state's shardings, the metrics
        replicated (what explicit out_shardings would fix)."""
        return jax.lax.with_sharding_constraint(
            (state, metrics), (self.state, replicated(self.mesh))
        )

    def like_params(self, grads: dict):
        """{model: gradients} laid out like the parameters they belong to."""
        targets = {model: self.state.params(model) for model in grads}
        return jax.lax.with_sharding_constraint(grads, targets)


def init_train_state(spec: UpdateSpec, actor_params, critic_params) -> TrainState:
    """Fresh optimizer states for the given parameters (follows their shardings under jit);
    a model the spec does not train has none."""
    params = {"actor": actor_params, "critic": critic_params}
    opts = {"critic_opt": None} | {f"{m}_opt": spec.tx(m).init(params[m]) for m in spec.trained}
    return TrainState(
        actor_params=actor_params,
        critic_params=critic_params,
        **opts,
        step=jnp.zeros((), jnp.int32),
    )


def actor_objective(ppo, logp, entropy, mb, kl_coef, weights=None):
    """The actor's loss from per-token log-probs, padded or packed (``weights``), each token's
    surrogate weighted by the off-policy correction (``off_policy.correction_weight``). π_old is
    the batch's ``old_logp``, or this forward detached where ``ppo.old_is_first_forward``; the
    correction's counts then join the metrics (``off_policy.finish_correction``)."""
    old = jax.lax.stop_gradient(logp) if ppo.old_is_first_forward else mb.old_logp
    is_weight = correction_weight(ppo, old, mb.behaviour_logp, mb.mask, weights)
    clip = ppo.cliprange if ppo.cliprange_high is None else (ppo.cliprange, ppo.cliprange_high)
    if ppo.importance_sampling_level != "token":  # one ratio per sequence (GSPO, TRL's RLOO)
        # w ≥ 0 scales a token's clipped term as it scales its advantage: max(−wA·s, −wA·c) =
        # w·max(−A·s, −A·c) (exact for MIS's 0/1; TIS is refused at these levels)
        adv = mb.advantages if is_weight is None else is_weight * mb.advantages
        level = ppo.importance_sampling_level
        pg, aux = sequence_policy_loss(logp, old, adv, mb.mask, clip, ppo.loss_agg, level, weights)
    else:
        pg, aux = policy_loss(
            logp, old, mb.advantages, mb.mask, clip, ppo.loss_agg, is_weight, weights
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
    if ppo.old_is_first_forward and is_weight is not None:  # π_old is this forward: count here
        aux |= correction_counts(ppo, is_weight, mb.mask, weights)
    return loss, {"policy_loss": pg, "entropy": mean_entropy, **aux}


def _apply(spec: UpdateSpec, grads: dict, state: TrainState) -> TrainState:
    """One optimizer update of each trained model."""
    for model in spec.trained:
        params = state.params(model)
        updates, opt = spec.tx(model).update(grads[model], state.opt(model), params)
        new = {f"{model}_params": optax.apply_updates(params, updates), f"{model}_opt": opt}
        state = state.replace(**new)
    return state


def apply_if_finite(spec: UpdateSpec, grads: dict, aux: dict, batch_ok, state: TrainState):
    """One optimizer step from {model: gradients} averaged over the microbatches and their
    loss metrics ``aux`` [parts]: each trained model updated, or none when the batch, a loss,
    a metric or a gradient is not finite (``applied``). Returns the state and the step's
    metrics."""
    # Each part's metrics are its share of the mean over A microbatches (as the gradients).
    metrics = jax.tree.map(lambda v: jnp.sum(v) / spec.ppo.grad_accum_steps, aux)
    # A NaN/Inf gradient makes its global norm non-finite, so these checks cover the gradients.
    for model in spec.trained:
        metrics[f"{model}_grad_norm"] = optax.tree.norm(grads[model])
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

    # A model the spec does not train (critic-free: the critic) has no shardings at all.
    laid = {m: model_and_opt(getattr(spec, m), spec.tx(m)) for m in spec.trained}
    params, opts, bases = ({m: parts[i] for m, parts in laid.items()} for i in range(3))
    frozen = None if bases["actor"] is None else {m: b for m, b in bases.items() if b is not None}
    return TrainState(
        params["actor"],
        params.get("critic"),
        opts["actor"],
        opts.get("critic"),
        step=repl,
        frozen=frozen,
    )


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
