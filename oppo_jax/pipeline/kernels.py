"""The compiled kernels every schedule dispatches, built once per run from static specs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from oppo_jax.pipeline.sequences import assemble_sequences, response_mask
from oppo_jax.ppo.experience import build_batch
from oppo_jax.ppo.update import UpdateSpec, ppo_update
from oppo_jax.rollout.decode import DecodeState, make_decode_chunk_emit, start_decode
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.scoring.stream import ScorerSpec, make_scorer_kernels

# reward_fn(tokens [B, L], prompt_len [B], seq_len [B]) -> scores [B]: a programmatic reward
# (e.g. a rule-based checker), applied after generation; jittable.
RewardFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Static shape and sampling settings of the rollout."""

    sampling: SamplingConfig
    prompt_width: int  # P, prompts are right-padded to this many tokens (one compiled shape)
    max_response_len: int  # R, response capacity in tokens
    eos_ids: tuple[int, ...]  # token ids that end a response
    pad_id: int = 0  # padding token id


def experience(
    spec: UpdateSpec,
    rollout: RolloutSpec,
    reward_fn: RewardFn | None,
    decoded: DecodeState,
    prompts: jax.Array,
    prompt_len: jax.Array,
    ref_logp: jax.Array,
    values: jax.Array,
    scores: jax.Array | None,
    kl_coef: jax.Array,
):
    """Build the PPO batch from a finished rollout and its scorers' outputs.

    ``old_logp`` is the log-prob recorded when each token was sampled, under the parameters of
    this step: the quantity TRL recomputes after generation, without a second actor pass.
    """
    width = rollout.max_response_len
    resp_len = decoded.num_generated
    tokens = assemble_sequences(prompts, prompt_len, decoded.tokens, resp_len, rollout.pad_id)
    if reward_fn is not None:
        scores = reward_fn(tokens, prompt_len, prompt_len + resp_len)
    last = jnp.take_along_axis(decoded.tokens, jnp.maximum(resp_len - 1, 0)[:, None], axis=1)
    ended_with_eos = (resp_len > 0) & jnp.isin(last[:, 0], jnp.asarray(rollout.eos_ids))
    batch, stats = build_batch(
        spec.ppo, tokens, prompt_len, response_mask(resp_len, width), scores, ended_with_eos,
        old_logp=decoded.logprobs, behaviour_logp=decoded.logprobs, ref_logp=ref_logp,
        values=values, kl_coef=kl_coef,
    )  # fmt: skip
    return batch, {**stats, "reward": jnp.mean(scores)}


def _start_with_marker(spec: UpdateSpec, rollout: RolloutSpec, *args):
    state = start_decode(
        spec.actor, *args, max_response_len=rollout.max_response_len,
        eos_ids=rollout.eos_ids, pad_id=rollout.pad_id,
    )  # fmt: skip
    return state, state.num_generated + 0  # a fresh array: the state itself gets donated


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Jitted functions of one run: start a rollout, decode a chunk, score, build, update."""

    spec: UpdateSpec
    rollout: RolloutSpec
    reward_fn: RewardFn | None  # programmatic reward; None: the reward model scores
    reward_model: Any  # ModelConfig of the reward model (None with reward_fn)
    start: Callable
    experience: Callable
    update: Callable

    def decode(self, chunk_size: int) -> Callable:
        """``decode_chunk_emit`` for this chunk size (compiled on first use, then cached)."""
        return make_decode_chunk_emit(self.spec.actor, self.rollout.sampling, chunk_size)

    def scorer_specs(self) -> dict[str, ScorerSpec]:
        """The streaming consumers of the actor's tokens, by role."""
        r = self.rollout.max_response_len
        specs = {
            "reference": ScorerSpec(self.spec.actor, "logprob", r, self.spec.temperature),
            "critic": ScorerSpec(self.spec.critic, "value", r),
        }
        if self.reward_fn is None:
            specs["reward"] = ScorerSpec(self.reward_model, "score", r)
        return specs

    def scorer(self, role: str):
        """(start, chunk) kernels of one scorer role."""
        return make_scorer_kernels(self.scorer_specs()[role])


def build_kernels(
    spec: UpdateSpec,
    rollout: RolloutSpec,
    reward_model=None,
    reward_fn: RewardFn | None = None,
    update: Callable | None = None,
) -> Kernels:
    """Compile-once kernels. Exactly one of ``reward_model`` (a ModelConfig with a score
    head) and ``reward_fn`` is given. ``update`` defaults to a plain jit of ``ppo_update``."""
    if (reward_model is None) == (reward_fn is None):
        raise ValueError("give exactly one of reward_model and reward_fn")
    start = jax.jit(functools.partial(_start_with_marker, spec, rollout))
    build = jax.jit(functools.partial(experience, spec, rollout, reward_fn))
    if update is None:
        update = jax.jit(functools.partial(ppo_update, spec), donate_argnums=(0,))
    return Kernels(spec, rollout, reward_fn, reward_model, start, build, update)
