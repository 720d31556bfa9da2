"""The PPO update a run dispatches: each minibatch computed on its sequences' real tokens
packed into rows and dealt to the gradient accumulation steps' chunks (``ppo.packing``).

The minibatches and microbatches are those of the padded reference update (the host replays
the update key's permutations; ``tests/padded_update.py``), with the same losses as weighted
sums, the same accumulation of each trained model's gradients (``UpdateSpec.trained``; a
chunk holding no sequence adds zeros without running the models) and the same non-finite
guard (``update.apply_if_finite``): only the layout differs, so the results equal the padded
update's up to float summation order. The LM head runs at the chunk's response slots only,
in vocabulary blocks.

``make_update`` builds it: ``update(state, batch, key, kl_coef, lengths=None)``, where
``lengths`` = (prompt_len, response_len) host arrays of the batch's rows (read from the batch
when not given). It adds ``update_tokens_real`` and ``update_tokens_computed`` (token slots of
the forward passes, per model) to the metrics, and its packed shape (``update_rows``,
``update_width``, ``update_slots``); ``PackedUpdate.shapes`` keeps the shapes it ran.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.models import lora
from oppo_jax.models.heads import VOCAB_BLOCK, apply_head, token_logprobs_and_entropy
from oppo_jax.models.transformer import Transformer
from oppo_jax.parallel.sharding import (
    DEFAULT_RULES,
    ShardingRules,
    batch_shards,
    to_host,
)
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.finite import all_finite, nan_like, zeros_like
from oppo_jax.ppo.losses import value_loss
from oppo_jax.ppo.off_policy import finish_correction
from oppo_jax.ppo.packing import (
    PackedMicrobatch,
    PackIndices,
    gather_microbatch,
    host_lengths,
    microbatch_rows,
    packed_shapes,
    plan_packing,
)
from oppo_jax.ppo.update import (
    UpdateLayout,
    UpdateSpec,
    actor_objective,
    apply_if_finite,
    finish_update,
    train_state_shardings,
)


def _response_hidden(cfg, params, mb: PackedMicrobatch):
    """Final-normed hidden states [N, D] at the response slots of a packed microbatch."""
    hidden, _ = Transformer(cfg).apply(
        {"params": params},
        mb.tokens,
        positions=mb.positions,
        segment_ids=mb.segments,
        return_hidden=True,
    )
    return hidden.reshape(-1, hidden.shape[-1])[mb.resp_at]


def packed_actor_loss(spec: UpdateSpec, params, mb: PackedMicrobatch, kl_coef):
    """The actor's loss (``update.actor_objective``) on a packed chunk (its reductions
    weighted per token)."""
    hidden = _response_hidden(spec.actor, params, mb)
    logp, entropy = token_logprobs_and_entropy(
        spec.actor, params, hidden, mb.targets, spec.temperature, VOCAB_BLOCK
    )
    return actor_objective(spec.ppo, logp, entropy, mb, kl_coef, mb.weights)


def packed_critic_loss(spec: UpdateSpec, params, mb: PackedMicrobatch, kl_coef=None):
    """vf_coef × the clipped value loss on a packed chunk (its reductions weighted per token);
    ``kl_coef`` is unused (the critic's loss has no KL term), so both losses are called
    alike."""
    del kl_coef
    hidden = _response_hidden(spec.critic, params, mb)
    values = apply_head(spec.critic, params, hidden)[..., 0].astype(jnp.float32)
    ppo = spec.ppo
    vf, aux = value_loss(
        values,
        mb.old_values,
        mb.returns,
        mb.mask,
        ppo.cliprange_value,
        ppo.loss_agg,
        weights=mb.weights,
    )
    return ppo.vf_coef * vf, {"value_loss": vf, **aux}


LOSSES = {"actor": packed_actor_loss, "critic": packed_critic_loss}  # by trained model


def _gradients(spec: UpdateSpec, prepare, layout, kl_coef, batch_ok, state, parts):
    """{model: gradients} of each trained model summed over the chunks ``parts`` (leading axis
    K) and divided by ``grad_accum_steps``, and each chunk's loss metrics [K]; NaN, with no
    model work at all, when not ``batch_ok``; zeros, without running the models, for a chunk
    the minibatch's rows did not reach (``PackIndices.used``)."""
    # Differentiate the trained trees only (LoRA: the adapters over the frozen bases).
    losses = {m: functools.partial(LOSSES[m], spec) for m in spec.trained}
    grad_fns = {
        m: jax.grad(f, has_aux=True) for m, f in lora.over_frozen(losses, state.frozen).items()
    }
    params = {m: state.params(m) for m in spec.trained}
    constrain = (lambda g: g) if layout is None else layout.like_params

    def compute(idx: PackIndices):
        mb, grads, aux = prepare(idx), {}, {}
        for model, grad_fn in grad_fns.items():
            grads[model], model_aux = grad_fn(params[model], mb, kl_coef)
            aux |= model_aux
        return constrain(grads), aux

    def guarded(idx: PackIndices):
        # NaN for a non-finite batch, zeros for an empty chunk, else the models
        branch = jnp.where(batch_ok, jnp.where(idx.used, 2, 1), 0)
        branches = (lambda _: nan_like(shapes), lambda _: zeros_like(shapes), compute)
        return jax.lax.switch(branch, branches, idx)

    # A divides the sum, whatever the chunks (K >= A); one chunk means A = 1.
    steps = spec.ppo.grad_accum_steps
    shapes = jax.eval_shape(compute, jax.tree.map(lambda x: x[0], parts))
    if jax.tree.leaves(parts)[0].shape[0] == 1:  # no accumulator: one parameter-sized buffer less
        grads, aux = guarded(jax.tree.map(lambda x: x[0], parts))
        return grads, jax.tree.map(lambda v: v[None], aux)

    def micro(carry, idx):
        grads, aux = guarded(idx)
        return constrain(jax.tree.map(jnp.add, carry, grads)), aux

    zeros = constrain(jax.tree.map(jnp.zeros_like, params))
    grads, aux = jax.lax.scan(micro, zeros, parts)
    return jax.tree.map(lambda g: g / steps, grads), aux


def _optimizer_step(spec: UpdateSpec, prepare, layout, kl_coef, batch_ok, state, parts):
    """One optimizer step over one minibatch's chunks ``parts`` (``update.apply_if_finite``)."""
    grads, aux = _gradients(spec, prepare, layout, kl_coef, batch_ok, state, parts)
    return apply_if_finite(spec, grads, aux, batch_ok, state)


def ppo_update_packed(
    spec: UpdateSpec,
    state,
    batch: PPOBatch,
    plan: PackIndices,
    kl_coef,
    layout: UpdateLayout | None = None,
):
    """All epochs and minibatches of one PPO step, every accumulation chunk gathered from
    ``batch`` onto the packed layout by ``plan`` (leading axes [epochs, minibatches, chunks]);
    returns the new state and mean metrics. Non-finite values skip work, never apply it: a
    NaN/Inf anywhere in the batch skips every optimizer step (``nonfinite_batch``), a
    non-finite loss, metric or gradient skips that step (``nonfinite_update``), and
    ``skipped_steps`` counts them (``update.apply_if_finite``, ``update.finish_update``)."""
    minibatch = batch.tokens.shape[0] // spec.ppo.num_minibatches  # sequences per minibatch

    def prepare(idx: PackIndices) -> PackedMicrobatch:
        mb = gather_microbatch(batch, idx, minibatch)
        ppo = spec.ppo
        if ppo.importance_sampling_level != "token" or ppo.off_policy_correction == "mis":
            # A ratio per sequence (the loss's, MIS's) sums over each sequence's slots: their
            # minibatch-local ids (``minibatch`` for unused slots); they are all in one chunk.
            seqs = mb.weights.replace(segments=idx.resp_seg, num_segments=minibatch + 1)
            mb = mb.replace(weights=seqs)
        return mb if layout is None else layout.rows(mb)

    context = contextlib.nullcontext() if layout is None else layout.tracing()
    with context:
        batch_ok = all_finite(batch)
        step = functools.partial(_optimizer_step, spec, prepare, layout, kl_coef, batch_ok)
        new_state, stacked = jax.lax.scan(
            lambda s, epoch_plan: jax.lax.scan(step, s, epoch_plan), state, plan
        )
    new_state, metrics = finish_update(spec, new_state, stacked, batch_ok)
    # The off-policy correction's metrics, over the whole batch's trained tokens (once).
    return new_state, finish_correction(spec.ppo, metrics, batch)


@functools.partial(jax.jit, static_argnames=("spec", "layout"), donate_argnames=("trained",))
def oppo_update(trained, frozen, batch: PPOBatch, plan: PackIndices, kl_coef, *, spec, layout):
    """The update's program: ``ppo_update_packed`` of the train state ``trained`` (donated)
    with its LoRA bases ``frozen`` passed apart (None without LoRA; never donated, they also
    serve the scorers and a donated array is deleted): (new state without its bases, metrics).
    With a ``layout`` (a mesh), the state keeps its shardings, the batch its rows over the
    batch axes, and the plan and the metrics are replicated."""
    state = trained.replace(frozen=frozen)
    if layout is not None:
        state, batch, plan = layout.hold(state, batch, plan)
    new, metrics = ppo_update_packed(spec, state, batch, plan, kl_coef, layout)
    if layout is not None:
        new, metrics = layout.hold_outputs(new, metrics)
    return new.replace(frozen=None), metrics


@functools.partial(jax.jit, static_argnums=(1, 2))
def _permutations(key, num_rows: int, epochs: int):
    """The epochs' row permutations: epoch e permutes the rows by the e-th of ``key``'s
    ``epochs`` splits (the padded reference update, ``tests/padded_update.py``, draws the
    same)."""
    keys = jax.random.split(key, epochs)
    return jnp.stack([jax.random.permutation(keys[e], num_rows) for e in range(epochs)])


class PackedUpdate:
    """The packed update as the step calls it: plans on the host, then one call of
    ``oppo_update``, which compiles once: every plan of a run has the config's one packed shape
    (``oppo_jax.ppo.packing``); the shapes seen so far are in ``shapes``. ``layout`` (an
    ``update.UpdateLayout``, None on one device) holds its arrays to a mesh's shardings."""

    def __init__(self, spec: UpdateSpec, layout: UpdateLayout | None = None):
        self.spec, self.layout = spec, layout
        self.row_multiple = 1 if layout is None else batch_shards(layout.mesh, layout.rules)
        self.shapes: set[tuple[int, int, int]] = set()

    def train_on(self, state, batch: PPOBatch, indices: PackIndices, kl_coef):
        """(new state, metrics): one call of ``oppo_update`` on a planned batch."""
        statics = {"spec": self.spec, "layout": self.layout}
        trained, frozen = state.replace(frozen=None), state.frozen
        new, metrics = oppo_update(trained, frozen, batch, indices, kl_coef, **statics)
        return new.replace(frozen=frozen), metrics

    def lower(self, state, batch: PPOBatch, indices: PackIndices, kl_coef):
        """``oppo_update`` lowered at (abstract) arguments like ``train_on``'s."""
        statics = {"spec": self.spec, "layout": self.layout}
        trained, frozen = state.replace(frozen=None), state.frozen
        return oppo_update.lower(trained, frozen, batch, indices, kl_coef, **statics)

    def plan(self, batch: PPOBatch, key, lengths=None):
        """The step's packing plan (host side)."""
        ppo = self.spec.ppo
        prompt_len, response_len = host_lengths(batch) if lengths is None else lengths
        perms = self.permutations(key, batch.tokens.shape[0])
        micro = microbatch_rows(perms, ppo.num_minibatches, ppo.grad_accum_steps)
        return plan_packing(
            prompt_len,
            response_len,
            micro,
            (batch.tokens.shape[1], batch.response_len),
            ppo.pack_granule,
            self.row_multiple,
            agg=ppo.loss_agg,
            width_factor=ppo.pack_width_factor,
        )

    def permutations(self, key, num_rows: int) -> np.ndarray:
        """[epochs, rows] each epoch's shuffle of the batch rows, drawn on the device from
        ``key`` (the one device program of the host's plan; a warm-up calls it once)."""
        return np.asarray(to_host(_permutations(key, num_rows, self.spec.ppo.ppo_epochs)))

    def shape(self, num_rows: int, full_width: int, response_width: int):
        """((Rp, W, N), K): the one packed shape of a batch of ``num_rows`` sequences, L =
        ``full_width`` and R = ``response_width``, and its chunks per minibatch
        (``packing.packed_shapes``)."""
        ppo = self.spec.ppo
        m = num_rows // (ppo.num_minibatches * ppo.grad_accum_steps)
        return packed_shapes(
            m,
            full_width,
            response_width,
            ppo.pack_granule,
            self.row_multiple,
            chunks=ppo.grad_accum_steps,
            width_factor=ppo.pack_width_factor,
        )

    def update_batch(self, state, batch: PPOBatch, key, kl_coef, lengths=None):
        """(new state, metrics): PPO epochs x minibatches on ``batch``, shuffled by ``key``;
        ``lengths`` = (prompt_len, response_len) host arrays of its rows (read from the batch
        when not given)."""
        plan = self.plan(batch, key, lengths)
        self.shapes.add(plan.shape)
        indices = plan.indices
        if self.layout is not None:  # jit moves a mismatched batch itself on one process only
            batch, indices = self.layout.place(batch, indices)
        state, metrics = self.train_on(state, batch, indices, kl_coef)
        rows, width, slots = plan.shape
        return state, {
            **metrics,
            "update_tokens_real": float(plan.tokens_real),
            "update_tokens_computed": float(plan.tokens_computed),
            "update_rows": float(rows),
            "update_width": float(width),
            "update_slots": float(slots),
        }

    __call__ = update_batch  # the update is called like a function


@functools.cache
def make_update(spec: UpdateSpec, mesh=None, rules: ShardingRules = DEFAULT_RULES):
    """The run's update (``oppo_update``, donating the state but LoRA's frozen bases); on
    ``mesh`` with its arrays held to the train state's and the batch's shardings and the
    logical rules active while tracing (``update.UpdateLayout``). One per (spec, mesh, rules):
    the layout is the program's static setting, so a later run of the same spec in the
    process compiles nothing new."""
    if mesh is None:
        return PackedUpdate(spec)
    return PackedUpdate(spec, UpdateLayout(mesh, rules, train_state_shardings(spec, mesh, rules)))
