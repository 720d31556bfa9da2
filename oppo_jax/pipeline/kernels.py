"""The compiled kernels every schedule dispatches, built once per run from static specs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from oppo_jax.ppo.experience import build_batch
from oppo_jax.ppo.update import UpdateSpec, ppo_update
from oppo_jax.rollout.decode import DecodeState, admit_decode, make_decode_chunk_emit
from oppo_jax.rollout.layout import assemble_sequences, response_mask
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.scoring.stream import ScorerSpec, make_scorer_admit, make_scorer_kernels

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
    mesh: Mesh | None = None  # generation mesh: decode state sharded along slots (None: as is)
    scoring_mesh: Mesh | None = None  # scorers' mesh, likewise (the same one when colocated)


def experience(
    spec: UpdateSpec,
    rollout: RolloutSpec,
    reward_fn: RewardFn | None,
    decoded: DecodeState,
    rows: jax.Array,
    context: jax.Array,
    prompt_len: jax.Array,
    prefix_len: jax.Array,
    prefix_behaviour: jax.Array,
    ref_logp: jax.Array,
    values: jax.Array,
    scores: jax.Array | None,
    kl_coef: jax.Array,
):
    """Build the PPO batch from the selected slots ``rows`` [B] of a rollout.

    ``old_logp`` is each token's log-prob under this step's parameters: recorded when it was
    sampled this step, or recomputed by the admission prefill for a carried prefix (the
    quantity TRL recomputes after generation, without a second actor pass). The behaviour
    log-prob is the one recorded when the token was actually sampled, possibly steps ago.
    """
    take = functools.partial(jnp.take, indices=rows, axis=0)
    response, logprobs, resp_len = map(
        take, (decoded.tokens, decoded.logprobs, decoded.num_generated)
    )
    prompt_len, prefix_len = take(prompt_len), take(prefix_len)
    width = rollout.max_response_len
    prompts = take(context)[:, : rollout.prompt_width]
    tokens = assemble_sequences(prompts, prompt_len, response, resp_len, rollout.pad_id)
    if reward_fn is not None:
        scores = reward_fn(tokens, prompt_len, prompt_len + resp_len)
    else:
        scores = take(scores)
    last = jnp.take_along_axis(response, jnp.maximum(resp_len - 1, 0)[:, None], axis=1)
    ended_with_eos = (resp_len > 0) & jnp.isin(last[:, 0], jnp.asarray(rollout.eos_ids))
    in_prefix = jnp.arange(width)[None, :] < prefix_len[:, None]
    behaviour = jnp.where(in_prefix, take(prefix_behaviour), logprobs)
    batch, stats = build_batch(
        spec.ppo, tokens, prompt_len, response_mask(resp_len, width), scores, ended_with_eos,
        old_logp=logprobs, behaviour_logp=behaviour, ref_logp=take(ref_logp),
        values=take(values), kl_coef=kl_coef,
    )  # fmt: skip
    return batch, {**stats, "reward": jnp.mean(scores)}


def _admit_with_marker(spec: UpdateSpec, rollout: RolloutSpec, *args, carried_rows=None):
    state = admit_decode(
        spec.actor, *args, prompt_width=rollout.prompt_width,
        max_response_len=rollout.max_response_len, eos_ids=rollout.eos_ids,
        pad_id=rollout.pad_id, temperature=spec.temperature, carried_rows=carried_rows,
        mesh=rollout.mesh,
    )  # fmt: skip
    return state, state.num_generated + 0  # a fresh array: the state itself gets donated


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Jitted functions of one run: start a rollout, decode a chunk, score, build, update."""

    spec: UpdateSpec
    rollout: RolloutSpec
    reward_fn: RewardFn | None  # programmatic reward; None: the reward model scores
    reward_model: Any  # ModelConfig of the reward model (None with reward_fn)
    admit: Callable
    experience: Callable
    update: Callable

    def decode(self, chunk_size: int) -> Callable:
        """``decode_chunk_emit`` for this chunk size (compiled on first use, then cached)."""
        return make_decode_chunk_emit(
            self.spec.actor, self.rollout.sampling, chunk_size, self.rollout.mesh
        )

    @functools.cached_property
    def scorer_specs(self) -> dict[str, ScorerSpec]:
        """The streaming consumers of the actor's tokens, by role."""
        r, mesh = self.rollout.max_response_len, self.rollout.scoring_mesh
        specs = {
            "reference": ScorerSpec(self.spec.actor, "logprob", r, self.spec.temperature, mesh),
            "critic": ScorerSpec(self.spec.critic, "value", r, mesh=mesh),
        }
        if self.reward_fn is None:
            specs["reward"] = ScorerSpec(self.reward_model, "score", r, mesh=mesh)
        return specs

    def scorer_admit(self, role: str) -> Callable:
        """Admission prefill of one scorer role (prompt + carried prefix)."""
        return make_scorer_admit(self.scorer_specs[role], self.rollout.prompt_width)

    def scorer_chunk(self, role: str) -> Callable:
        """Chunk prefill of one scorer role."""
        return make_scorer_kernels(self.scorer_specs[role])[1]


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
    if not rollout.sampling.greedy and rollout.sampling.temperature != spec.temperature:
        # Behaviour log-probs (decode) and old/new log-probs (update) must use one temperature.
        raise ValueError(
            f"sampling temperature {rollout.sampling.temperature} != update temperature "
            f"{spec.temperature}"
        )
    # ``carried_rows`` (static): slots prefilled at the full context width; see admit_decode.
    admit = jax.jit(
        functools.partial(_admit_with_marker, spec, rollout), static_argnames=("carried_rows",)
    )
    build = jax.jit(functools.partial(experience, spec, rollout, reward_fn))
    if update is None:
        update = jax.jit(functools.partial(ppo_update, spec), donate_argnums=(0,))
    return Kernels(spec, rollout, reward_fn, reward_model, admit, build, update)
