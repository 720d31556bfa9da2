"""The streaming consumers of one step's rollout (reference, critic, reward) on the scoring
group: their admission (with the frozen scorers' kept caches), the chunks they are fed, the
packed scoring of non-streaming schedules, and the work each call adds to the step's ledger.
``pipeline.step.run_step`` owns one per step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from oppo_jax.pipeline.accounting import WorkLedger, admission_computed, token_count
from oppo_jax.pipeline.kernels import prompts_only
from oppo_jax.pipeline.scoring_kernels import (
    keep_rows,
    packed_outputs,
    packs_chunks,
    restore_rows,
)
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import ChunkTokens, DecodeState
from oppo_jax.scoring.kept import FROZEN, KeptCaches, kept_bucket
from oppo_jax.scoring.packed_chunks import plan_chunk
from oppo_jax.scoring.replay import ReplayChunk
from oppo_jax.scoring.stream import ScorerOutputs, ScorerParams, ScorerStates

if TYPE_CHECKING:
    from oppo_jax.pipeline.carry import SlotBatch
    from oppo_jax.pipeline.step import StepEngine, StepPlan


class StepScorers:
    """The streaming consumers (reference, critic, reward) of one rollout, on their group."""

    def __init__(self, engine: StepEngine, critic_params, timeline: Timeline, work: WorkLedger):
        k, place = engine.kernels, engine.placement
        self.kernels, self.timeline, self.group = k, timeline, place.scoring_group
        self.place = place
        self.work, self.prompt_width = work, k.rollout.prompt_width
        self.admit_real = {"critic": 0, "frozen": 0}  # set by run_step from host lengths
        self.roles = k.scorer_specs.present()
        self.packed_chunks = packs_chunks(engine)  # chunks packed (scoring.packed_chunks)
        self.params = ScorerParams(
            reference=engine.ref_params,
            critic=place.critic_for_scoring(k.spec.critic, critic_params),
            reward=engine.reward_params if "reward" in self.roles else None,
        )
        self.states: ScorerStates | None = None
        self.packed: ScorerOutputs | None = None  # non-streaming: the packed scoring's outputs

    def dispatch(self, stage: str, role: str, kernel: Callable, *args):
        state, marker = kernel(getattr(self.params, role), *args)
        self.timeline.track(f"{stage} {role}", self.group, marker)
        return state

    def admit(
        self,
        admission: Admission,
        replay: Sequence[ReplayChunk],
        kept: KeptCaches | None = None,
        used: int = 0,
    ) -> None:
        """Prefill every scorer with the prompts, then feed the carried prefixes of ``replay``
        (``scoring.replay``); the frozen ones take the first ``used`` slots from ``kept``
        instead of replaying them."""
        prompts = prompts_only(admission, self.prompt_width)
        head = admission_computed(admission.num_slots, self.prompt_width)
        states = {}
        for role in self.roles:
            reuse = used > 0 and role in FROZEN and role in kept.states
            params = getattr(self.params, role)
            state, marker = self.kernels.scorer_admit(role)(params, prompts)
            if reuse:
                state, computed = restore_rows(state, kept.states[role], used), head
            else:
                spec = getattr(self.kernels.scorer_specs, role)
                state, fed = self.kernels.replay(spec, params, state, replay)
                marker = marker if fed is None else fed
                computed = admission_computed(admission.num_slots, self.prompt_width, replay)
            self.timeline.track(f"prefill {role}", self.group, marker)
            real = self.admit_real["critic" if role == "critic" else "frozen"]
            self.work.add("admission", computed, real)
            states[role] = state
        self.states = ScorerStates(**states)

    def score_packed(self, decoding: DecodeState, rows: np.ndarray, slots: SlotBatch) -> None:
        """Score the batch ``rows`` once, their real tokens packed (``scoring.packed``)."""
        out, computed, real = packed_outputs(self, decoding, rows, slots)
        self.work.add("scoring", computed * len(self.roles), real * len(self.roles))
        self.packed = ScorerOutputs(out["reference"], out["critic"], out.get("reward"))

    def keep(self, slots: list[int], plan: StepPlan) -> KeptCaches | None:
        """The frozen scorers' states of the carried ``slots`` (None when none is carried)."""
        if not slots:
            return None
        bucket = kept_bucket(len(slots), plan.reserved - plan.batch_size)
        frozen = {r: getattr(self.states, r) for r in self.roles if r in FROZEN}
        return keep_rows(frozen, slots, bucket, [])

    def feed(self, chunk: ChunkTokens, kv_width: int | None = None, counts=None) -> None:
        """Prefill every scorer with the chunk's new tokens (attending over the first
        ``kv_width`` cache columns; None: all): in packed calls of one budget when the host
        has read the chunk's per-slot ``counts`` [S] (``scoring.packed_chunks``), else over
        every slot in one call."""
        plans = self.chunk_plans(counts, chunk.tokens.shape[1])
        if plans is None:
            calls, computed = [(chunk,)], token_count(chunk.tokens)
        else:
            calls = [(chunk, plan) for plan in plans]
            computed = sum(plan["token_row"].size for plan in plans)
        self.work.add("scoring", len(self.roles) * computed)
        states = {role: getattr(self.states, role) for role in self.roles}
        for role in self.roles:
            kernel = self.kernels.scorer_chunk(role, kv_width, plans is not None)
            for args in calls:
                states[role] = self.dispatch("score", role, kernel, states[role], *args)
        self.states = ScorerStates(**states)

    def chunk_plans(self, counts, width: int) -> list[dict] | None:
        """The packed calls of a chunk with these ``counts`` (``packed_chunks.plan_chunk``);
        None: score it over every slot (switched off, no counts read, or a scoring mesh that
        splits the slots: packing across its devices would move caches). Packing scorers stay
        in the admission's layout when the decode compacts, so every chunk they get has its
        S slots (``pipeline.slot_map``)."""
        if not self.packed_chunks or counts is None:
            return None
        return plan_chunk(counts, width)

    def outputs(self) -> ScorerOutputs:
        return self.packed if self.packed is not None else self.states.outputs()

    def close(self) -> None:
        """Let go of the scorers' caches and of this step's critic copy."""
        self.states = self.params = None
