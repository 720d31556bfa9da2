"""One PPO step, top to bottom, as DESIGN §3 numbers it: admit -> decode and stream -> cut ->
finalize scores -> update, then carry (dispatched after the update so that its host reads
overlap it); the caller's controllers observe the result (step 7, control).

This is the only place a step is orchestrated; ``train`` and ``bench`` call ``run_step``. It is
plain Python that dispatches compiled kernels (``pipeline.kernels``) and never waits on them,
except for the decode loop's one small read per chunk (``pipeline.decode_loop``) and the
reads the cut and the carry need. Every schedule runs the same code: ``schedule.stream``
decides whether the scorers consume each chunk as it is decoded or the batch after the cut;
carrying is on when the plan starts more sequences than the batch takes (B + Δ).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from oppo_jax.parallel.sharding import to_host
from oppo_jax.pipeline.accounting import WorkLedger, admission_real
from oppo_jax.pipeline.carry import (
    AdmitRule,
    Carried,
    CarryBuffer,
    HostRollout,
    Selection,
    SlotBatch,
    admit,
    carried_slots,
    carry_out,
    select_batch,
)
from oppo_jax.pipeline.decode_loop import Chunking, decode_rollout
from oppo_jax.pipeline.kernels import Kernels
from oppo_jax.pipeline.placement import GENERATION, Placement
from oppo_jax.pipeline.schedule import Schedule
from oppo_jax.pipeline.step_scorers import StepScorers
from oppo_jax.pipeline.timeline import Event, Timeline, busy_fraction, stage_times
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import CutRule
from oppo_jax.scoring.carried import ReplayChunk, kept_bucket, plan_replay, row_ids
from oppo_jax.scoring.stream import ScorerParams


@dataclasses.dataclass(frozen=True)
class StepEngine:
    """What every step of a run dispatches to (static for the run)."""

    kernels: Kernels
    placement: Placement
    ref_params: Any  # reference weights, on the scoring group
    reward_params: Any  # reward-model weights on the scoring group; None with a reward_fn
    sample_key: jax.Array  # the run's sampling key: a token depends on (seed, prompt, position)
    max_staleness: int  # rollout.max_staleness: a sequence carried this often is at the bound
    rewards: Any = None  # oppo_jax.rewards.RewardFunctions (reward.functions), or None
    on_stale: str = "finish"  # rollout.on_stale: at the bound, finish | drop (AdmitRule)
    carry_kv: str = "replay"  # rollout.carry_kv: refilling rows under new weights, replay | keep


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What the controllers chose for one step."""

    step: int  # index of the step (the policy version stamped on the tokens it samples)
    batch_size: int  # B, sequences the update takes
    overcommit: int  # Δ·G, sequences started beyond B (0 without carrying)
    reserved: int  # slots held for this run's largest B + Δ·G (one compiled shape); >= B + Δ·G
    chunk_size: int  # C, tokens per decode chunk
    kl_coef: float  # β of the KL penalty
    update_key: jax.Array  # randomness of the update's minibatch shuffles
    group_size: int = 1  # G, samples per prompt: admitted, cut and carried as one group


@dataclasses.dataclass
class StepResult:
    """What one step produced; host arrays cover all S slots, in admission order."""

    metrics: dict  # device scalars: rollout statistics and update metrics
    selection: Selection  # batch slots and the cut position
    slots: SlotBatch  # what was admitted
    rollout: HostRollout  # every slot's tokens, log-probs, lengths and finish positions
    events: list[Event]  # the step's timeline
    wall_s: float  # the step's wall time
    batch: Any = None  # the PPOBatch the update consumed (device arrays, for inspection)
    work: WorkLedger | None = None  # tokens computed / real per stage (pipeline.accounting)
    refill: dict | None = None  # a refilling step's groups dropped and still in flight

    @property
    def responses(self) -> np.ndarray:
        """[B, R] the batch's responses, in batch order."""
        return self.rollout.tokens[self.selection.batch]

    @property
    def response_len(self) -> np.ndarray:
        """[B] the batch's response lengths."""
        return self.rollout.num_generated[self.selection.batch]

    @property
    def stage_time_s(self) -> dict[str, float]:
        return stage_times(self.events)

    @property
    def busy_fraction(self) -> dict[str, float]:
        return busy_fraction(self.events, self.wall_s)


def run_step(
    engine: StepEngine,
    schedule: Schedule,
    plan: StepPlan,
    train_state,
    buffer: CarryBuffer,
    prompts,
    timeline: Timeline,
) -> tuple[Any, list[Carried], StepResult]:
    """One PPO step; returns (new train state, carried sequences, StepResult).

    ``buffer`` gives up the sequences this step admits; the caller adds the returned carried
    ones to it. ``prompts`` has ``take(k)`` -> [(prompt_id, tokens)].
    """
    k: Kernels = engine.kernels  # named with its type: a reader's (or a walk's) way in
    # The step's record: every kernel call below marks the timeline and counts its tokens.
    work = k.recorder.start(timeline, GENERATION, engine.placement.scoring_group)
    # 1. Admit: carried sequences first (FIFO), then new prompts, B + Δ of the slots;
    slots = admit(buffer, prompts, admit_rule(engine, plan), *rollout_shape(k.rollout))
    kept, buffer.kept = buffer.kept, None  # the frozen scorers' rows of the carried sequences
    admission = slot_admission(slots)
    #    the actor prefills them under the current parameters: every prompt (each group's
    #    once), then each carried prefix replayed at its own length (this step's old log-probs).
    actor = train_state.actor_model_params  # with LoRA: the adapters over the frozen base
    replay, shared = admission_replay(slots, k.rollout), slots.shared_prompts(plan.group_size)
    lens = (slots.prompt_len, slots.prefix_len, slots.active, slots.carrying)
    real = admission_real(*lens, trained=1, frozen=0, shared=shared)
    decoding, _ = k.prefill_actor(actor, admission, engine.sample_key, replay, shared, real)
    # 2. Decode and stream until the cut rule holds. Streaming: the scorers are admitted too
    #    and prefill each chunk while the actor decodes the next. Not streaming: they score
    #    the batch after the cut.
    scorers = step_scorers(engine, train_state, slots)
    if schedule.stream:
        scorers.admit(engine.placement.to_scoring(admission), replay, slots, kept, shared)
    del kept  # its rows live on in the scorers' states only (memory: Δ_max rows once)
    rule = cut_rule(admission, plan)
    longest = int(np.max(slots.prompt_len + slots.prefix_len))  # live widths start here
    chunking = Chunking(rule, plan.chunk_size, longest)
    streamed = scorers if schedule.stream else None
    decoding = decode_rollout(k, actor, decoding, chunking, streamed)
    # 3. Cut: the first B/G completed groups, in the fixed batch order.
    finish_step, decode_steps = to_host((decoding.finish_step, decoding.step))
    must = (slots.active, slots.must_finish)
    selection = select_batch(finish_step, *must, plan.batch_size, plan.group_size)
    if selection is None:  # the decode loop only stops when the rule holds
        raise RuntimeError("rollout ended before enough sequences finished")
    if not schedule.stream:  # the batch's real tokens, packed
        scorers.score_packed(decoding, selection.batch, slots)
    carried_rows = carried_slots(slots, selection) if schedule.stream else []  # kept there
    bucket = kept_bucket(len(carried_rows), plan.reserved - plan.batch_size)
    new_kept = scorers.keep(carried_rows, bucket)
    # 4. Finalize scores (the reward functions' too), then the batch: rewards with the KL
    #    penalty, GAE and whitening over the batch rows.
    kl_coef = np.float32(plan.kl_coef)  # a host scalar: no eager device op to compile
    scored = scorers.outputs(decoding, selection.batch)
    # Only the prompt columns: one compilation with or without room for carried prefixes.
    prompts_only = admission.replace(context=on_device(slots.context[:, : k.rollout.prompt_width]))
    rows = on_device(selection.batch, np.int32)
    batch, stats = k.experience(decoding, rows, prompts_only, scored, kl_coef)
    stats.update(scorers.rewards.metrics if scorers.rewards is not None else {})
    # Drop the KV caches (actor and scorers) before the update: their buffers are freed as
    # soon as the experience kernel has read them, so the update has that memory.
    outputs = (decoding.tokens, decoding.logprobs, decoding.num_generated)
    del decoding, scored
    scorers.close()
    # 6. Update: PPO epochs x minibatches over the batch, one jitted call. The packed update
    #    plans its rows from the batch's lengths: the decode has finished (finish_step was
    #    read), so reading its lengths here does not wait on the experience kernel.
    generated = np.asarray(to_host(outputs[2]))  # read once: the carry below reuses it
    lengths = (slots.prompt_len[selection.batch], generated[selection.batch])
    train_state, update_metrics = k.train_models(
        train_state, batch, plan.update_key, kl_coef, lengths=lengths
    )
    # 5. Carry: sequences not taken keep the tokens they had at the cut (read while the
    #    update runs) and the frozen scorers' rows kept at the cut.
    host = _read_rollout(outputs[:2], generated, finish_step)
    per_slot = (slots.prompt_len, slots.prefix_len, host.num_generated)
    work.close_decode(int(decode_steps), plan.chunk_size, per_slot, k.spec.actor)
    carried = carry_out(slots, selection, host, plan.step)
    if new_kept is not None:
        new_kept.ids, buffer.kept = row_ids(carried), new_kept
    events, wall = k.recorder.stop()  # later calls record nothing in this step
    result = StepResult(
        {**stats, **update_metrics}, selection, slots, host, events, wall, batch, work
    )
    return train_state, carried, result


def admit_rule(engine: StepEngine, plan: StepPlan) -> AdmitRule:
    """B + Δ·G sequences into the slots reserved for the run's largest B + Δ·G (rounded up so
    they shard evenly)."""
    return AdmitRule(
        plan.batch_size + plan.overcommit,
        engine.placement.num_slots(plan.reserved),
        room_for_prefix=plan.reserved > plan.batch_size,
        max_staleness=engine.max_staleness,
        group_size=plan.group_size,
        on_stale=engine.on_stale,
    )


def cut_rule(admission: Admission, plan: StepPlan) -> CutRule:
    """The decode's stop rule: B/G complete groups (slot s in group s // G; G = 1: B
    sequences, each its own group, the rule without group ids)."""
    g, slots = plan.group_size, admission.num_slots
    # Host values: eager device ops would be programs to compile, and an array put on one
    # device would be resliced over a mesh; the decode transfers these to its shardings.
    group = None if g == 1 else np.arange(slots, dtype=np.int32) // g
    target = np.asarray(plan.batch_size // g, np.int32)
    return CutRule(admission.active, admission.must_finish, target, group)


def rollout_shape(rollout) -> tuple[int, int, int]:
    """(P, R, pad id): what an admission lays its slots out by."""
    return rollout.prompt_width, rollout.max_response_len, rollout.pad_id


def step_scorers(engine: StepEngine, train_state, slots) -> StepScorers:
    """The step's scorers: the frozen ones' parameters, this step's critic placed on the
    scoring group, and the reward functions' runner for these ``slots`` (if any)."""
    k, place = engine.kernels, engine.placement
    params = ScorerParams(
        reference=engine.ref_params,
        critic=critic_params(engine, train_state),
        reward=engine.reward_params if k.scorer_specs.reward is not None else None,
    )
    # Reward functions run on host threads: each sequence is scored as soon as it ends.
    rewards = engine.rewards.start(slots) if engine.rewards is not None else None
    return StepScorers(k, place, params, rewards)


def critic_params(engine: StepEngine, train_state):
    """This step's critic weights where the scorers run; None without a critic."""
    spec = engine.kernels.spec
    if "critic" not in spec.trained:  # the estimator trains no critic
        return None
    return engine.placement.critic_for_scoring(spec.critic, train_state.critic_model_params)


def admission_replay(slots: SlotBatch, rollout) -> list[ReplayChunk]:
    """The replay of the slots' carried prefixes after their prompts (``scoring.carried``),
    planned on the host from the admitted lengths."""
    shape = (rollout.prompt_width, rollout.max_response_len)
    return plan_replay(slots.context, slots.prompt_len, slots.prefix_len, shape)


def slot_admission(slots: SlotBatch) -> Admission:
    """The slots for the admission kernels, after checking that carried sequences come first
    (``SlotBatch.check_carried_first``): host arrays, which each program taking them transfers
    to its own shardings (put on one device first, they were resliced over a mesh by small
    programs compiled after the warm-up)."""
    slots.check_carried_first()
    return Admission(
        context=np.asarray(slots.context),
        prompt_len=np.asarray(slots.prompt_len),
        prefix_len=np.asarray(slots.prefix_len),
        prefix_finished=np.asarray(slots.prefix_finished),
        prefix_behaviour=np.asarray(slots.prefix_behaviour),
        prompt_id=np.asarray(slots.prompt_ids, np.int32),
        sample_index=np.asarray(slots.sample_index),
        active=np.asarray(slots.active),
        must_finish=np.asarray(slots.must_finish),
    )


def on_device(values, dtype=None) -> jax.Array:
    """Host ``values`` copied to the default device: a transfer, where ``jnp.asarray`` would
    compile a small program for each new shape and dtype."""
    return jax.device_put(np.asarray(values, dtype))


def _read_rollout(
    outputs: tuple, num_generated: np.ndarray, finish_step: np.ndarray
) -> HostRollout:
    """Every slot's (tokens, logprobs), read to the host, with its lengths (read already)."""
    tokens, logprobs = to_host(outputs)
    return HostRollout(np.asarray(tokens), np.asarray(logprobs), num_generated, finish_step)
