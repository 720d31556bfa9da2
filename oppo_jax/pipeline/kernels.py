"""Every compiled kernel a step dispatches, so ``rollout/``, ``scoring/`` and ``ppo/`` stay pure
functions: each kernel a module-level jitted function named for its compile plan family
(``oppo_decode``...), with its static settings as keyword arguments, its donation and its
timing marker; ``Kernels`` calls them by name (a reader, or a static walk of the calls,
follows a chunk from ``Kernels.decode_tokens`` into ``rollout.decode.decode_chunk``) after
asking the run's registry for the program (``Kernels.planned``), and reports each dispatch
once to the run's ``StepRecorder`` (``pipeline.accounting``): its timeline mark and its tokens
computed (from the shapes it was handed) and real (``real``: the caller's host lengths).

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

from oppo_jax.base.shapes import compaction_default, compaction_floor, live_widths_pay
from oppo_jax.models.attention import reads_lengths
from oppo_jax.models.kv_cache import live_width
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel.sharding import batch_shards, tracing_rules
from oppo_jax.pipeline.accounting import StepRecorder, admission_computed
from oppo_jax.ppo.experience import batch_from_rollout
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.update import UpdateSpec
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import CutRule, DecodeState, admit_decode, decode_chunk, tokens_since
from oppo_jax.rollout.spec import RolloutSpec
from oppo_jax.scoring.carried import ReplayChunk, actor_spec, replay_chunk
from oppo_jax.scoring.packed import PackedBatch, ScoringCall, score_packed
from oppo_jax.scoring.stream import (
    ScorerSpec,
    ScorerSpecs,
    score_chunk,
    score_packed_chunk,
    scorer_admit,
)

__all__ = ["Kernels", "RolloutSpec", "build_kernels", "sample"]


def kernel_jit(*static: str, donate: tuple[str, ...] = ()):
    """Decorator: ``jax.jit`` of a kernel whose keyword-only arguments ``static`` are its static
    settings (one program per setting and shape), donating the arguments named in ``donate``.
    A kernel is named ``shapes.program_name`` of its compile plan family ("oppo_decode"), so
    compile events say which family compiled."""
    return functools.partial(jax.jit, static_argnames=static, donate_argnames=donate)


@kernel_jit("cfg", "sampling", "chunk_size", "mesh", "kv_width", donate=("state",))
def oppo_decode(params, state, rule, *, cfg, sampling, chunk_size, mesh, kv_width):
    """``decode_chunk`` of ``chunk_size`` tokens, donating the state: (state, ChunkTokens).
    One program per (model, sampling, C, mesh, live width) and slot count."""
    with tracing_rules(mesh):
        return decode_chunk(
            cfg, sampling, chunk_size, params, state, rule, mesh=mesh, kv_width=kv_width
        )


@kernel_jit("cfg", "rollout", donate=("cache",))
def oppo_decode_start(params, admission, base_key, cache, last_hidden, logprobs, *, cfg, rollout):
    """The decode state from the actor's admitted cache (prompt + replayed prefixes,
    ``admit_actor``), which it donates: (DecodeState, marker)."""
    with tracing_rules(rollout.mesh):
        made = (cache, last_hidden, logprobs)
        state = admit_decode(cfg, params, admission, base_key, rollout, made)
        return state, state.num_generated + 0  # a fresh marker: the state itself gets donated


@kernel_jit("spec", "kv_width", donate=("state",))
def oppo_replay(params, state, tokens, count, *, spec, kv_width):
    """``replay.replay_chunk`` for one model and live width (one program per row bucket),
    donating the state: (state, marker)."""
    with tracing_rules(spec.mesh):
        new = replay_chunk(spec, params, state, tokens, count, kv_width)
        return new, jnp.sum(new.num_fed)


@kernel_jit("spec", "rollout")
def oppo_experience(decoding, rows, admission, scored, kl_coef, *, spec, rollout):
    """``batch_from_rollout``: (PPOBatch, stats)."""
    return batch_from_rollout(spec, rollout, decoding, rows, admission, scored, kl_coef)


@kernel_jit("spec", "prompt_width", "group_size")
def oppo_admission_prefill(params, admission, *, spec, prompt_width, group_size=1):
    """One model's prefill of the admission's prompts (its first ``prompt_width`` context
    columns; with ``group_size`` G, each group of G slots' prompt once): (ScorerState,
    marker)."""
    with tracing_rules(spec.mesh):
        state = scorer_admit(spec, params, admission, prompt_width, group_size)
        return state, jnp.sum(state.num_fed)


@kernel_jit("spec", "kv_width", "packed", donate=("state",))
def oppo_streamed_scoring(params, state, chunk, plan=None, *, spec, kv_width, packed):
    """One scorer's chunk prefill, donating its state: over every slot ([S, C]), or, when
    ``packed``, over the chunk's tokens packed by the host's ``plan``
    (``scoring.stream``; one program per packed size): (ScorerState, marker)."""
    with tracing_rules(spec.mesh):
        if packed:
            new = score_packed_chunk(spec, params, state, chunk, plan, kv_width)
        else:
            new = score_chunk(spec, params, state, chunk, kv_width=kv_width)
        return new, jnp.sum(new.num_fed)


@kernel_jit("spec", "pad_id", "num_slots", donate=("out",))
def oppo_sync_scoring(params, out, batch: PackedBatch, slots, *, spec, pad_id, num_slots):
    """(the outputs ``out`` over the ``num_slots`` slots (donated) with this call's sequences
    written at their batch rows' ``slots`` [B], a fresh marker): one scorer's packed call of
    the batch. One program per scorer: every call has the one packed shape."""
    with tracing_rules(spec.mesh):
        scored = score_packed(spec, params, batch, pad_id)
        rows = batch.seq.shape[0]
        at = jnp.where(batch.row < rows, slots, num_slots)  # other calls' sequences: dropped
        out = out.at[at].set(scored, mode="drop")
        return out, jnp.sum(scored)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The jitted functions of one run: admit, decode a chunk, score, build a batch, update."""

    spec: UpdateSpec
    rollout: RolloutSpec
    # the reward model's architecture; None: reward functions alone score (oppo_jax.rewards)
    reward_model: ModelConfig | None
    # the run's update (``ppo.packed_update.PackedUpdate``; the tests' padded oracle has the
    # same ``update_batch``), called through ``train_models``
    update: Any
    # decode and streamed scoring read the cache's live prefix, a power-of-two width per program
    # (False: the whole P + R, one program; ``shapes.live_widths_pay``)
    live_prefix: bool = True
    # gather the running decode slots into smaller buckets as others finish (pipeline.decode_loop);
    # None: the backend's default (shapes.compaction_default: on for the CPU)
    compact_slots: bool | None = None
    compact_min_slots: int = 1  # smallest bucket compaction moves into (runs: the config's)
    # the run's programs once compiled (``pipeline.registry.Registry``, the warm-up's): a
    # kernel asked for at a shape the registry does not hold raises ``UnplannedProgram``;
    # None (no warm-up): a kernel compiles when it first meets a shape
    registry: Any = None
    # where each dispatch's timeline mark and tokens go (``run_step`` opens it per step)
    recorder: StepRecorder = dataclasses.field(default_factory=StepRecorder, compare=False)

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
        """Whether the streaming scorers pack each chunk's tokens (``scoring.stream``):
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
        backend = jax.default_backend()
        compact = compaction_default(backend) if self.compact_slots is None else self.compact_slots
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

    def prefill_actor(self, params, admission, base_key, replay, group_size=1, real=0):
        """The actor's admission (``admit_actor``): (DecodeState, marker); ``replay`` is the
        plan of the admission's carried prefixes (``()`` for new prompts only); ``group_size``
        G: the slots hold groups of G samples of one prompt, each prompt prefilled once;
        ``real``: the admission's real tokens (``accounting.admission_real``)."""
        self.planned("admission prefill", ("prompts",))
        for chunk in replay:
            self.planned("replay", (chunk.tokens.shape[0], chunk.kv_width))
        self.planned("decode start", ("slots",))
        spec, rollout = self.actor_spec, self.rollout
        out = admit_actor(spec, rollout, params, admission, base_key, replay, group_size)
        width = rollout.prompt_width
        computed = admission_computed(admission.num_slots, width, replay, group_size)
        self.recorder.dispatched("prefill actor", out[1], tokens=("admission", computed, real))
        return out

    def replay_prefixes(self, role: str, params, state, replay: Sequence[ReplayChunk]):
        """``feed_replay`` of scorer ``role``: (state with ``replay`` fed, marker or None)."""
        for chunk in replay:
            self.planned("replay", (chunk.tokens.shape[0], chunk.kv_width), role)
        state, marker = feed_replay(getattr(self.scorer_specs, role), params, state, replay)
        if marker is not None:  # its real tokens are counted with the role's prompts
            computed = admission_computed(0, 0, replay)
            tokens = ("admission", computed, 0)
            self.recorder.dispatched(f"prefill {role}", marker, "scoring", tokens)
        return state, marker

    def decode_tokens(self, params, state, rule, chunk_size: int, kv_width: int | None = None):
        """(state, ChunkTokens): the next ``chunk_size`` tokens of every running slot, reading
        the first ``kv_width`` cache columns (None: all), over the state's slots (the
        admission's, or a compacted bucket: the registry holds a program per bucket)."""
        slots, width = state.tokens.shape[0], self._width(kv_width)
        self.planned("decode", (slots, chunk_size, width))
        self.recorder.decode_chunk(slots, width)  # priced once the rollout stops
        state, chunk = oppo_decode(
            params, state, rule, **self.decode_settings(chunk_size, kv_width)
        )
        self.recorder.dispatched("decode", chunk.count)
        return state, chunk

    def decode_settings(self, chunk_size: int, kv_width: int | None = None) -> dict:
        """``oppo_decode``'s static settings for chunks of ``chunk_size`` tokens reading
        ``kv_width`` cache columns (None: all), as the step's decode and the registry use them."""
        r = self.rollout
        statics = {"cfg": self.spec.actor, "sampling": r.sampling, "mesh": r.mesh}
        return statics | {"chunk_size": chunk_size, "kv_width": kv_width}

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

    def prefill_prompts(self, role: str, params, admission, group_size: int = 1, real: int = 0):
        """(ScorerState, marker): one role's prefill of the admission's prompts (its first P
        context columns; the rest holds room for carried prefixes), each group of
        ``group_size`` slots' prompt once; ``real``: the role's real admission tokens."""
        self.planned("admission prefill", ("prompts",), role)
        spec, width = getattr(self.scorer_specs, role), self.rollout.prompt_width
        out = oppo_admission_prefill(
            params, admission, spec=spec, prompt_width=width, group_size=group_size
        )
        computed = admission_computed(admission.num_slots, width, (), group_size)
        self.recorder.dispatched(
            f"prefill {role}", out[1], "scoring", ("admission", computed, real)
        )
        return out

    def score_streamed(self, role: str, params, state, chunk, kv_width=None, plan=None, real=0):
        """(ScorerState, marker): one role's chunk prefill, reading the first ``kv_width``
        cache columns (None: all): over the tokens a ``scoring.stream.plan_chunk`` ``plan``
        packs where the scorers pack (``packs_chunks``), else over every slot; ``real``: the
        real tokens among them."""
        self.planned("streamed scoring", (chunk.tokens.shape[1], self._width(kv_width)), role)
        spec, packed = getattr(self.scorer_specs, role), self.packs_chunks
        out = oppo_streamed_scoring(
            params, state, chunk, plan, spec=spec, kv_width=kv_width, packed=packed
        )
        computed = plan["token_row"].size if packed else chunk.tokens.size
        self.recorder.dispatched(f"score {role}", out[1], "scoring", ("scoring", computed, real))
        return out

    def score_batch(self, role: str, params, out, call: ScoringCall, batch: PackedBatch, at):
        """(``out`` with this packed call's sequences written at their slots ``at``, marker):
        one role's ``oppo_sync_scoring`` of the batch's call ``call`` (its host plan) packed
        into ``batch``."""
        self.planned("sync scoring", ("packed",), role)
        spec, num_slots = getattr(self.scorer_specs, role), out.shape[0]
        statics = dict(spec=spec, pad_id=self.rollout.pad_id, num_slots=num_slots)
        out, marker = oppo_sync_scoring(params, out, batch, at, **statics)
        tokens = ("scoring", call.computed_tokens, call.real_tokens)
        self.recorder.dispatched(f"score {role}", marker, "scoring", tokens)
        return out, marker

    @functools.cached_property
    def responses(self) -> Callable:
        """(decode state, start) -> ChunkTokens of every response past ``start`` (sync scoring)."""
        width = self.rollout.max_response_len
        return jax.jit(lambda state, start: tokens_since(state, start, width, jnp.bool_(True)))

    def train_models(self, train_state, batch, key, kl_coef, lengths=None):
        """(train state, metrics): PPO epochs x minibatches on ``batch`` (the run's update,
        ``ppo.packed_update.PackedUpdate.update_batch``: its one packed program, donating the
        state)."""
        out = self.update.update_batch(train_state, batch, key, kl_coef, lengths=lengths)
        metrics, models = out[1], len(self.spec.trained)
        computed, real = metrics["update_tokens_computed"], metrics["update_tokens_real"]
        tokens = ("update", models * int(computed), models * int(real))
        self.recorder.dispatched("update", metrics["policy_loss"], tokens=tokens)
        return out

    def experience(self, decoding, rows, admission, scored, kl_coef):
        """(PPOBatch, stats) of the batch ``rows`` (``ppo.experience.batch_from_rollout``)."""
        self.planned("experience", ("batch",))
        batch, stats = oppo_experience(
            decoding, rows, admission, scored, kl_coef, spec=self.spec, rollout=self.rollout
        )
        self.recorder.dispatched("build batch", stats["reward"])
        return batch, stats


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


def admit_actor(
    spec: ScorerSpec, rollout: RolloutSpec, params, admission, base_key, replay, group_size=1
):
    """The admission of the actor (``spec``: the actor as the log-prob consumer of its own
    carried prefixes, ``scoring.carried.actor_spec``): every slot's prompt prefilled, the
    carried prefixes of ``replay`` (``scoring.carried.plan_replay`` of the same slots, planned
    on the host from the step's host arrays: nothing is read back) fed after it, and the
    decode state started from that cache: (DecodeState, marker). ``group_size`` G: slots gG ..
    gG + G - 1 share a prompt, prefilled once (``rollout.admission.prompt_prefill``)."""
    statics = {"spec": spec, "prompt_width": rollout.prompt_width, "group_size": group_size}
    prefilled, _ = oppo_admission_prefill(params, admission, **statics)
    p, _ = feed_replay(spec, params, prefilled, replay)
    made = (p.cache, p.last_hidden, p.per_token)
    return oppo_decode_start(params, admission, base_key, *made, cfg=spec.model, rollout=rollout)


def feed_replay(spec: ScorerSpec, params, state, replay: Sequence[ReplayChunk]):
    """(``state`` with every chunk of ``replay`` fed, one compiled call each (donated), the
    last call's marker or None when there is nothing to feed)."""
    marker = None
    for chunk in replay:
        width = chunk.kv_width
        state, marker = oppo_replay(
            params, state, chunk.tokens, chunk.count, spec=spec, kv_width=width
        )
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
    statics = dict(cfg=cfg, sampling=rollout.sampling, chunk_size=chunk_size, mesh=rollout.mesh)
    for _ in range(-(-rollout.max_response_len // chunk_size)):
        state, _ = oppo_decode(params, state, never, **statics, kv_width=None)
    return state
