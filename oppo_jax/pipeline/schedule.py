"""One PPO step under a schedule: ``sync`` (TRL's pipeline) or ``oppo`` (intra-step overlap).

Both run the same kernels and decode until the cut rule holds (all B finished, or, with
carrying, the B-th completion). ``sync`` then runs the scorers over whole responses and
updates; ``oppo`` starts the scorers with the prompts and feeds them each chunk the actor
decodes, so by the cut only the last chunk is left to score. The loop dispatches work and
never waits on it, except for one small read per chunk: whether the rollout may be cut,
read one chunk late so the actor's queue never drains while the host looks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.pipeline.carry import Selection, SlotBatch, select_batch
from oppo_jax.pipeline.kernels import Kernels
from oppo_jax.pipeline.placement import GENERATION, Placement
from oppo_jax.pipeline.timeline import Event, Timeline, busy_fraction, stage_times
from oppo_jax.rollout.decode import ChunkTokens, CutRule
from oppo_jax.sharding import to_host


@dataclasses.dataclass
class StepResult:
    """What one step produced (host arrays cover all S slots, in admission order)."""

    train_state: object
    metrics: dict  # device scalars: rollout statistics and update metrics
    selection: Selection  # batch slots and the cut position
    tokens: np.ndarray  # [S, R] response tokens of every slot
    logprobs: np.ndarray  # [S, R] log-probs recorded by this step's decode/admission
    num_generated: np.ndarray  # [S] response tokens per slot at the end of decoding
    finish_step: np.ndarray  # [S] decode position at which each slot finished (-1: running)
    events: list[Event]  # the step's timeline
    wall_s: float  # the step's wall time
    batch: object = None  # the PPOBatch the update consumed (device arrays, for inspection)

    @property
    def responses(self) -> np.ndarray:
        """[B, R] the batch's responses, in batch order."""
        return self.tokens[self.selection.batch]

    @property
    def response_len(self) -> np.ndarray:
        """[B] the batch's response lengths."""
        return self.num_generated[self.selection.batch]

    @property
    def stage_time_s(self) -> dict[str, float]:
        return stage_times(self.events)

    @property
    def busy_fraction(self) -> dict[str, float]:
        return busy_fraction(self.events, self.wall_s)


class Scorers:
    """The streaming consumers (reference, critic, reward) of one rollout, on their group."""

    def __init__(self, kernels: Kernels, placement: Placement, timeline: Timeline, params):
        self.kernels, self.placement, self.timeline = kernels, placement, timeline
        self.params = params  # role -> parameters already on the scoring group
        self.states: dict = {}

    def admit(self, context, prompt_len, prefix_len, carried_rows: int) -> None:
        for role, params in self.params.items():
            admit = self.kernels.scorer_admit(role)
            self.states[role], marker = admit(
                params, context, prompt_len, prefix_len, carried_rows=carried_rows
            )
            self.timeline.track(f"prefill {role}", self.placement.scoring_group, marker)

    def feed(self, chunk: ChunkTokens) -> None:
        for role, params in self.params.items():
            chunk_fn = self.kernels.scorer_chunk(role)
            self.states[role], marker = chunk_fn(params, self.states[role], chunk)
            self.timeline.track(f"score {role}", self.placement.scoring_group, marker)


def _decode_loop(kernels, timeline, params, state, rule, chunk_size, on_chunk=None):
    """Decode until ``rule`` allows the cut; ``on_chunk`` receives each chunk's tokens."""
    decode = kernels.decode(chunk_size)
    state, chunk = decode(params, state, rule)
    timeline.track("decode", GENERATION, chunk.count)
    while True:
        if on_chunk is not None:
            on_chunk(chunk)
        ready = chunk.ready
        state, chunk = decode(params, state, rule)  # dispatched before the host reads `ready`
        timeline.track("decode", GENERATION, chunk.count)
        if jax.device_get(ready):  # the loop's only host read (explicit, one boolean)
            return state


def run_step(
    kernels: Kernels,
    placement: Placement,
    timeline: Timeline,
    mode: str,
    chunk_size: int,
    train_state,
    ref_params,
    reward_params,
    slots: SlotBatch,
    batch_size: int,
    sample_key,
    update_key,
    kl_coef: float,
) -> StepResult:
    """One PPO step under ``mode`` ("sync" or "oppo"); see the module docstring."""
    if mode not in ("sync", "oppo"):
        raise ValueError(f"pipeline.mode={mode!r}: expected 'sync' or 'oppo'")
    timeline.begin_step()
    host = (slots.context, slots.prompt_len, slots.prefix_len)
    gen = tuple(jnp.asarray(x) for x in host)
    actor = train_state.actor_params
    state, marker = kernels.admit(
        actor, *gen, jnp.asarray(slots.prefix_finished), jnp.asarray(slots.prompt_ids, jnp.int32),
        jnp.zeros(slots.num_slots, jnp.int32), sample_key, jnp.asarray(slots.active),
        carried_rows=slots.carried_rows,
    )  # fmt: skip
    timeline.track("prefill actor", GENERATION, marker)
    rule = CutRule(jnp.asarray(slots.active), jnp.asarray(slots.must_finish),
                   jnp.int32(batch_size))  # fmt: skip
    scorer_params = {
        "reference": ref_params,
        "critic": placement.critic_for_scoring(kernels.spec.critic, train_state.critic_params),
    }
    if kernels.reward_fn is None:
        scorer_params["reward"] = reward_params
    scorers = Scorers(kernels, placement, timeline, scorer_params)
    scoring_inputs = placement.to_scoring(gen)
    if mode == "oppo":
        scorers.admit(*scoring_inputs, slots.carried_rows)
        state = _decode_loop(kernels, timeline, actor, state, rule, chunk_size,
                             lambda c: scorers.feed(placement.to_scoring(c)))  # fmt: skip
    else:
        state = _decode_loop(kernels, timeline, actor, state, rule, chunk_size)
        # Whole responses past any carried prefix, as one chunk, after generation ended.
        start = jnp.asarray(slots.prefix_len)
        offsets = jnp.arange(state.response_capacity)[None, :]
        cols = jnp.clip(start[:, None] + offsets, 0, state.response_capacity - 1)
        count = state.num_generated - start
        fresh = jnp.where(offsets < count[:, None], jnp.take_along_axis(state.tokens, cols, 1), 0)
        scorers.admit(*scoring_inputs, slots.carried_rows)
        scorers.feed(placement.to_scoring(ChunkTokens(fresh, start, count, jnp.bool_(True))))
    return _finish(kernels, placement, timeline, scorers, state, slots, gen, batch_size,
                   train_state, update_key, kl_coef)  # fmt: skip


def _finish(kernels, placement, timeline, scorers, state, slots, gen, batch_size, train_state,
            key, kl_coef):  # fmt: skip
    """Cut the rollout, build the batch from the chosen slots, update, close the timeline."""
    finish_step = to_host(state.finish_step)
    selection = select_batch(finish_step, slots.active, slots.must_finish, batch_size)
    if selection is None:  # the decode loop only stops when the rule holds
        raise RuntimeError("rollout ended before enough sequences finished")
    outputs = placement.to_generation({
        "ref_logp": scorers.states["reference"].per_token,
        "values": scorers.states["critic"].per_token,
        "scores": scorers.states["reward"].score if "reward" in scorers.states else None,
    })  # fmt: skip
    kl = jnp.float32(kl_coef)
    # Only the prompts of the context are needed: one compilation for every admission width.
    prompts = jnp.asarray(slots.context[:, : kernels.rollout.prompt_width])
    batch, stats = kernels.experience(
        state, jnp.asarray(selection.batch, jnp.int32), prompts, *gen[1:],
        jnp.asarray(slots.prefix_behaviour), **outputs, kl_coef=kl,
    )  # fmt: skip
    timeline.track("build batch", GENERATION, stats["reward"])
    train_state, update_metrics = kernels.update(train_state, batch, key, kl)
    timeline.track("update", GENERATION, update_metrics["policy_loss"])
    tokens, logprobs, num_generated = to_host((state.tokens, state.logprobs, state.num_generated))
    events, wall = timeline.end_step()
    return StepResult(
        train_state, {**stats, **update_metrics}, selection, np.asarray(tokens),
        np.asarray(logprobs), np.asarray(num_generated), finish_step, events, wall, batch,
    )  # fmt: skip
