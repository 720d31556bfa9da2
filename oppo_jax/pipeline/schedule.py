"""One PPO step under a schedule: ``sync`` (TRL's pipeline) or ``oppo`` (intra-step overlap).

Both run the same kernels. ``sync`` decodes every response to the end, then runs the scorers
over whole responses, then updates. ``oppo`` starts the scorers with the prompts and feeds
them each chunk the actor decodes, so by the time the last response ends only its last chunk
is left to score. The loop dispatches work and never waits on it, except for one small read
per chunk: whether every slot has finished, read one chunk late so the actor's queue never
drains while the host looks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.pipeline.kernels import Kernels
from oppo_jax.pipeline.placement import GENERATION, Placement
from oppo_jax.pipeline.timeline import Event, Timeline, busy_fraction, stage_times
from oppo_jax.rollout.decode import ChunkTokens


@dataclasses.dataclass
class PromptBatch:
    """B prompts right-padded to the rollout's prompt width, with their ids."""

    tokens: np.ndarray  # [B, P] int32
    lengths: np.ndarray  # [B] int32
    prompt_ids: np.ndarray  # [B] int64, unique per (epoch, prompt)

    @classmethod
    def from_pairs(cls, pairs, width: int, pad_id: int = 0) -> PromptBatch:
        tokens = np.full((len(pairs), width), pad_id, np.int32)
        lengths = np.zeros(len(pairs), np.int32)
        for i, (_, toks) in enumerate(pairs):
            tokens[i, : len(toks)] = toks
            lengths[i] = len(toks)
        return cls(tokens, lengths, np.asarray([pid for pid, _ in pairs], np.int64))


@dataclasses.dataclass
class StepResult:
    """What one step produced."""

    train_state: object
    metrics: dict  # device scalars: rollout statistics and update metrics
    responses: np.ndarray  # [B, R] response tokens (host copy: gold scores, logs)
    response_len: np.ndarray  # [B]
    events: list[Event]  # the step's timeline
    wall_s: float  # the step's wall time
    batch: object = None  # the PPOBatch the update consumed (device arrays, for inspection)

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

    def start(self, prompts, lengths) -> None:
        for role, params in self.params.items():
            self.states[role], marker = self.kernels.scorer(role)[0](params, prompts, lengths)
            self.timeline.track(f"prefill {role}", self.placement.scoring_group, marker)

    def feed(self, chunk: ChunkTokens) -> None:
        for role, params in self.params.items():
            self.states[role], marker = self.kernels.scorer(role)[1](
                params, self.states[role], chunk
            )
            self.timeline.track(f"score {role}", self.placement.scoring_group, marker)


def _decode_loop(kernels, timeline, params, state, chunk_size, on_chunk=None):
    """Decode until every slot has finished; ``on_chunk`` receives each chunk's tokens."""
    decode = kernels.decode(chunk_size)
    state, chunk = decode(params, state)
    timeline.track("decode", GENERATION, chunk.count)
    while True:
        if on_chunk is not None:
            on_chunk(chunk)
        done = chunk.all_finished
        state, chunk = decode(params, state)  # dispatched before the host reads `done`
        timeline.track("decode", GENERATION, chunk.count)
        if jax.device_get(done):  # the loop's only host read (explicit, one boolean)
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
    prompts: PromptBatch,
    sample_key,
    update_key,
    kl_coef: float,
) -> StepResult:
    """One PPO step under ``mode`` ("sync" or "oppo"); see the module docstring."""
    if mode not in ("sync", "oppo"):
        raise ValueError(f"pipeline.mode={mode!r}: expected 'sync' or 'oppo'")
    timeline.begin_step()
    gen_prompts = (jnp.asarray(prompts.tokens), jnp.asarray(prompts.lengths))
    actor = train_state.actor_params
    state, marker = kernels.start(
        actor, *gen_prompts, jnp.asarray(prompts.prompt_ids, jnp.int32),
        jnp.zeros(len(prompts.lengths), jnp.int32), sample_key,
    )  # fmt: skip
    timeline.track("prefill actor", GENERATION, marker)
    scorer_params = {
        "reference": ref_params,
        "critic": placement.to_scoring(train_state.critic_params),
    }
    if kernels.reward_fn is None:
        scorer_params["reward"] = reward_params
    scorers = Scorers(kernels, placement, timeline, scorer_params)
    score_prompts = placement.to_scoring(gen_prompts)
    if mode == "oppo":
        scorers.start(*score_prompts)
        state = _decode_loop(kernels, timeline, actor, state, chunk_size,
                             lambda c: scorers.feed(placement.to_scoring(c)))  # fmt: skip
    else:
        state = _decode_loop(kernels, timeline, actor, state, chunk_size)
        whole = ChunkTokens(state.tokens, jnp.zeros_like(state.num_generated),
                            state.num_generated, jnp.bool_(True))  # fmt: skip
        scorers.start(*score_prompts)
        scorers.feed(placement.to_scoring(whole))
    return _finish(kernels, placement, timeline, scorers, state, gen_prompts, train_state,
                   update_key, kl_coef)  # fmt: skip


def _finish(kernels, placement, timeline, scorers, state, gen_prompts, train_state, key, kl_coef):
    """Gather the scorers' outputs, build the batch, update, and close the timeline."""
    outputs = placement.to_generation({
        "ref_logp": scorers.states["reference"].per_token,
        "values": scorers.states["critic"].per_token,
        "scores": scorers.states["reward"].score if "reward" in scorers.states else None,
    })  # fmt: skip
    kl = jnp.float32(kl_coef)
    batch, stats = kernels.experience(state, *gen_prompts, **outputs, kl_coef=kl)
    timeline.track("build batch", GENERATION, stats["reward"])
    train_state, update_metrics = kernels.update(train_state, batch, key, kl)
    timeline.track("update", GENERATION, update_metrics["policy_loss"])
    responses, lengths = jax.device_get((state.tokens, state.num_generated))
    events, wall = timeline.end_step()
    return StepResult(train_state, {**stats, **update_metrics}, np.asarray(responses),
                      np.asarray(lengths), events, wall, batch)  # fmt: skip
