"""The consumers of one step's rollout on the scoring group: the reference, the critic, the
reward model and the reward functions. Every chunk and every batch reaches them through
``StepScorers``, and each call it dispatches records the tokens it computed and the real
tokens in them in the step's ledger (``pipeline.accounting``).

Streaming schedules ``admit`` the scorers (prompts, then the carried prefixes replayed or,
for the frozen scorers, their kept rows restored) and ``feed`` them each decode chunk; the
others score the batch once after the cut (``score_packed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from oppo_jax.pipeline.accounting import WorkLedger, admission_computed, admission_real
from oppo_jax.pipeline.kernels import Kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.scoring_kernels import keep_rows, packed_outputs, restore_rows
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import ChunkTokens, DecodeState
from oppo_jax.scoring.kept import FROZEN, KeptCaches
from oppo_jax.scoring.packed_chunks import plan_chunk
from oppo_jax.scoring.replay import ReplayChunk
from oppo_jax.scoring.stream import ScorerOutputs, ScorerParams, ScorerStates


class StepScorers:
    """The rollout's scorers on their group, and the reward functions (``rewards``: a
    ``rewards.runner.StepRewards`` or None), for one step."""

    def __init__(
        self,
        kernels: Kernels,
        place: Placement,
        params: ScorerParams,
        timeline: Timeline,
        work: WorkLedger,
        rewards=None,
    ):
        self.kernels, self.place, self.params = kernels, place, params
        self.timeline, self.work, self.rewards = timeline, work, rewards
        self.roles = kernels.scorer_specs.present()
        self.states: ScorerStates | None = None
        self.packed: ScorerOutputs | None = None  # sync: the packed scoring's outputs

    def dispatch(self, stage: str, role: str, kernel: Callable, *args):
        """Call ``role``'s ``kernel`` with its parameters and track it on the timeline."""
        state, marker = kernel(getattr(self.params, role), *args)
        self.timeline.track(f"{stage} {role}", self.place.scoring_group, marker)
        return state

    def admit(
        self,
        admission: Admission,
        replay: Sequence[ReplayChunk],
        slots,
        kept: KeptCaches | None = None,
    ) -> None:
        """Prefill every scorer with the ``admission``'s prompts (on the scoring group), then
        feed the carried prefixes of ``replay`` (``scoring.replay``). The frozen scorers take
        the leading carried slots' rows from ``kept`` instead, when it holds those very
        sequences (``KeptCaches.usable_rows``). ``slots`` is the step's ``SlotBatch``."""
        k, width = self.kernels, self.kernels.rollout.prompt_width
        carried = [c for c, d in zip(slots.entries, slots.deferrals, strict=True) if d > 0]
        used = kept.usable_rows(carried) if kept is not None else 0
        lens = (slots.prompt_len, slots.prefix_len, slots.active, slots.carrying)
        states = {}  # roles without a model stay None
        for role in self.roles:
            frozen = role in FROZEN
            params = getattr(self.params, role)
            state, marker = k.scorer_admit(role)(params, admission)
            if frozen and used > 0 and role in kept.states:
                state = restore_rows(state, kept.states[role], used)
                computed = admission_computed(admission.num_slots, width)
            else:
                state, fed = k.replay(role, params, state, replay)
                marker = marker if fed is None else fed
                computed = admission_computed(admission.num_slots, width, replay)
            self.timeline.track(f"prefill {role}", self.place.scoring_group, marker)
            # A trained scorer (the critic) needs every prefix again, a frozen one new prompts.
            real = admission_real(*lens, trained=int(not frozen), frozen=int(frozen))
            self.work.add("admission", computed, real)
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
        if self.kernels.packs_chunks:
            plans = plan_chunk(counts, chunk.tokens.shape[1])
            calls = [(on_scoring, plan) for plan in plans]
            computed = sum(plan["token_row"].size for plan in plans)
        else:
            calls, computed = [(on_scoring,)], chunk.tokens.shape[0] * chunk.tokens.shape[1]
        roles = len(self.roles)
        self.work.add("scoring", roles * computed, roles * int(np.sum(counts)))
        states = {role: getattr(self.states, role) for role in self.roles}
        for role in self.roles:
            kernel = self.kernels.scorer_chunk(role, kv_width)
            for args in calls:
                states[role] = self.dispatch("score", role, kernel, states[role], *args)
        self.states = ScorerStates(**states)

    def score_packed(self, decoding: DecodeState, rows: np.ndarray, slots) -> None:
        """Score the batch ``rows`` once, their real tokens packed (``scoring.packed``)."""
        if not self.roles:  # reward functions alone: no model reads the batch's sequences
            self.work.add("scoring", 0, 0)  # the ledger's stages are every schedule's
            self.packed = ScorerOutputs(None, None, None)
            return
        out, computed, real = packed_outputs(self, decoding, rows, slots)
        self.work.add("scoring", computed * len(self.roles), real * len(self.roles))
        self.packed = ScorerOutputs(out.get("reference"), out.get("critic"), out.get("reward"))

    def keep(self, slots: list[int], bucket: int) -> KeptCaches | None:
        """The frozen scorers' states of the carried ``slots`` in a block of ``bucket`` rows
        (None when none is carried)."""
        if not slots:
            return None
        frozen = {r: getattr(self.states, r) for r in self.roles if r in FROZEN}
        return keep_rows(frozen, slots, bucket, [])

    def outputs(self, decoding: DecodeState, rows: np.ndarray) -> ScorerOutputs:
        """The scores of the batch ``rows`` on the generation group, with the reward functions'
        values combined in (``rewards.runner.StepRewards.combine``: waits for them)."""
        out = self.packed if self.packed is not None else self.states.outputs()
        out = self.place.to_generation(out)
        return out if self.rewards is None else self.rewards.combine(out, decoding, rows)

    def close(self) -> None:
        """Let go of the scorers' caches and of this step's critic copy."""
        self.states = self.params = self.packed = None
