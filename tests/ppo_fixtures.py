"""Tiny actor/critic and random PPO batches for the update tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.config import OptimConfig, PPOConfig
from oppo_jax.models import ModelConfig, init_params
from oppo_jax.ppo.experience import ScoredRollout, build_batch
from oppo_jax.ppo.optimizer import make_optimizer
from oppo_jax.ppo.update import UpdateSpec
from tests.oracles import critic_values, policy_logprobs

ACTOR = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, qkv_bias=True,
)  # fmt: skip
CRITIC = dataclasses.replace(ACTOR, head="score")


def make_spec(ppo: PPOConfig | None = None, lr: float = 1e-3, temperature: float = 0.7):
    optim = OptimConfig(actor_lr=lr, critic_lr=lr)
    return UpdateSpec(
        actor=ACTOR,
        critic=CRITIC,
        ppo=ppo or PPOConfig(),
        temperature=temperature,
        actor_tx=make_optimizer(optim, optim.actor_lr, 100),
        critic_tx=make_optimizer(optim, optim.critic_lr, 100),
    )


def random_batch(spec: UpdateSpec, actor_params, critic_params, seed=0, rows=8, resp=6):
    """Random sequences scored by the given actor/critic, with random rewards."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(2, 5, rows)
    resp_len = rng.integers(1, resp + 1, rows)
    width = int(prompt_len.max()) + resp
    tokens = np.zeros((rows, width), np.int32)
    for b in range(rows):
        n = prompt_len[b] + resp_len[b]
        tokens[b, :n] = rng.integers(2, ACTOR.vocab_size, n)
    mask = np.arange(resp)[None, :] < resp_len[:, None]
    tokens, prompt_len, mask = map(jnp.asarray, (tokens, prompt_len, mask))
    logp, _ = policy_logprobs(ACTOR, actor_params, tokens, prompt_len, resp, spec.temperature)
    values = critic_values(CRITIC, critic_params, tokens, prompt_len, resp)
    noise = jnp.asarray(rng.normal(0, 0.05, logp.shape), jnp.float32)
    rollout = ScoredRollout(
        tokens, prompt_len, mask,
        scores=jnp.asarray(rng.normal(size=rows), jnp.float32),
        ended_with_eos=jnp.asarray(rng.random(rows) < 0.7),
        old_logp=logp, behaviour_logp=logp + noise, ref_logp=logp + noise, values=values,
    )  # fmt: skip
    return build_batch(spec.ppo, rollout, jnp.float32(0.05))[0]


def tiny_params(seed=0):
    return init_params(ACTOR, jax.random.key(seed)), init_params(CRITIC, jax.random.key(seed + 1))


class ListPrompts:
    """A prompt source over a fixed list of (prompt_id, tokens), for schedule tests."""

    def __init__(self, pairs):
        self._pairs = list(pairs)

    def take(self, k):
        taken, self._pairs = self._pairs[:k], self._pairs[k:]
        return taken


def fresh_slots(pairs, prompt_width, response_len, extra_slots=0):
    """Admit ``pairs`` (no carried sequences) into len(pairs) + extra_slots slots."""
    from oppo_jax.pipeline.carry import AdmitRule, CarryBuffer, admit

    rule = AdmitRule(len(pairs), len(pairs) + extra_slots, False, max_staleness=2)
    return admit(CarryBuffer(), ListPrompts(pairs), rule, prompt_width, response_len)


def eager_admission(slots):
    """``step.slot_admission`` on the device: the host arrays it hands to jitted programs
    would fail the type checks of functions these tests call outside jit."""
    from oppo_jax.pipeline.step import slot_admission

    return jax.tree.map(jnp.asarray, slot_admission(slots))


def reward_scores(cfg, params, tokens, seq_len):
    """Reference: a score-head model's output at each row's last valid token, from one full
    forward pass (what streamed reward scoring must equal)."""
    from oppo_jax.models import Transformer

    out, _ = Transformer(cfg).apply({"params": params}, tokens)
    last = jnp.maximum(seq_len - 1, 0)
    return jnp.take_along_axis(out[..., 0], last[:, None], axis=1)[:, 0].astype(jnp.float32)


def step_engine(kernels, placement, ref_params, reward_params, seed=1, max_staleness=2):
    """A StepEngine for schedule tests (sampling key from ``seed``)."""
    from oppo_jax.pipeline.step import StepEngine

    return StepEngine(
        kernels, placement, ref_params, reward_params, jax.random.key(seed), max_staleness
    )


def step_plan(step, batch_size, overcommit=0, chunk_size=4, kl_coef=0.05, key=None):
    """A StepPlan for schedule tests; slots reserved for exactly B + Δ."""
    from oppo_jax.pipeline.step import StepPlan

    key = jax.random.fold_in(jax.random.key(2), step) if key is None else key
    return StepPlan(step, batch_size, overcommit, batch_size + overcommit, chunk_size, kl_coef, key)
