"""Independent references the engine's production paths are checked against: plain versions,
each in one trace, of what a step does in pieces (no shipped config runs them).

- ``scan_decode`` / ``start_decode`` / ``prefill_and_start``: every slot decoded C steps by a
  ``lax.scan`` of ``decode_step`` from a one-pass prompt prefill, beside the step's
  early-stopping decode and replayed admission;
- ``replay`` / ``admit_scorer`` / ``admit_actor``: an admission with its carried prefixes
  replayed in one trace, beside the step's one compiled call per replay chunk;
- ``policy_logprobs`` / ``critic_values``: each sequence's own forward over right-padded
  rows, beside the packed scoring and the packed update.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from oppo_jax.models.heads import VOCAB_BLOCK, apply_head, token_logprobs_and_entropy
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer
from oppo_jax.parallel.sharding import constrain_slots
from oppo_jax.rollout.admission import Admission, prompt_prefill
from oppo_jax.rollout.decode import admit_decode, decode_step
from oppo_jax.rollout.layout import response_positions, response_tokens
from oppo_jax.scoring.carried import actor_spec, replay_chunk
from oppo_jax.scoring.stream import scorer_admit


@functools.cache
def scan_decode(cfg, sampling, chunk_size: int, mesh=None, kv_width=None):
    """(params, state) -> state: every slot advanced ``chunk_size`` lockstep decode steps (a
    ``lax.scan``; finished slots stay frozen), jitted donating the state."""

    def run(params, state):
        def body(carry, _):
            step = decode_step(cfg, sampling, params, carry, kv_width)
            return constrain_slots(step, mesh), None

        state, _ = jax.lax.scan(body, constrain_slots(state, mesh), None, length=chunk_size)
        return state

    return jax.jit(run, donate_argnums=(1,))


@functools.cache
def start_decode(cfg, rollout):
    """(params, prompts [S, P], prompt_lens [S], base_key, active=None) -> DecodeState: new
    prompts (slot s is prompt id s) prefilled in one pass, no carried prefix."""

    def run(params, prompts, prompt_lens, base_key, active=None):
        a = Admission.fresh(prompts, prompt_lens, rollout.max_response_len, active=active)
        return prefill_and_start(cfg, params, a, base_key, rollout)

    return jax.jit(run)


def prefill_and_start(cfg, params, admission, base_key, rollout):
    """The decode state of an admission without carried prefixes, its prompts prefilled in
    one pass (``rollout.admission.prompt_prefill``)."""
    r = rollout.max_response_len
    shape = (rollout.prompt_width, r)
    cache, hidden = prompt_prefill(cfg, params, admission, shape, rollout.mesh)
    logprobs = jnp.zeros((admission.num_slots, r), jnp.float32)
    return admit_decode(cfg, params, admission, base_key, rollout, (cache, hidden, logprobs))


def replay(spec, params, state, plan):
    """Every chunk of ``plan`` (``scoring.carried.plan_replay``) fed in order, in one trace."""
    for c in plan:
        tokens, count = jnp.asarray(c.tokens), jnp.asarray(c.count)
        state = replay_chunk(spec, params, state, tokens, count, c.kv_width)
    return state


def admit_scorer(spec, params, admission, prompt_width: int, plan):
    """A scorer's whole admission in one trace: the prompts, then the carried prefixes."""
    prompts = admission.replace(context=admission.context[:, :prompt_width])
    return replay(spec, params, scorer_admit(spec, params, prompts, prompt_width), plan)


def admit_actor(cfg, params, admission, base_key, rollout, temperature: float, plan):
    """The actor's whole admission in one trace: its prompts prefilled and its carried prefixes
    replayed as a log-prob consumer of its own tokens, then the decode state started."""
    spec = actor_spec(cfg, rollout, temperature)
    s = admit_scorer(spec, params, admission, rollout.prompt_width, plan)
    made = (s.cache, s.last_hidden, s.per_token)
    return admit_decode(cfg, params, admission, base_key, rollout, made)


def _hidden(cfg: ModelConfig, params, tokens, prompt_len, response_len: int) -> Array:
    """Final-normed hidden states at the positions whose outputs belong to response tokens."""
    hidden, _ = Transformer(cfg).apply({"params": params}, tokens, return_hidden=True)
    return gather_response(hidden, prompt_len, response_len)


def policy_logprobs(
    cfg: ModelConfig,
    params,
    tokens: Int[Array, "B L"],
    prompt_len: Int[Array, " B"],
    response_len: int,
    temperature: float,
    block: int = VOCAB_BLOCK,
) -> tuple[Float[Array, "B R"], Float[Array, "B R"]]:
    """log π(response token) under logits / temperature, and the per-token entropy (float32).

    The LM head runs at the B x R response positions only, in vocabulary blocks of ``block``
    columns: no [B, L, V] (or [B, R, V]) logits tensor exists, forward or backward.
    """
    hidden = _hidden(cfg, params, tokens, prompt_len, response_len)
    targets = response_tokens(tokens, prompt_len, response_len)
    rows = hidden.shape[0] * hidden.shape[1]
    logp, entropy = token_logprobs_and_entropy(
        cfg, params, hidden.reshape(rows, -1), targets.reshape(rows), temperature, block
    )
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)


def critic_values(
    cfg: ModelConfig, params, tokens: Int[Array, "B L"], prompt_len, response_len: int
) -> Float[Array, "B R"]:
    """V(state before each response token) from a score-head model (float32), with the score
    head applied at the response positions only."""
    hidden = _hidden(cfg, params, tokens, prompt_len, response_len)
    return apply_head(cfg, params, hidden)[..., 0].astype(jnp.float32)


def gather_response(
    out: Float[Array, "B L ..."], prompt_len: Int[Array, " B"], response_len: int
) -> Float[Array, "B R ..."]:
    """Pick the outputs that belong to each response token (positions clipped into range)."""
    pos = jnp.clip(response_positions(prompt_len, response_len), 0, out.shape[1] - 1)
    index = pos.reshape(pos.shape + (1,) * (out.ndim - 2))
    return jnp.take_along_axis(out, index, axis=1)
