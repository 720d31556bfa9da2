"""Every compiled kernel a step dispatches: one jit per (function, static settings), with its
donation and its timing marker, so ``rollout/``, ``scoring/`` and ``ppo/`` stay pure functions.

A marker is a tiny fresh array that completes with its kernel; the timeline waits on it,
because a kernel's state output is donated to the next call before the timeline looks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from oppo_jax.base.shapes import compaction_floor, live_widths_pay, program_name
from oppo_jax.models.attention import reads_lengths
from oppo_jax.models.kv_cache import live_width
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel.sharding import batch_shards, with_rules
from oppo_jax.pipeline.slot_map import compaction_default
from oppo_jax.ppo.experience import batch_from_rollout
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.update import UpdateSpec
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import CutRule, DecodeState, admit_decode, decode_chunk, tokens_since
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.rollout.spec import RolloutSpec
from oppo_jax.scoring.packed_chunks import score_packed_chunk
from oppo_jax.scoring.replay import ReplayChunk, actor_spec, replay_chunk
from oppo_jax.scoring.stream import ScorerSpec, ScorerSpecs, score_chunk, scorer_admit

__all__ = ["Kernels", "RolloutSpec", "build_kernels", "sample"]


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
    """``decode_chunk`` jitted, donating the state: (params, state, cut rule) -> (state,
    ChunkTokens). One program per (model, sampling, C, mesh, live width)."""
    fn = functools.partial(decode_chunk, cfg, sampling, chunk_size, mesh=mesh, kv_width=kv_width)
    return family_jit("decode", fn, mesh, donate_argnums=(1,))


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
def make_experience(spec: UpdateSpec, rollout: RolloutSpec):
    """``batch_from_rollout`` jitted for one (update spec, rollout)."""
    return family_jit("experience", functools.partial(batch_from_rollout, spec, rollout))


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


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The jitted functions of one run: admit, decode a chunk, score, build a batch, update."""

    spec: UpdateSpec
    rollout: RolloutSpec
    # the reward model's architecture; None: reward functions alone score (oppo_jax.rewards)
    reward_model: ModelConfig | None
    # (train state, batch, key, kl_coef, lengths=None) -> (train state, metrics); donates
    update: Callable
    # decode and streamed scoring read the cache's live prefix, a power-of-two width per program
    # (False: the whole P + R, one program; ``shapes.live_widths_pay``)
    live_prefix: bool = True
    # gather the running decode slots into smaller buckets as others finish (pipeline.slot_map);
    # None: the backend's default (slot_map.compaction_default: on for the CPU)
    compact_slots: bool | None = None
    compact_min_slots: int = 1  # smallest bucket compaction moves into (runs: the config's)
    # the run's programs once compiled (``pipeline.registry.Registry``, the warm-up's): a
    # kernel asked for at a shape the registry does not hold raises ``UnplannedProgram``;
    # None (no warm-up): a kernel compiles when it first meets a shape
    registry: Any = None

    def planned(self, family: str, shape: tuple, role: str = "actor") -> None:
        """Raise ``UnplannedProgram`` if the registry holds no ``family`` program at ``shape``
        for ``role`` (nothing to check without a registry)."""
        if self.registry is not None:
            self.registry.program(family, shape, role)

    def _width(self, kv_width: int | None) -> int:
        r = self.rollout
        return r.prompt_width + r.max_response_len if kv_width is None else kv_width

    @property
    def packs_chunks(self) -> bool:
        """Whether the streaming scorers pack each chunk's tokens (``scoring.packed_chunks``):
        on a scoring mesh that does not split the slots, where packing moves no cache between
        devices; else they score each chunk over every slot."""
        mesh = self.rollout.scoring_mesh
        return mesh is None or batch_shards(mesh) == 1

    @property
    def compaction_floor(self) -> int | None:
        """The smallest slot bucket the decode compacts into; None: it does not compact
        (``shapes.compaction_floor``; on one process only, where the kept rows' indices never
        cross hosts)."""
        if jax.process_count() > 1:
            return None
        compact = compaction_default() if self.compact_slots is None else self.compact_slots
        gen = 1 if self.rollout.mesh is None else batch_shards(self.rollout.mesh)
        scoring = 1 if self.packs_chunks else 2
        actor, r = self.spec.actor, self.rollout
        reads = reads_lengths(actor.attention, actor.head_dim, r.prompt_width + r.max_response_len)
        return compaction_floor(compact, reads, gen, scoring, self.compact_min_slots, r.group_size)

    @functools.cached_property
    def actor_spec(self) -> ScorerSpec:
        """The actor as the consumer of its own carried prefixes (log-probs at the sampling
        temperature, on the generation mesh): what its admission prefill and replay run."""
        return actor_spec(self.spec.actor, self.rollout, self.spec.temperature)

    def admit(self, params, admission, base_key, replay: Sequence[ReplayChunk]):
        """The actor's admission (``admit_actor``): (DecodeState, marker); ``replay`` is the
        plan of the admission's carried prefixes (``()`` for new prompts only)."""
        self.planned("admission prefill", ("prompts",))
        for chunk in replay:
            self.planned("replay", (chunk.tokens.shape[0], chunk.kv_width))
        self.planned("decode start", ("slots",))
        return admit_actor(self.actor_spec, self.rollout, params, admission, base_key, replay)

    def replay(self, role: str, params, state, replay: Sequence[ReplayChunk]):
        """``feed_replay`` of scorer ``role``: (state with ``replay`` fed, marker or None)."""
        for chunk in replay:
            self.planned("replay", (chunk.tokens.shape[0], chunk.kv_width), role)
        return feed_replay(getattr(self.scorer_specs, role), params, state, replay)

    def decode(self, chunk_size: int, kv_width: int | None = None) -> Callable:
        """(params, state, cut rule) -> (state, ChunkTokens) for this chunk size, reading the
        first ``kv_width`` cache columns (None: all), over the state's slots (the admission's,
        or a compacted bucket: the registry holds a program per bucket)."""
        r = self.rollout
        jitted = make_decode_chunk(self.spec.actor, r.sampling, chunk_size, r.mesh, kv_width)
        if self.registry is None:
            return jitted
        width = self._width(kv_width)

        def decode(params, state, rule):
            self.planned("decode", (state.tokens.shape[0], chunk_size, width))
            return jitted(params, state, rule)

        return decode

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
        reference = None  # β = 0: no KL term reads it, so none is loaded or run
        if self.spec.ppo.uses_reference:
            reference = ScorerSpec(self.spec.actor, "logprob", r, self.spec.temperature, mesh)
        critic = None  # a critic-free estimator (ppo.advantage) trains none
        if "critic" in self.spec.trained:
            critic = ScorerSpec(self.spec.critic, "value", r, mesh=mesh)
        return ScorerSpecs(reference=reference, critic=critic, reward=reward)

    def scorer_admit(self, role: str) -> Callable:
        """(params, admission) -> (ScorerState, marker): one role's prefill of the admission's
        prompts (its first P context columns; the rest holds room for carried prefixes)."""
        self.planned("admission prefill", ("prompts",), role)
        return make_scorer_admit(getattr(self.scorer_specs, role), self.rollout.prompt_width)

    def scorer_chunk(self, role: str, kv_width: int | None = None):
        """(params, state, chunk[, plan]) -> (ScorerState, marker): one role's chunk prefill,
        reading the first ``kv_width`` cache columns (None: all): over the tokens a
        ``packed_chunks.plan_chunk`` plan packs where the scorers pack (``packs_chunks``),
        else over every slot."""
        spec = getattr(self.scorer_specs, role)
        jitted = make_scorer_chunk(spec, kv_width, self.packs_chunks)
        if self.registry is None:
            return jitted
        width = self._width(kv_width)

        def score(params, state, chunk, *plan):
            self.planned("streamed scoring", (chunk.tokens.shape[1], width), role)
            return jitted(params, state, chunk, *plan)

        return score

    @functools.cached_property
    def responses(self) -> Callable:
        """(decode state, start) -> ChunkTokens of every response past ``start`` (sync scoring)."""
        width = self.rollout.max_response_len
        return jax.jit(lambda state, start: tokens_since(state, start, width, jnp.bool_(True)))

    @property
    def experience(self) -> Callable:
        """(decode state, rows, admission, scorer outputs, kl_coef) -> (PPOBatch, stats)."""
        self.planned("experience", ("batch",))
        return make_experience(self.spec, self.rollout)


def build_kernels(
    spec: UpdateSpec,
    rollout: RolloutSpec,
    reward_model: ModelConfig | None = None,
    update: Callable | None = None,
) -> Kernels:
    """Compile-once kernels; ``reward_model`` a ModelConfig with a score head, or None when
    reward functions alone score (host-side, ``oppo_jax.rewards``). ``update`` defaults to
    ``ppo.packed_update.make_update``."""
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
    return Kernels(spec, rollout, reward_model, update, live_prefix=live)


def admit_actor(spec: ScorerSpec, rollout: RolloutSpec, params, admission, base_key, replay):
    """The admission of the actor (``spec``: the actor as the log-prob consumer of its own
    carried prefixes, ``scoring.replay.actor_spec``): every slot's prompt prefilled, the
    carried prefixes of ``replay`` (``scoring.replay.plan_replay`` of the same slots, planned
    on the host from the step's host arrays: nothing is read back) fed after it, and the
    decode state started from that cache: (DecodeState, marker)."""
    prefilled, _ = make_scorer_admit(spec, rollout.prompt_width)(params, admission)
    p, _ = feed_replay(spec, params, prefilled, replay)
    start = make_actor_start(spec.model, rollout)
    return start(params, admission, base_key, p.cache, p.last_hidden, p.per_token)


def feed_replay(spec: ScorerSpec, params, state, replay: Sequence[ReplayChunk]):
    """(``state`` with every chunk of ``replay`` fed, one compiled call each (donated), the
    last call's marker or None when there is nothing to feed)."""
    marker = None
    for chunk in replay:
        run = make_replay(spec, chunk.kv_width)
        state, marker = run(params, state, chunk.tokens, chunk.count)
    return state, marker


def sample(cfg: ModelConfig, rollout: RolloutSpec, params, prompts, prompt_len, base_key,
           chunk_size: int = 32) -> DecodeState:  # fmt: skip
    """Every prompt's response sampled to its end by the run's kernels (slot s holds prompt
    id s): the actor's admission, then decode chunks until every slot has finished."""
    prompts, prompt_len = jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_len, jnp.int32)
    admission = Admission.fresh(prompts, prompt_len, rollout.max_response_len)
    temperature = 1.0 if rollout.sampling.greedy else rollout.sampling.temperature
    spec = actor_spec(cfg, rollout, temperature)
    state, _ = admit_actor(spec, rollout, params, admission, base_key, ())
    slots = admission.num_slots
    never = CutRule(admission.active, admission.must_finish, jnp.int32(slots + 1))
    decode = make_decode_chunk(cfg, rollout.sampling, chunk_size, rollout.mesh)
    for _ in range(-(-rollout.max_response_len // chunk_size)):
        state, _ = decode(params, state, never)
    return state
