"""The consumers of one step's rollout on the scoring group: the reference, the critic, the
reward model and the reward functions. Every chunk and every batch reaches them through
``StepScorers``, whose calls go through ``Kernels`` (each one records its timeline mark and
tokens in the step's record, ``pipeline.accounting.StepRecorder``).

Streaming schedules ``admit`` the scorers (prompts, then the carried prefixes replayed or,
for the frozen scorers, their kept rows restored) and ``feed`` them each decode chunk; the
others score the batch once after the cut (``score_packed``): the host plans the batch's real
tokens into calls of one packed shape (``scoring.packed``) and each scorer's
``kernels.oppo_sync_scoring`` writes its calls' outputs at their slots. The frozen scorers'
rows of carried sequences are kept at the cut and restored at the next admission
(``keep_rows``, ``restore_rows``; ``scoring.carried``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.parallel.sharding import to_host
from oppo_jax.pipeline.accounting import admission_real
from oppo_jax.pipeline.kernels import Kernels
from oppo_jax.pipeline.placement import Placement, move
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import ChunkTokens, Responses
from oppo_jax.rollout.layout import assemble_sequences
from oppo_jax.scoring.carried import FROZEN, KeptCaches, ReplayChunk, put_rows, take_rows
from oppo_jax.scoring.packed import PackedBatch, ScoringCall, plan_packing
from oppo_jax.scoring.stream import (
    ScorerOutputs,
    ScorerParams,
    ScorerSpec,
    ScorerStates,
    plan_chunk,
)


class StepScorers:
    """The rollout's scorers on their group, and the reward functions (``rewards``: a
    ``rewards.runner.StepRewards`` or None), for one step."""

    def __init__(
        self,
        kernels: Kernels,
        place: Placement,
        params: ScorerParams,
        rewards=None,
    ):
        self.kernels, self.place, self.params = kernels, place, params
        self.rewards = rewards
        self.roles = kernels.scorer_specs.present()
        self.states: ScorerStates | None = None
        self.packed: ScorerOutputs | None = None  # sync: the packed scoring's outputs

    def admit(
        self,
        admission: Admission,
        replay: Sequence[ReplayChunk],
        slots,
        kept: KeptCaches | None = None,
        shared: int = 1,
    ) -> None:
        """Prefill every scorer with the ``admission``'s prompts (on the scoring group; each
        group of ``shared`` slots' prompt once, ``SlotBatch.shared_prompts``), then feed the
        carried prefixes of ``replay`` (``scoring.carried``). The frozen scorers take the
        leading carried slots' rows from ``kept`` instead, when it holds those very sequences
        (``KeptCaches.usable_rows``). ``slots`` is the step's ``SlotBatch``."""
        k = self.kernels
        carried = [c for c, d in zip(slots.entries, slots.deferrals, strict=True) if d > 0]
        used = kept.usable_rows(carried) if kept is not None else 0
        lens = (slots.prompt_len, slots.prefix_len, slots.active, slots.carrying)
        states = {}  # roles without a model stay None
        for role in self.roles:
            frozen = role in FROZEN
            params = getattr(self.params, role)
            # A trained scorer (the critic) needs every prefix again, a frozen one new prompts.
            real = admission_real(*lens, int(not frozen), int(frozen), shared)
            state, _ = k.prefill_prompts(role, params, admission, shared, real)
            if frozen and used > 0 and role in kept.states:
                state = restore_rows(state, kept.states[role], used)
            else:
                state, _ = k.replay_prefixes(role, params, state, replay)
            states[role] = state
        self.states = ScorerStates(**states)

    def feed(self, chunk: ChunkTokens, kv_width: int | None, counts: np.ndarray) -> None:
        """Hand a decode chunk (in the admission's slot layout) to every consumer: each scorer
        prefills its new tokens, attending over the first ``kv_width`` cache columns (None:
        all), packed into calls of one budget by its per-slot ``counts`` [S] where the scorers
        pack (``Kernels.packs_chunks``), else over every slot; the reward functions read it on
        their thread."""
        if self.rewards is not None:
            self.rewards.feed(chunk)
        on_scoring = self.place.to_scoring(chunk)
        if self.kernels.packs_chunks:  # each packed call: its plan and its real tokens
            calls = [(p, int(p["count"].sum())) for p in plan_chunk(counts, chunk.tokens.shape[1])]
        else:  # one call over every slot
            calls = [(None, int(np.sum(counts)))]
        states = {role: getattr(self.states, role) for role in self.roles}
        k = self.kernels
        for role in self.roles:
            params = getattr(self.params, role)
            for plan, real in calls:
                states[role], _ = k.score_streamed(
                    role, params, states[role], on_scoring, kv_width, plan, real
                )
        self.states = ScorerStates(**states)

    def score_packed(self, decoding: Responses, rows: np.ndarray, slots) -> None:
        """Score the batch ``rows`` once, their real tokens packed (``scoring.packed``)."""
        if not self.roles:  # reward functions alone: no model reads the batch's sequences
            self.packed = ScorerOutputs(None, None, None)
            return
        out = packed_outputs(self, decoding, rows, slots)
        self.packed = ScorerOutputs(out.get("reference"), out.get("critic"), out.get("reward"))

    def keep(self, slots: list[int], bucket: int) -> KeptCaches | None:
        """The frozen scorers' states of the carried ``slots`` in a block of ``bucket`` rows
        (None when none is carried)."""
        if not slots:
            return None
        frozen = {r: getattr(self.states, r) for r in self.roles if r in FROZEN}
        return keep_rows(frozen, slots, bucket, [])

    def outputs(self, decoding: Responses, rows: np.ndarray) -> ScorerOutputs:
        """The scores of the batch ``rows`` on the generation group, with the reward functions'
        values combined in (``rewards.runner.StepRewards.combine``: waits for them)."""
        out = self.packed if self.packed is not None else self.states.outputs()
        out = self.place.to_generation(out)
        return out if self.rewards is None else self.rewards.combine(out, decoding, rows)

    def close(self) -> None:
        """Let go of the scorers' caches and of this step's critic copy."""
        self.states = self.params = self.packed = None


def empty_outputs(spec: ScorerSpec, num_slots: int, sharding):
    """The zero outputs a scorer's packed calls write into: [S, R], or [S] for a score (host
    zeros moved over: no program compiles for them)."""
    shape = (num_slots,) if spec.kind == "score" else (num_slots, spec.response_len)
    return jax.device_put(np.zeros(shape, np.float32), sharding)


@functools.partial(jax.jit, static_argnames=("pad_id",))
def gather_batch_sequences(state, rows, prompts, prompt_len, *, pad_id: int):
    """(sequences [B, P + R]: prompt then the whole response, response lengths [B]) of the
    batch ``rows`` [B] of a decode state, from the slots' prompts [S, P] and prompt_len [S]."""
    response_len = state.num_generated[rows]
    seqs = assemble_sequences(
        prompts[rows], prompt_len[rows], state.tokens[rows], response_len, pad_id
    )
    return seqs, response_len


def _replicated(place) -> NamedSharding:
    """Where packed scoring's inputs live: replicated over the scoring mesh (the same layout
    in a step and in a warm-up, so both hit one compilation)."""
    return NamedSharding(place.scoring_mesh, PartitionSpec())


def batch_sequences(kernels, place, decoding, rows: np.ndarray, slots):
    """(sequences [B, P + R], response lengths [B]) of the batch ``rows`` (``slots``: the
    step's ``SlotBatch``), replicated where the scorers run."""
    prompts = np.asarray(slots.context[:, : kernels.rollout.prompt_width])
    pad = kernels.rollout.pad_id
    made = gather_batch_sequences(decoding, rows, prompts, slots.prompt_len, pad_id=pad)
    return move(made, _replicated(place))


def packed_inputs(sequences, response_len, prompt_len, plan: ScoringCall) -> PackedBatch:
    """A PackedBatch from device sequences and a host plan (the plan's arrays go to the
    sequences' devices)."""
    sharding = getattr(sequences, "sharding", None)
    put = functools.partial(jax.device_put, device=sharding)
    return PackedBatch(
        sequences=sequences,
        prompt_len=put(np.asarray(prompt_len, np.int32)),
        response_len=response_len,
        seq=put(plan.seq),
        col=put(plan.col),
        row=put(plan.row),
        offset=put(plan.offset),
    )


def packed_outputs(scorers, decoding, rows: np.ndarray, slots) -> dict:
    """Every scorer's output over the batch ``rows``, their real tokens packed into calls of
    one shape (``scoring.packed``); dispatched through ``scorers``
    (pipeline.step_scorers.StepScorers). Returns role -> [S, R] or [S] output."""
    k, place = scorers.kernels, scorers.place
    r = k.rollout
    rows = np.asarray(rows, np.int32)
    prompt_len = slots.prompt_len[rows]
    lengths = prompt_len + to_host(decoding.num_generated)[rows]  # the cut's only extra read
    plans = plan_packing(lengths, r.prompt_width + r.max_response_len)
    on_scoring = _replicated(place)
    sequences, response_len = batch_sequences(k, place, decoding, rows, slots)
    batches = [packed_inputs(sequences, response_len, prompt_len, plan) for plan in plans]
    at = jax.device_put(rows, on_scoring)
    out = {}
    for role in scorers.roles:
        out[role] = empty_outputs(getattr(k.scorer_specs, role), slots.num_slots, on_scoring)
        params = getattr(scorers.params, role)
        for plan, batch in zip(plans, batches, strict=True):
            out[role], _ = k.score_batch(role, params, out[role], plan, batch, at)
    return out


_take = jax.jit(take_rows)
_put = jax.jit(put_rows, donate_argnums=(0,))


def keep_rows(states: dict, slots: list[int], bucket: int, ids: list) -> KeptCaches:
    """The frozen scorers' states of ``slots`` (carried rows, buffer order), gathered into a
    ``bucket``-row block (padding repeats the last row and is never used)."""
    rows = jnp.asarray(slots + [slots[-1]] * (bucket - len(slots)), jnp.int32)
    return KeptCaches({role: _take(s, rows) for role, s in states.items()}, ids)


def restore_rows(state, kept_state, used: int):
    """``state`` (donated) with its first ``used`` slots taken from the kept block."""
    use = np.arange(kept_state.num_fed.shape[0]) < used  # host flags: no eager device ops
    return _put(state, kept_state, use)
