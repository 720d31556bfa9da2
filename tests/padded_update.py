"""The padded PPO update: every minibatch a row slice of the [B, P + R] batch, each
microbatch run over its whole padded rows. The packed update (``oppo_jax.ppo.packed_update``,
what runs) must equal it up to float summation order: it shares the optimizer step's
application, the non-finite guards and the metrics (``oppo_jax.ppo.update.apply_if_finite``);
the gradients' accumulation over the microbatches is this oracle's own (the packed update's
also skips empty chunks), so only the layout differs.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.models import lora
from oppo_jax.parallel.sharding import DEFAULT_RULES, ShardingRules, replicated
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.finite import all_finite, nan_like
from oppo_jax.ppo.losses import value_loss
from oppo_jax.ppo.off_policy import finish_correction
from oppo_jax.ppo.packing import host_lengths
from oppo_jax.ppo.update import (
    TrainState,
    UpdateLayout,
    UpdateSpec,
    actor_objective,
    apply_if_finite,
    batch_shardings,
    finish_update,
    train_state_shardings,
)
from tests.oracles import critic_values, policy_logprobs


def actor_loss(spec: UpdateSpec, params, mb: PPOBatch, kl_coef):
    """Clipped surrogate (+ entropy bonus, + KL-in-loss) on one microbatch; returns (loss, aux)."""
    logp, entropy = policy_logprobs(
        spec.actor, params, mb.tokens, mb.prompt_len, mb.response_len, spec.temperature
    )
    return actor_objective(spec.ppo, logp, entropy, mb, kl_coef)


def critic_loss(spec: UpdateSpec, params, mb: PPOBatch, kl_coef=None):
    """vf_coef × clipped value loss on one microbatch; returns (loss, aux) (``kl_coef``
    unused: both losses are called alike)."""
    values = critic_values(spec.critic, params, mb.tokens, mb.prompt_len, mb.response_len)
    vf, aux = value_loss(
        values, mb.old_values, mb.returns, mb.mask, spec.ppo.cliprange_value, spec.ppo.loss_agg
    )
    return spec.ppo.vf_coef * vf, {"value_loss": vf, **aux}


def _split(tree, parts: int, layout: UpdateLayout | None):
    """[N, ...] leaves -> [parts, N / parts, ...], part j holding rows j, j + parts, j + 2·parts...

    Strided, not contiguous: the batch axes hold rows in contiguous blocks, so every part keeps
    an equal share of rows on every device and the scan over parts (axis 0, unsharded) moves no
    data. Example: N = 8, parts = 2 -> part 0 = rows [0, 2, 4, 6], part 1 = rows [1, 3, 5, 7].
    """

    def one(x):
        return jnp.swapaxes(x.reshape((x.shape[0] // parts, parts) + x.shape[1:]), 0, 1)

    split = jax.tree.map(one, tree)
    return split if layout is None else layout.rows(split, axis=1)


LOSSES = {"actor": actor_loss, "critic": critic_loss}  # by trained model


def _gradients(spec: UpdateSpec, layout, kl_coef, batch_ok, state: TrainState, parts):
    """{model: gradients} of each trained model summed over the microbatches ``parts``
    (leading axis A) and divided by A, and each one's loss metrics [A]; NaN, with no model
    work, when not ``batch_ok``."""
    losses = {m: functools.partial(LOSSES[m], spec) for m in spec.trained}
    grad_fns = {
        m: jax.grad(f, has_aux=True) for m, f in lora.over_frozen(losses, state.frozen).items()
    }
    params = {m: state.params(m) for m in spec.trained}
    constrain = (lambda g: g) if layout is None else layout.like_params

    def compute(part):
        mb = part if layout is None else layout.rows(part)
        grads, aux = {}, {}
        for model, grad_fn in grad_fns.items():
            grads[model], model_aux = grad_fn(params[model], mb, kl_coef)
            aux |= model_aux
        return constrain(grads), aux

    def guarded(part):
        return jax.lax.cond(batch_ok, compute, lambda _: nan_like(shapes), part)

    shapes = jax.eval_shape(compute, jax.tree.map(lambda x: x[0], parts))
    if jax.tree.leaves(parts)[0].shape[0] == 1:  # no accumulator: one parameter-sized buffer less
        grads, aux = guarded(jax.tree.map(lambda x: x[0], parts))
        return grads, jax.tree.map(lambda v: v[None], aux)

    def micro(carry, part):
        grads, aux = guarded(part)
        return constrain(jax.tree.map(jnp.add, carry, grads)), aux

    grads, aux = jax.lax.scan(micro, constrain(jax.tree.map(jnp.zeros_like, params)), parts)
    return jax.tree.map(lambda g: g / spec.ppo.grad_accum_steps, grads), aux


def _epochs(spec: UpdateSpec, layout, batch: PPOBatch, key, kl_coef, batch_ok, state):
    """Every optimizer step of one PPO step; metrics are stacked [epochs, minibatches]."""
    num_rows = batch.tokens.shape[0]
    accum = spec.ppo.grad_accum_steps

    def step(state, minibatch):
        parts = _split(minibatch, accum, layout)
        grads, aux = _gradients(spec, layout, kl_coef, batch_ok, state, parts)
        return apply_if_finite(spec, grads, aux, batch_ok, state)

    def epoch(state, epoch_key):
        perm = jax.random.permutation(epoch_key, num_rows)
        shuffled = jax.tree.map(lambda x: x[perm], batch)
        shuffled = shuffled if layout is None else layout.rows(shuffled)
        return jax.lax.scan(step, state, _split(shuffled, spec.ppo.num_minibatches, layout))

    keys = jax.random.split(key, spec.ppo.ppo_epochs)
    return jax.lax.scan(epoch, state, keys)


def ppo_update(
    spec: UpdateSpec,
    state: TrainState,
    batch: PPOBatch,
    key,
    kl_coef,
    layout: UpdateLayout | None = None,
):
    """All epochs and minibatches of one PPO step; returns the new state and mean metrics.

    Each epoch draws a fresh permutation of the B rows from ``key`` and splits it into
    ``num_minibatches`` minibatches. Non-finite values skip work, never apply it:
    - NaN/Inf anywhere in the batch skips every optimizer step without running the model
      (``nonfinite_batch`` = 1): the state comes back bitwise unchanged, the loss metrics NaN;
    - a NaN/Inf loss, metric or gradient skips that optimizer step, actor and critic together
      (``nonfinite_update`` = 1): the other steps still apply, the optimizers' own step
      counts skip it too, and the loss metrics average the applied steps only.
    ``skipped_steps`` counts the skipped optimizer steps, and ``state.step`` grows by one when
    at least one was applied. ``layout`` (see ``make_sharded_update``) lays arrays out on a mesh.
    """
    context = contextlib.nullcontext() if layout is None else layout.tracing()
    with context:
        batch_ok = all_finite(batch)
        new_state, stacked = _epochs(spec, layout, batch, key, kl_coef, batch_ok, state)
    new_state, metrics = finish_update(spec, new_state, stacked, batch_ok)
    return new_state, finish_correction(spec.ppo, metrics, batch)


def jit_keeping_frozen(fn, in_shardings=None, out_shardings=None, name: str = "inner"):
    """``jax.jit`` of ``fn(state, *args) -> (state, aux)`` donating ``state`` except its
    ``frozen`` bases: those arrays also serve the reference and reward scorers, and a donated
    array is deleted. Has ``.lower(state, *args)`` like a jitted function; its program is
    called ``name``."""

    def inner(trained_state, frozen, *args):
        new, aux = fn(trained_state.replace(frozen=frozen), *args)
        return new.replace(frozen=None), aux

    inner.__name__ = inner.__qualname__ = name

    kwargs = {}
    if in_shardings is not None:
        state_sh = in_shardings[0]
        kwargs["in_shardings"] = (state_sh.replace(frozen=None), state_sh.frozen, *in_shardings[1:])
        kwargs["out_shardings"] = (out_shardings[0].replace(frozen=None), *out_shardings[1:])
    jitted = jax.jit(inner, donate_argnums=(0,), **kwargs)

    def call(state, *args):
        new, aux = jitted(state.replace(frozen=None), state.frozen, *args)
        return new.replace(frozen=state.frozen), aux

    call.lower = lambda state, *args: jitted.lower(state.replace(frozen=None), state.frozen, *args)
    return call


def make_sharded_update(spec: UpdateSpec, mesh, rules: ShardingRules = DEFAULT_RULES):
    """``ppo_update`` jitted once over ``mesh`` with explicit shardings, donating the state,
    traced with ``rules`` active (see ``UpdateLayout``).

    Returns ``(update, state_shardings)`` where ``update(state, batch, key, kl_coef)``.
    """
    state_sh = train_state_shardings(spec, mesh, rules)
    repl = replicated(mesh)
    layout = UpdateLayout(mesh, rules, state_sh)
    update = jit_keeping_frozen(  # the frozen LoRA bases are not donated
        functools.partial(ppo_update, spec, layout=layout),
        in_shardings=(state_sh, batch_shardings(mesh, rules), repl, repl),
        out_shardings=(state_sh, repl),
    )
    return update, state_sh


class PaddedUpdate:
    """The padded update with the step's call signature and token accounting."""

    def __init__(self, spec: UpdateSpec, jitted):
        self.spec, self.jitted = spec, jitted

    def __call__(self, state, batch: PPOBatch, key, kl_coef, lengths=None):
        prompt_len, response_len = host_lengths(batch) if lengths is None else lengths
        state, metrics = self.jitted(state, batch, key, kl_coef)
        epochs = self.spec.ppo.ppo_epochs
        real = epochs * int(np.sum(prompt_len) + np.sum(response_len))
        return state, {
            **metrics,
            "update_tokens_real": float(real),
            "update_tokens_computed": float(epochs * batch.tokens.size),
        }

    update_batch = __call__  # as the step calls the run's update (PackedUpdate.update_batch)


def make_padded_update(spec: UpdateSpec, mesh=None) -> PaddedUpdate:
    """The padded update jitted as a run jits the packed one (``make_update``)."""
    if mesh is None:
        return PaddedUpdate(spec, jit_keeping_frozen(functools.partial(ppo_update, spec)))
    return PaddedUpdate(spec, make_sharded_update(spec, mesh)[0])
