"""Chunked decoding: ``decode_chunk`` advances every running slot by up to C tokens in one
compiled loop, stopping at the cut.

Dimension letters: S slots, P prompt width, R response capacity (max response length), V vocab.
All slots decode in lockstep; a slot that has finished (EOS, max length, or empty) is frozen:
it samples nothing, writes nothing and its cache length stops advancing.

With a ``mesh``, the kernels lay the per-slot state out along the slot axis over the batch
axes, and the cache's kv-heads over tensor (``oppo_jax.parallel.sharding.slot_shardings``), so each
device holds 1/(data x fsdp) of the slots; the parameters arrive with their own shardings.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from oppo_jax.models.heads import apply_head
from oppo_jax.models.kv_cache import KVCache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer
from oppo_jax.parallel.sharding import constrain_slots
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.layout import response_tokens
from oppo_jax.rollout.lengths import NO_TARGET, sample_to_length, target_lengths
from oppo_jax.rollout.sampling import SamplingConfig, sample_tokens, token_keys
from oppo_jax.rollout.spec import RolloutSpec


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries from chunk to chunk, for S slots."""

    cache: KVCache  # the actor's keys/values: prompt then response, per slot
    next_logits: Float[Array, "S V"]  # logits of each slot's next token (float32)
    tokens: Int[Array, "S R"]  # response tokens so far; pad_id after num_generated
    logprobs: Float[Array, "S R"]  # behaviour log-prob of each response token; 0 after
    num_generated: Int[Array, " S"]  # response tokens so far
    finished: Bool[Array, " S"]  # stopped: EOS, max length, or an empty slot
    finish_step: Int[Array, " S"]  # lockstep decode step at which the slot finished; -1 if not
    prompt_id: Int[Array, " S"]  # id of the prompt in the slot (for the sampling key)
    sample_index: Int[Array, " S"]  # which of the prompt's samples this is
    step: Int[Array, ""]  # decode steps taken (the lockstep clock)
    base_key: jax.Array  # the run's sampling key
    # response length at which EOS is forced (withheld before it); NO_TARGET: the policy's
    target_len: Int[Array, " S"]
    eos_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=(1,))
    pad_id: int = flax.struct.field(pytree_node=False, default=0)
    fixed_lengths: bool = flax.struct.field(pytree_node=False, default=False)  # steer EOS

    @property
    def response_capacity(self) -> int:
        return self.tokens.shape[1]


@flax.struct.dataclass
class ResponseBatch:
    """Responses as the scorers and the experience read a decode state's (its tokens,
    log-probs and lengths), gathered from elsewhere: a refilling run's batch, whose samples
    left their rows as they finished (``pipeline.refill_step``)."""

    tokens: Int[Array, "B R"]
    logprobs: Float[Array, "B R"]  # PPO's old log-probs: this step's weights
    num_generated: Int[Array, " B"]


Responses = DecodeState | ResponseBatch  # what the batch's consumers read responses from


def _apply(cfg: ModelConfig, params, tokens, cache, n_valid=None, kv_width=None):
    return Transformer(cfg).apply({"params": params}, tokens, cache, n_valid, kv_width=kv_width)


# What a replayed admission hands the decode: the slots' cache (prompt + carried prefix), the
# hidden state at each slot's last context token, and the current policy's log-probs of the
# carried prefix tokens [S, R] (zero past each prefix). ``scoring.carried`` builds it.
Prefilled = tuple[KVCache, Float[Array, "S D"], Float[Array, "S R"]]


def admit_decode(
    cfg: ModelConfig,
    params,
    admission: Admission,
    base_key: jax.Array,
    rollout: RolloutSpec,
    prefilled: Prefilled,
) -> DecodeState:
    """The decode state of admitted slots, which may carry a partial response.

    ``prefilled`` is the slots' context (prompt + carried prefix) prefilled under the current
    parameters, with the current policy's log-probs (logits / temperature) of the prefix
    tokens: the "old" log-probs of this step, stored in ``logprobs`` (``pipeline.kernels.
    admit_actor`` replays carried prefixes into it). Decoding then continues at each slot's
    response position ``prefix_len[s]``, with the same sampling keys it would have used
    had it never been interrupted. ``prefix_finished`` slots are complete already. With
    ``rollout.mesh`` the state comes out sharded along the slots.
    """
    a, r = admission, rollout.max_response_len
    cache, last_hidden, logprobs = prefilled
    # The LM head at one position per slot: the logits the first decode step samples from.
    next_logits = apply_head(cfg, params, last_hidden).astype(jnp.float32)
    prefix = response_tokens(a.context, a.prompt_len, r)
    in_prefix = jnp.arange(r)[None, :] < a.prefix_len[:, None]
    finished = ~a.active | a.prefix_finished
    state = DecodeState(
        cache=cache,
        next_logits=next_logits,
        tokens=jnp.where(in_prefix, prefix, rollout.pad_id).astype(jnp.int32),
        logprobs=jnp.where(in_prefix, logprobs, 0.0),
        num_generated=a.prefix_len.astype(jnp.int32),
        finished=finished,
        finish_step=jnp.where(finished, 0, -1).astype(jnp.int32),
        prompt_id=a.prompt_id.astype(jnp.int32),
        sample_index=a.sample_index.astype(jnp.int32),
        step=jnp.zeros((), jnp.int32),
        base_key=base_key,
        target_len=_target_lengths(rollout, base_key, a),
        eos_ids=tuple(rollout.eos_ids),
        pad_id=rollout.pad_id,
        fixed_lengths=rollout.lengths is not None,
    )
    return constrain_slots(state, rollout.mesh)


def _target_lengths(rollout: RolloutSpec, base_key: jax.Array, a: Admission) -> jax.Array:
    """Each slot's synthetic length (a function of seed, prompt id and sample index, so a
    carried sequence gets its own back), or NO_TARGET when the policy decides."""
    if rollout.lengths is None:
        return jnp.full(a.prompt_id.shape, NO_TARGET, jnp.int32)
    r = rollout.max_response_len
    return target_lengths(rollout.lengths, base_key, a.prompt_id, a.sample_index, r)


def decode_step(
    cfg: ModelConfig,
    sampling: SamplingConfig,
    params,
    state: DecodeState,
    kv_width: int | None = None,
):
    """Sample one token for every running slot, record it, and feed it to the model, whose
    attention reads the first ``kv_width`` cache columns (None: all; see ``live_width``)."""
    running = ~state.finished
    position = state.num_generated
    keys = token_keys(state.base_key, state.prompt_id, state.sample_index, position)
    if state.fixed_lengths:  # EOS withheld before the target length, forced at it
        token, logprob = sample_to_length(
            state.next_logits, keys, sampling, state.target_len, position, state.eos_ids
        )
    else:
        token, logprob = sample_tokens(state.next_logits, keys, sampling)
    rows = jnp.arange(token.shape[0])
    write_at = jnp.where(running, position, state.response_capacity)  # out of range: dropped
    num_generated = position + running.astype(jnp.int32)
    is_eos = jnp.isin(token, jnp.asarray(state.eos_ids, jnp.int32))
    just_done = running & (is_eos | (num_generated >= state.response_capacity))
    feed = running & ~just_done

    def forward(carry):
        _, next_logits, cache = carry
        fed = feed.astype(jnp.int32)
        logits, cache = _apply(cfg, params, token[:, None], cache, fed, kv_width)
        next_logits = jnp.where(feed[:, None], logits[:, 0].astype(jnp.float32), next_logits)
        return jnp.asarray(False), next_logits, cache

    # Once every slot is done the forward pass is wasted work; skip it. A loop run once or
    # never, not lax.cond: XLA:GPU copied the whole cache into and out of the conditional's
    # branches at every step, where it updates a loop's carry in place.
    _, next_logits, cache = jax.lax.while_loop(
        lambda carry: carry[0], forward, (jnp.any(feed), state.next_logits, state.cache)
    )
    return state.replace(
        cache=cache,
        next_logits=next_logits,
        tokens=state.tokens.at[rows, write_at].set(token, mode="drop"),
        logprobs=state.logprobs.at[rows, write_at].set(logprob, mode="drop"),
        num_generated=num_generated,
        finished=state.finished | just_done,
        finish_step=jnp.where(just_done, state.step + 1, state.finish_step),
        step=state.step + 1,
    )


@flax.struct.dataclass
class ChunkTokens:
    """The response tokens one decode chunk produced, left-aligned per slot (for the scorers).

    Example: a slot that had 5 response tokens and made 3 more in a chunk of C = 4 has
    start 5, count 3 and tokens [t5, t6, t7, pad].
    """

    tokens: Int[Array, "S C"]  # new response tokens; pad past count
    start: Int[Array, " S"]  # response index of tokens[:, 0]
    count: Int[Array, " S"]  # valid new tokens per slot (0 once a slot has finished)
    ready: Bool[Array, ""]  # the rollout can be cut (see CutRule) at the end of this chunk
    # for slot compaction: which slots had finished at the end of the chunk, and how many
    # had not (-1 once ``ready``: the host's one read per chunk then says both)
    finished: Bool[Array, " S"] | None = None
    running: Int[Array, ""] | None = None


@flax.struct.dataclass
class CutRule:
    """When a rollout may stop: ``target`` groups complete (every active member finished),
    and every must-finish slot finished. Without ``group`` each slot is its own group. The
    host may hand its NumPy arrays in as they are: the jitted decode transfers them to its
    own shardings (a single-device array would be resliced over a mesh by a small program)."""

    active: Bool[ArrayLike, " S"]  # slots holding a sequence this step
    must_finish: Bool[ArrayLike, " S"]  # slots whose sequence may not be carried again
    target: Int[ArrayLike, ""]  # B / G, groups the step needs
    group: Int[ArrayLike, " S"] | None = None  # each slot's group id, in [0, S)

    def ready(self, finished: Bool[Array, " S"]) -> Bool[Array, ""]:
        if self.group is None:
            enough = jnp.sum(finished & self.active) >= self.target
        else:
            slots = finished.shape[0]
            count = lambda x: jax.ops.segment_sum(x.astype(jnp.int32), self.group, slots)  # noqa: E731
            running, members = count(self.active & ~finished), count(self.active)
            enough = jnp.sum((members > 0) & (running == 0)) >= self.target
        return enough & ~jnp.any(self.must_finish & ~finished)


def decode_chunk(
    cfg: ModelConfig,
    sampling: SamplingConfig,
    chunk_size: int,
    params,
    state: DecodeState,
    rule: CutRule,
    mesh: Mesh | None = None,
    kv_width: int | None = None,
) -> tuple[DecodeState, ChunkTokens]:
    """Up to ``chunk_size`` lockstep decode steps that stop as soon as ``rule`` holds, with
    the chunk's new tokens as fresh (undonated) arrays and whether the rollout may stop.
    Attention reads the first ``kv_width`` cache columns (static; None: all): the caller
    guarantees every slot's context stays below it through the chunk (``live_width``).

    Stopping at the cut position wastes no decode step past it: steps after the cut would
    only make tokens the carry throws away. The chunk the host dispatches before it reads
    that the rule holds therefore runs no step at all. Every token up to the cut is the same
    as with whole chunks, so results do not depend on the chunk size.
    """
    start = state.num_generated

    def going(carry):
        i, s = carry
        return (i < chunk_size) & ~rule.ready(s.finished)

    def step(carry):
        i, s = carry
        return i + 1, constrain_slots(decode_step(cfg, sampling, params, s, kv_width), mesh)

    _, state = jax.lax.while_loop(going, step, (jnp.int32(0), constrain_slots(state, mesh)))
    chunk = tokens_since(state, start, chunk_size, rule.ready(state.finished))
    ready = chunk.ready
    running = jnp.where(ready, -1, jnp.sum(~state.finished)).astype(jnp.int32)
    chunk = chunk.replace(finished=state.finished | False, running=running)  # state: donated
    return state, constrain_slots(chunk, mesh)


def tokens_since(
    state: DecodeState, start: Int[Array, " S"], width: int, ready: Bool[Array, ""]
) -> ChunkTokens:
    """The response tokens each slot made from index ``start[s]`` on, left-aligned in ``width``
    columns (pad past the count): what a scorer is fed after a chunk, or after the rollout.

    Example: tokens [[7, 8, 9, pad]], num_generated [3], start [1], width 2 -> [[8, 9]], count 2.
    """
    offsets = jnp.arange(width)[None, :]
    cols = jnp.clip(start[:, None] + offsets, 0, state.response_capacity - 1)
    count = state.num_generated - start
    tokens = jnp.take_along_axis(state.tokens, cols, axis=1)
    tokens = jnp.where(offsets < count[:, None], tokens, state.pad_id)
    return ChunkTokens(tokens, start, count, ready)
