"""Every compiled kernel a step dispatches: one jit per (function, static settings), with its
donation and its timing marker, so ``rollout/``, ``scoring/`` and ``ppo/`` stay pure functions.

A marker is a tiny fresh array that completes with its kernel; the timeline waits on it,
because a kernel's state output is donated to the next call before the timeline looks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from oppo_jax.models.attention import reads_lengths
from oppo_jax.models.kv_cache import live_width
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.pipeline.slot_map import compaction_floor
from oppo_jax.ppo.experience import RewardFn, batch_from_rollout
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.update import UpdateSpec
from oppo_jax.rollout.decode import (
    admit_decode,
    decode_chunk,
    decode_chunk_emit,
    start_decode,
    tokens_since,
)
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.rollout.spec import RolloutSpec
from oppo_jax.scoring.packed_chunks import score_packed_chunk
from oppo_jax.scoring.replay import ReplayChunk, actor_spec, plan_replay, replay_chunk
from oppo_jax.scoring.stream import ScorerSpec, ScorerSpecs, score_chunk, scorer_admit
from oppo_jax.shapes import live_widths_pay, program_name
from oppo_jax.sharding import to_host, with_rules

__all__ = ["Kernels", "RewardFn", "RolloutSpec", "build_kernels", "make_decode_chunk"]


def family_jit(family: str, fn, mesh=None, **jit_kwargs):
    """``jax.jit`` of ``fn`` traced under ``mesh``'s rules, its program named for its compile
    plan ``family`` (``shapes.program_name``: compile events say which family compiled)."""

    def program(*args, **kwargs):
        return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = program_name(family)
    return jax.jit(with_rules(program, mesh), **jit_kwargs)


@functools.cache
def make_decode_chunk(
    cfg: ModelConfig, sampling: SamplingConfig, chunk_size: int, mesh=None, kv_width=None
):
    """``decode_chunk`` jitted for one (model, sampling, C, mesh, live width), donating the
    state."""
    fn = functools.partial(decode_chunk, cfg, sampling, chunk_size, mesh=mesh, kv_width=kv_width)
    return family_jit("decode", fn, mesh, donate_argnums=(1,))


@functools.cache
def make_decode_chunk_emit(
    cfg: ModelConfig, sampling: SamplingConfig, chunk_size: int, mesh, kv_width=None
):
    """``decode_chunk_emit`` jitted, donating the state; the chunk's counts are the marker.
    One compilation per live width (``kv_cache.live_widths``: a handful per chunk size)."""
    fn = functools.partial(
        decode_chunk_emit, cfg, sampling, chunk_size, mesh=mesh, kv_width=kv_width
    )
    return family_jit("decode", fn, mesh, donate_argnums=(1,))


@functools.cache
def make_start_decode(cfg: ModelConfig, rollout: RolloutSpec):
    """``start_decode`` jitted for one model and rollout shape: (params, prompts, prompt_lens,
    base_key, active=None) -> DecodeState."""
    fn = functools.partial(start_decode, cfg, rollout=rollout)
    return family_jit("decode start", fn, rollout.mesh)


@functools.cache
def make_actor_start(cfg: ModelConfig, rollout: RolloutSpec):
    """(params, admission, base_key, cache, last hidden states, prefix log-probs) ->
    (DecodeState, marker): the decode state from the actor's admitted cache (prompt + replayed
    prefixes, ``Kernels.admit``), which it donates."""

    def run(params, admission, base_key, cache, last_hidden, logprobs):
        made = (cache, last_hidden, logprobs)
        state = admit_decode(cfg, params, admission, base_key, rollout, made)
        return state, state.num_generated + 0  # a fresh marker: the state itself gets donated

    return family_jit("decode start", run, rollout.mesh, donate_argnums=(3,))


@functools.cache
def make_replay(spec: ScorerSpec, kv_width: int):
    """``replay.replay_chunk`` jitted for one model and live width (one compilation per row
    bucket), donating the state: (params, state, tokens [N, c], count [N]) -> (state, marker)."""

    def run(params, state, tokens, count):
        new = replay_chunk(spec, params, state, tokens, count, kv_width)
        return new, jnp.sum(new.num_fed)

    return family_jit("replay", run, spec.mesh, donate_argnums=(1,))


@functools.cache
def make_experience(spec: UpdateSpec, rollout: RolloutSpec, reward_fn: RewardFn | None):
    """``batch_from_rollout`` jitted for one (update spec, rollout, reward function)."""
    return family_jit("experience", functools.partial(batch_from_rollout, spec, rollout, reward_fn))


@functools.cache
def make_scorer_admit(spec: ScorerSpec, prompt_width: int):
    def run(params, admission):
        state = scorer_admit(spec, params, admission, prompt_width)
        return state, jnp.sum(state.num_fed)

    return family_jit("admission prefill", run, spec.mesh)


@functools.cache
def make_scorer_chunk(spec: ScorerSpec, kv_width: int | None = None, packed: bool = False):
    """One scorer's chunk prefill: (params, state, chunk) over every slot ([S, C]), or, when
    ``packed``, (params, state, chunk, plan) over the chunk's tokens packed by the host's
    plan (``scoring.packed_chunks``; one compilation per packed size)."""

    def run(params, state, chunk, plan=None):
        if packed:
            new = score_packed_chunk(spec, params, state, chunk, plan, kv_width)
        else:
            new = score_chunk(spec, params, state, chunk, kv_width=kv_width)
        return new, jnp.sum(new.num_fed)

    return family_jit("streamed scoring", run, spec.mesh, donate_argnums=(1,))


def prompts_only(admission, prompt_width: int):
    """The admission with its context cut to the prompts' P columns (the admission prefill
    reads no more; the context may hold room for carried prefixes)."""
    if admission.context.shape[1] == prompt_width:
        return admission
    return admission.replace(context=admission.context[:, :prompt_width])


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The jitted functions of one run: admit, decode a chunk, score, build a batch, update."""

    spec: UpdateSpec
    rollout: RolloutSpec
    reward_fn: RewardFn | None  # programmatic reward; None: the reward model scores
    reward_model: ModelConfig | None  # the reward model's architecture (None with reward_fn)
    # (train state, batch, key, kl_coef, lengths=None) -> (train state, metrics); donates
    update: Callable
    # decode and streamed scoring read the cache's live prefix, a power-of-two width per program
    # (False: the whole P + R, one program; ``shapes.live_widths_pay``)
    live_prefix: bool = True
    # gather the running decode slots into smaller buckets as others finish (pipeline.slot_map);
    # None: the backend's default (slot_map.compaction_default: on for the CPU)
    compact_slots: bool | None = None
    compact_min_slots: int = 1  # smallest bucket compaction moves into (runs: the config's)

    def compaction_floor(self, shards: int) -> int | None:
        """The smallest slot bucket of the decode over ``shards`` batch shards; None: it does
        not compact (``slot_map.compaction_floor``)."""
        return compaction_floor(self.compact_slots, shards, self.compact_min_slots)

    @functools.cached_property
    def actor_spec(self) -> ScorerSpec:
        """The actor as the consumer of its own carried prefixes (log-probs at the sampling
        temperature, on the generation mesh): what its admission prefill and replay run."""
        return actor_spec(self.spec.actor, self.rollout, self.spec.temperature)

    def admit(self, params, admission, base_key, replay: Sequence[ReplayChunk] | None = None):
        """The actor's admission: every slot's prompt prefilled, the carried prefixes of
        ``replay`` (``scoring.replay.plan_replay`` of the same slots) fed after it, and the
        decode state started from that cache: (DecodeState, marker). Without ``replay`` the
        plan is made from the admission read back to the host (a step passes the one it
        planned from its host arrays, so it reads nothing)."""
        prompt_width = self.rollout.prompt_width
        if replay is None:
            host = to_host((admission.context, admission.prompt_len, admission.prefix_len))
            replay = plan_replay(*host, (prompt_width, self.rollout.max_response_len))
        prompts = prompts_only(admission, prompt_width)
        prefilled, _ = make_scorer_admit(self.actor_spec, prompt_width)(params, prompts)
        prefilled, _ = self.replay(self.actor_spec, params, prefilled, replay)
        start = make_actor_start(self.spec.actor, self.rollout)
        p = prefilled
        return start(params, admission, base_key, p.cache, p.last_hidden, p.per_token)

    @staticmethod
    def replay(spec: ScorerSpec, params, state, replay: Sequence[ReplayChunk]):
        """(``state`` with every chunk of ``replay`` fed, one compiled call each (donated), the
        last call's marker or None when there is nothing to feed)."""
        marker = None
        for chunk in replay:
            run = make_replay(spec, chunk.kv_width)
            state, marker = run(params, state, chunk.tokens, chunk.count)
        return state, marker

    def decode(self, chunk_size: int, kv_width: int | None = None) -> Callable:
        """(params, state, cut rule) -> (state, ChunkTokens) for this chunk size, reading the
        first ``kv_width`` cache columns (None: all)."""
        r = self.rollout
        return make_decode_chunk_emit(self.spec.actor, r.sampling, chunk_size, r.mesh, kv_width)

    def chunk_width(self, longest_context: int, chunk_size: int, chunks_before: int) -> int | None:
        """The live width for the chunk after ``chunks_before`` others of ``chunk_size``
        tokens, when no slot's context (prompt + prefix) exceeded ``longest_context`` at
        admission: each step adds at most one token per slot, so none passes
        longest + (chunks_before + 1) * C in it. None (all columns) without ``live_prefix``."""
        if not self.live_prefix:
            return None
        r = self.rollout
        longest = longest_context + (chunks_before + 1) * chunk_size
        return live_width(longest, r.prompt_width + r.max_response_len)

    @functools.cached_property
    def scorer_specs(self) -> ScorerSpecs:
        """The streaming consumers of the actor's tokens, by role."""
        r, mesh = self.rollout.max_response_len, self.rollout.scoring_mesh
        reward = None
        if self.reward_model is not None:  # None: reward functions alone (oppo_jax.rewards)
            reward = ScorerSpec(self.reward_model, "score", r, mesh=mesh)
        return ScorerSpecs(
            reference=ScorerSpec(self.spec.actor, "logprob", r, self.spec.temperature, mesh),
            critic=ScorerSpec(self.spec.critic, "value", r, mesh=mesh),
            reward=reward,
        )

    def scorer_admit(self, role: str) -> Callable:
        """(params, admission) -> (ScorerState, marker): one role's prefill of the admission's
        prompts (``prompts_only``: one program whatever the admission's context width)."""
        width = self.rollout.prompt_width
        jitted = make_scorer_admit(getattr(self.scorer_specs, role), width)
        return lambda params, admission: jitted(params, prompts_only(admission, width))

    def scorer_chunk(self, role: str, kv_width: int | None = None, packed: bool = False):
        """(params, state, chunk[, plan]) -> (ScorerState, marker): one role's chunk prefill,
        reading the first ``kv_width`` cache columns (None: all), over every slot or, when
        ``packed``, over the tokens a ``packed_chunks.plan_chunk`` plan packs."""
        return make_scorer_chunk(getattr(self.scorer_specs, role), kv_width, packed)

    @functools.cached_property
    def responses(self) -> Callable:
        """(decode state, start) -> ChunkTokens of every response past ``start`` (sync scoring)."""
        width = self.rollout.max_response_len
        return jax.jit(lambda state, start: tokens_since(state, start, width, jnp.bool_(True)))

    @property
    def experience(self) -> Callable:
        """(decode state, rows, admission, scorer outputs, kl_coef) -> (PPOBatch, stats)."""
        return make_experience(self.spec, self.rollout, self.reward_fn)


def build_kernels(
    spec: UpdateSpec,
    rollout: RolloutSpec,
    reward_model: ModelConfig | None = None,
    reward_fn: RewardFn | None = None,
    update: Callable | None = None,
) -> Kernels:
    """Compile-once kernels. Exactly one of ``reward_model`` (a ModelConfig with a score
    head) and ``reward_fn`` is given. ``update`` defaults to ``packed_update.make_update``."""
    if reward_model is not None and reward_fn is not None:
        raise ValueError("give at most one of reward_model and reward_fn")
    if not rollout.sampling.greedy and rollout.sampling.temperature != spec.temperature:
        # Behaviour log-probs (decode) and old/new log-probs (update) must use one temperature.
        raise ValueError(
            f"sampling temperature {rollout.sampling.temperature} != update temperature "
            f"{spec.temperature}"
        )
    if update is None:  # packed or padded (ppo.packed_update); donates all but LoRA's bases
        update = make_update(spec)
    capacity = rollout.prompt_width + rollout.max_response_len
    reads = reads_lengths(spec.actor.attention, spec.actor.head_dim, capacity)
    live = live_widths_pay(capacity, reads)
    return Kernels(spec, rollout, reward_fn, reward_model, update, live_prefix=live)
