"""One PPO step, top to bottom: admit -> prefill -> decode (streaming) -> cut -> experience ->
update -> carry.

This is the only place a step is orchestrated; ``train`` and ``bench`` call ``run_step``. It is
plain Python that dispatches compiled kernels (``pipeline.kernels``) and never waits on them,
except for one small read per decode chunk (may the rollout be cut? and, when streaming, the
chunk's token count per slot, which packs its scoring), read one chunk late so the actor's
queue never drains while the host looks, and the reads the cut and the carry need. Every
schedule runs the same code: ``schedule.stream`` decides whether the scorers consume each
chunk as it is decoded or whole responses after generation; carrying is on when the plan
starts more sequences than the batch takes (B + Δ).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.pipeline.accounting import (
    WorkLedger,
    add_rollout,
    add_update,
    admission_computed,
    admission_real,
    decode_keys,
    ragged_key_blocks,
)
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
from oppo_jax.pipeline.kernels import Kernels
from oppo_jax.pipeline.placement import GENERATION, Placement
from oppo_jax.pipeline.schedule import Schedule
from oppo_jax.pipeline.slot_map import SlotMap, full_chunk, step_compaction
from oppo_jax.pipeline.step_scorers import StepScorers
from oppo_jax.pipeline.timeline import Event, Timeline, busy_fraction, stage_times
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import ChunkTokens, CutRule, DecodeState
from oppo_jax.scoring.kept import row_ids
from oppo_jax.scoring.replay import ReplayChunk, plan_replay
from oppo_jax.sharding import to_host


@dataclasses.dataclass(frozen=True)
class StepEngine:
    """What every step of a run dispatches to (static for the run)."""

    kernels: Kernels
    placement: Placement
    ref_params: Any  # reference weights, on the scoring group
    reward_params: Any  # reward-model weights on the scoring group; None with a reward_fn
    sample_key: jax.Array  # the run's sampling key: a token depends on (seed, prompt, position)
    max_deferrals: int  # a sequence carried this often must finish in its next step
    # Non-streaming schedules score the batch's real tokens packed (False: every slot over R).
    packed_scoring: bool = True
    # Streaming with carrying keeps the frozen scorers' caches of carried rows (False: re-prefill).
    keep_frozen_caches: bool = True
    # Streaming scores each chunk's new tokens packed (False: every slot, [S, C]).
    packed_chunk_scoring: bool = True
    rewards: Any = None  # oppo_jax.rewards.RewardFunctions (reward.functions), or None


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What the controllers chose for one step."""

    step: int  # index of the step (the policy version stamped on the tokens it samples)
    batch_size: int  # B, sequences the update takes
    overcommit: int  # Δ, sequences started beyond B (0 without carrying)
    reserved: int  # slots held for this run's largest B + Δ (one compiled shape); >= B + Δ
    chunk_size: int  # C, tokens per decode chunk
    kl_coef: float  # β of the KL penalty
    update_key: jax.Array  # randomness of the update's minibatch shuffles


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
    k, place, rollout = engine.kernels, engine.placement, engine.kernels.rollout
    timeline.begin_step()
    # 1. Admit: carried sequences first (FIFO), then new prompts, B + Δ of the slots.
    rule = AdmitRule(
        plan.batch_size + plan.overcommit,
        place.num_slots(plan.reserved),  # rounded up so the slots shard evenly
        room_for_prefix=plan.reserved > plan.batch_size,
        max_deferrals=engine.max_deferrals,
    )
    slots = admit(
        buffer, prompts, rule, rollout.prompt_width, rollout.max_response_len, rollout.pad_id
    )
    kept, buffer.kept = buffer.kept, None  # the frozen scorers' rows of the carried sequences
    admission = device_admission(slots)
    # 2. Prefill the actor under the current parameters: every prompt, then each carried
    #    prefix replayed at its own length, which gives it this step's old log-probs.
    actor = train_state.actor_model_params  # with LoRA: the adapters over the frozen base
    replay = admission_replay(slots, rollout)
    decoding, marker = k.admit(actor, admission, engine.sample_key, replay)
    timeline.track("prefill actor", GENERATION, marker)
    work = WorkLedger()
    work.add("admission", admission_computed(slots.num_slots, rollout.prompt_width, replay))
    # 3. Decode until the cut rule holds. Streaming: the scorers prefill each chunk while the
    #    actor decodes the next. Not streaming: they score whole responses afterwards.
    scorers = StepScorers(engine, train_state.critic_model_params, timeline, work)
    frozen = len([r for r in scorers.roles if r != "critic"])  # reference, reward model
    trained = 1 + len(scorers.roles) - frozen  # the actor, and the critic
    lens = (slots.prompt_len, slots.prefix_len, slots.active, slots.carrying)
    work.add("admission", 0, admission_real(*lens, trained=1, frozen=0))  # the actor's
    # Each scorer's real admission tokens, added only if it admits (sync's packed scoring
    # does not): trained ones re-prefill carried rows, frozen ones need only new prompts.
    scorers.admit_real = {
        "critic": admission_real(*lens, trained=trained - 1, frozen=0),
        "frozen": admission_real(*lens, trained=0, frozen=1),
    }
    decode_slots: list[int] = []  # slots of each decode chunk dispatched (accounting)
    decode_widths: list[int | None] = []  # and the cache columns it reads (None: all)
    # Reward functions run on host threads: each sequence is scored as soon as it ends.
    fn_rewards = engine.rewards.start(slots) if engine.rewards is not None else None
    cut_rule = CutRule(admission.active, admission.must_finish, jnp.int32(plan.batch_size))
    on_scoring = place.to_scoring(admission)
    longest = int(np.max(slots.prompt_len + slots.prefix_len))  # live widths start here
    chunking = (cut_rule, plan.chunk_size, longest)
    # None: every slot decodes to the end (Kernels.compact_slots; None there: the backend's)
    compaction = step_compaction(k.compaction_floor(place.num_slots(1)), slots.num_slots, scorers)
    if schedule.stream:
        from_buffer = [c for c, d in zip(slots.entries, slots.deferrals, strict=True) if d > 0]
        used = kept.usable_rows(from_buffer) if kept is not None else 0
        scorers.admit(on_scoring, replay, kept, used)
        kept = None  # its rows live on in the scorers' states only (memory: Δ_max rows once)
        decoding = _decode(
            k,
            timeline,
            actor,
            decoding,
            chunking,
            lambda chunk, width, counts: (
                scorers.feed(place.to_scoring(chunk), width, counts),
                fn_rewards and fn_rewards.feed(full_chunk(compaction, chunk)),  # reward thread
            ),
            dispatched=(decode_slots, decode_widths),
            compaction=compaction,
        )
    else:
        dispatched = (decode_slots, decode_widths)
        decoding = _decode(
            k, timeline, actor, decoding, chunking, dispatched=dispatched, compaction=compaction
        )
        if not engine.packed_scoring:  # every slot's responses past its prefix, R wide
            scorers.admit(on_scoring, replay)
            scorers.feed(place.to_scoring(k.responses(decoding, admission.prefix_len)))
    # 4. Cut: the first B completed sequences, in the fixed batch order.
    finish_step, decode_steps = to_host((decoding.finish_step, decoding.step))
    selection = select_batch(finish_step, slots.active, slots.must_finish, plan.batch_size)
    if selection is None:  # the decode loop only stops when the rule holds
        raise RuntimeError("rollout ended before enough sequences finished")
    if not schedule.stream and engine.packed_scoring:  # the batch's real tokens, packed
        scorers.score_packed(decoding, selection.batch, slots)
    new_kept = None
    if schedule.stream and engine.keep_frozen_caches:
        new_kept = scorers.keep(carried_slots(slots, selection), plan)
    # 5. Experience: rewards with the KL penalty, GAE and whitening over the batch rows.
    kl_coef = jnp.float32(plan.kl_coef)
    scored = place.to_generation(scorers.outputs())
    if fn_rewards is not None:  # score = reward.model_weight x RM + sum weight x function
        scored = fn_rewards.combine(scored, decoding, selection.batch)
    # Only the prompt columns: one compilation with or without room for carried prefixes.
    prompts_only = admission.replace(context=jnp.asarray(slots.context[:, : rollout.prompt_width]))
    rows = jnp.asarray(selection.batch, jnp.int32)
    batch, stats = k.experience(decoding, rows, prompts_only, scored, kl_coef)
    timeline.track("build batch", GENERATION, stats["reward"])
    stats.update(fn_rewards.metrics if fn_rewards is not None else {})  # reward_fn/<name>
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
    train_state, update_metrics = k.update(
        train_state, batch, plan.update_key, kl_coef, lengths=lengths
    )
    timeline.track("update", GENERATION, update_metrics["policy_loss"])
    # 7. Carry: sequences not taken keep the tokens they had at the cut (read while the
    #    update runs).
    host = _read_rollout(outputs[:2], generated, finish_step)
    lengths = (host.num_generated, slots.prefix_len)
    fed = 0 if scorers.packed else len(scorers.roles)  # packed scoring recorded its own
    add_rollout(work, decode_slots, int(decode_steps), plan.chunk_size, lengths, fed)
    capacity = rollout.prompt_width + rollout.max_response_len
    read = [capacity if w is None else w for w in decode_widths]
    per_slot = (slots.prompt_len, slots.prefix_len, host.num_generated)
    blocks = ragged_key_blocks(k.spec.actor, read)
    work.keys = decode_keys(
        decode_slots, read, int(decode_steps), plan.chunk_size, per_slot, blocks
    )
    in_batch = slots.prompt_len[selection.batch] + host.num_generated[selection.batch]
    # Each PPO epoch passes over the batch once in each trained model (actor and critic);
    # one pass computes the packed rows (or the padded [B, P + R] batch) the update reports.
    epochs = k.spec.ppo.ppo_epochs
    per_pass = (int(update_metrics["update_tokens_computed"]) // epochs,)
    add_update(work, per_pass, in_batch, 2 * epochs)
    carried = carry_out(slots, selection, host, plan.step)
    if new_kept is not None:
        new_kept.ids, buffer.kept = row_ids(carried), new_kept
    events, wall = timeline.end_step()
    result = StepResult(
        {**stats, **update_metrics}, selection, slots, host, events, wall, batch, work
    )
    return train_state, carried, result


def admission_replay(slots: SlotBatch, rollout) -> list[ReplayChunk]:
    """The replay of the slots' carried prefixes after their prompts (``scoring.replay``),
    planned on the host from the admitted lengths."""
    shape = (rollout.prompt_width, rollout.max_response_len)
    return plan_replay(slots.context, slots.prompt_len, slots.prefix_len, shape)


def device_admission(slots: SlotBatch) -> Admission:
    """The slots as device arrays for the admission kernels, after checking that carried
    sequences come first (``SlotBatch.check_carried_first``)."""
    slots.check_carried_first()
    return Admission(
        context=jnp.asarray(slots.context),
        prompt_len=jnp.asarray(slots.prompt_len),
        prefix_len=jnp.asarray(slots.prefix_len),
        prefix_finished=jnp.asarray(slots.prefix_finished),
        prefix_behaviour=jnp.asarray(slots.prefix_behaviour),
        prompt_id=jnp.asarray(slots.prompt_ids, jnp.int32),
        sample_index=jnp.zeros(slots.num_slots, jnp.int32),
        active=jnp.asarray(slots.active),
        must_finish=jnp.asarray(slots.must_finish),
    )


def _decode(
    kernels: Kernels,
    timeline: Timeline,
    params,
    state: DecodeState,
    chunking: tuple[CutRule, int, int],
    on_chunk: Callable[[ChunkTokens, int | None, np.ndarray], None] | None = None,
    dispatched: tuple[list, list] | None = None,
    compaction: tuple[SlotMap, Any] | None = None,
) -> DecodeState:
    """Decode until the cut rule allows the cut; ``on_chunk`` receives each chunk's tokens, the
    live width they fit in and their count per slot (read with the loop's flag, once the next
    chunk is dispatched: the scorers get a chunk once it is done, packed, in the layout they
    hold: ``SlotMap.scorers_chunk``); ``dispatched``
    gets the slot count and the live width of each chunk dispatched (accounting).
    ``chunking`` is (cut rule, C, the longest context admitted).

    Chunk i reads the cache's live prefix, sized on the host from the admitted lengths and i
    alone (``Kernels.chunk_width``). With ``compaction`` (a SlotMap and the scorers), the rows
    still running move into smaller slot buckets as the others finish (``pipeline.slot_map``),
    decided from their count, which the loop's one read per chunk carries; the state comes
    back in the admission's layout."""
    rule, chunk_size, longest = chunking
    slot_counts, widths = ([], []) if dispatched is None else dispatched

    def dispatch(i, state, rule):
        width = kernels.chunk_width(longest, chunk_size, i)
        slot_counts.append(state.tokens.shape[0])
        widths.append(width)
        state, chunk = kernels.decode(chunk_size, width)(params, state, rule)
        timeline.track("decode", GENERATION, chunk.count)
        return state, chunk, width

    state, chunk, width = dispatch(0, state, rule)
    for i in itertools.count(1):
        last, last_width = chunk, width
        state, chunk, width = dispatch(i, state, rule)  # dispatched before the host reads
        if on_chunk is None:
            running = int(jax.device_get(last.running))  # the loop's only read: -1 once ready
        else:  # streaming: the chunk's counts with it (one transfer), then it is scored
            # in the layout the scorers hold (packing ones keep the admission's: slot_map).
            streamed = last if compaction is None else compaction[0].scorers_chunk(last)
            # to_host: on several processes the counts are sharded over their slots.
            running, counts = to_host((streamed.running, streamed.count))
            running = int(running)
            on_chunk(streamed, last_width, np.asarray(counts))
        if running < 0:
            return state if compaction is None else compaction[0].restore(state, compaction[1])
        if compaction is None:
            continue
        slot_map, scorers = compaction
        state, chunk, rule = slot_map.maybe_compact(
            running, last.finished, state, chunk, rule, scorers
        )


def _read_rollout(
    outputs: tuple, num_generated: np.ndarray, finish_step: np.ndarray
) -> HostRollout:
    """Every slot's (tokens, logprobs), read to the host, with its lengths (read already)."""
    tokens, logprobs = to_host(outputs)
    return HostRollout(np.asarray(tokens), np.asarray(logprobs), num_generated, finish_step)
