"""What the optimizer trains and what stays frozen, at the start of a run (precision and LoRA).

Precision policy: the trained parameters (the whole actor and critic, or with LoRA their
adapters and the critic's value head) are a master copy in ``optim.master_dtype`` (float32 by
default), and so are their AdamW moments (optax keeps moments in the parameters' dtype). The
model computes in ``model.dtype`` (each Dense casts its weights to it), so the forward is what
bf16 weights give, while an update far smaller than a bf16 weight's spacing still accumulates.
Frozen weights (the reference, the reward model, LoRA's bases) stay in ``model.param_dtype``.

With LoRA one copy of each base serves two models: the actor's base is the reference, and the
critic's base is the reward model's (``critic_init=reward``) or the actor's (``actor``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from oppo_jax.models import lora
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import init_params
from oppo_jax.parallel.sharding import abstract_params, param_shardings
from oppo_jax.ppo.update import init_train_state


def master_copy(tree, dtype):
    """A fresh copy of ``tree`` in ``dtype`` (a copy even when the dtype already matches: the
    update donates its state, which must not delete arrays the scorers read)."""
    return jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True), tree)


@functools.partial(jax.jit, static_argnums=(0,))
def _trained_init(cfg: ModelConfig, key):
    # Only the trained part is returned, so XLA drops the random base it would build.
    return lora.split(init_params(cfg, key), cfg)[0]


def fresh_trained(cfg: ModelConfig, key: jax.Array, mesh):
    """New adapters (and, for a score head, a new head) of ``cfg``, born sharded on ``mesh``."""
    shardings = lora.split(param_shardings(cfg, mesh), cfg)[0]
    return jax.device_put(_trained_init(cfg, key), shardings)


def pick(base: dict, like: dict) -> dict:
    """``base``'s top-level entries named in ``like`` (no copy): a critic's base taken from the
    actor's parameters leaves out the LM head."""
    return {k: base[k] for k in like}


def initial_params(spec, actor_params, critic_params, critic_base, mesh, key, dtype):
    """(actor trained, critic trained, frozen bases or None) for a run's first train state.

    ``critic_params`` is the critic's full starting tree (full-parameter training);
    ``critic_base`` the tree a LoRA critic sits on (the reward model's or the actor's
    parameters, shared, not copied). ``dtype`` is ``optim.master_dtype``.
    """
    a_cfg, c_cfg = spec.actor, spec.critic  # c_cfg None: critic-free, the actor alone
    if not a_cfg.lora_rank:
        critic = None if c_cfg is None else master_copy(critic_params, dtype)
        return master_copy(actor_params, dtype), critic, None
    a_key, c_key = jax.random.split(key)
    frozen = {"actor": pick(actor_params, lora.split(param_shardings(a_cfg, mesh), a_cfg)[1])}
    a_fresh = fresh_trained(a_cfg, a_key, mesh)
    if "lm_head" in a_fresh:  # model.lora_train_head: the actor's own head, trained on
        a_fresh = {**a_fresh, "lm_head": actor_params["lm_head"]}
    actor_trained = master_copy(a_fresh, dtype)
    if c_cfg is None:
        return actor_trained, None, frozen
    c_fresh = fresh_trained(c_cfg, c_key, mesh)
    if "score" in critic_base:  # the reward model's head starts the value head (as without LoRA)
        c_fresh = {**c_fresh, "score": master_copy(critic_base["score"], dtype)}
    frozen["critic"] = pick(critic_base, lora.split(param_shardings(c_cfg, mesh), c_cfg)[1])
    return actor_trained, master_copy(c_fresh, dtype), frozen


def abstract_train_state(spec, master: str, frozen_dtype: str | None = None):
    """The train state's ShapeDtypeStructs (nothing allocated): trained parameters (LoRA:
    adapters and the value head) and their moments in ``master``, LoRA's frozen bases in
    ``frozen_dtype`` (default: the models' ``param_dtype``)."""

    def as_dtype(tree, dtype):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), tree)

    def trained(cfg):
        return None if cfg is None else as_dtype(lora.split(abstract_params(cfg), cfg)[0], master)

    init = functools.partial(init_train_state, spec)
    state = jax.eval_shape(init, trained(spec.actor), trained(spec.critic))
    if not spec.actor.lora_rank:
        return state
    models = {"actor": spec.actor, "critic": spec.critic}
    models = {role: m for role, m in models.items() if m is not None}
    frozen = {
        role: as_dtype(lora.split(abstract_params(m), m)[1], frozen_dtype or m.param_dtype)
        for role, m in models.items()
    }
    return state.replace(frozen=frozen)
