"""Prefill and chunked decoding: ``decode_chunk`` advances every slot by C tokens in a lax.scan.

Dimension letters: S slots, P prompt width, R response capacity (max response length), V vocab.
All slots decode in lockstep; a slot that has finished (EOS, max length, or empty) is frozen:
it samples nothing, writes nothing and its cache length stops advancing.

With a ``mesh``, the kernels lay the per-slot state out along the slot axis over the batch
axes, and the cache's kv-heads over tensor (``oppo_jax.sharding.slot_shardings``), so each
device holds 1/(data x fsdp) of the slots; the parameters arrive with their own shardings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from oppo_jax.models.kv_cache import KVCache, init_cache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer
from oppo_jax.rollout.layout import gather_response, response_tokens
from oppo_jax.rollout.sampling import SamplingConfig, sample_tokens, token_keys
from oppo_jax.sharding import constrain_slots


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
    eos_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=(1,))
    pad_id: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def response_capacity(self) -> int:
        return self.tokens.shape[1]


def _apply(cfg: ModelConfig, params, tokens, cache, n_valid=None):
    return Transformer(cfg).apply({"params": params}, tokens, cache, n_valid)


def prefill(
    cfg: ModelConfig,
    params,
    cache: KVCache,
    tokens: Int[Array, "S T"],
    n_valid: Int[Array, " S"],
) -> tuple[Float[Array, "S T O"], KVCache]:
    """Append ``n_valid[s]`` tokens of each right-padded row to the cache; return head outputs.

    Any split of a sequence into successive prefills gives the same outputs as one call.
    """
    out, cache = _apply(cfg, params, tokens, cache, n_valid)
    return out.astype(jnp.float32), cache


def start_decode(
    cfg: ModelConfig,
    params,
    prompts: Int[Array, "S P"],
    prompt_lens: Int[Array, " S"],
    prompt_id: Int[Array, " S"],
    sample_index: Int[Array, " S"],
    base_key: jax.Array,
    max_response_len: int,
    eos_ids: tuple[int, ...],
    pad_id: int = 0,
    active: Bool[Array, " S"] | None = None,
) -> DecodeState:
    """Prefill the prompts into a fresh cache and set up the state for ``decode_chunk``.

    ``active[s]`` False marks an empty slot: it starts finished and never samples. This is
    ``admit_decode`` with no carried prefixes.
    """
    num_slots, width = prompts.shape
    none = jnp.zeros((num_slots,), jnp.int32)
    return admit_decode(
        cfg, params, prompts, prompt_lens, none, none.astype(bool), prompt_id, sample_index,
        base_key, jnp.ones((num_slots,), bool) if active is None else active,
        prompt_width=width, max_response_len=max_response_len, eos_ids=eos_ids, pad_id=pad_id,
        temperature=1.0, carried_rows=0,
    )  # fmt: skip


PrefixFn = Callable[[Float[Array, "S R O"], Int[Array, "S R"]], Float[Array, "S R"]]


def _prefill_rows(
    cfg, params, context, prompt_lens, prefix_len, capacity, response_len, prefix_fn, mesh=None
):
    """Prefill rows into a fresh cache: (cache, output at the last context token, prefix
    quantities [rows, R], zero past each prefix; all zero when ``prefix_fn`` is None)."""
    # Born sharded along the slots: a replicated [L, S, P + R, K, Dh] buffer would not fit.
    cache = constrain_slots(init_cache(cfg, context.shape[0], capacity), mesh)
    context_len = prompt_lens + prefix_len
    out, cache = prefill(cfg, params, cache, context, context_len)
    last = jnp.maximum(context_len - 1, 0)
    last_out = jnp.take_along_axis(out, last[:, None, None], axis=1)[:, 0]
    if prefix_fn is None:
        return cache, last_out, jnp.zeros((context.shape[0], response_len), jnp.float32)
    before = gather_response(out, prompt_lens, response_len)
    prefix = response_tokens(context, prompt_lens, response_len)
    in_prefix = jnp.arange(response_len)[None, :] < prefix_len[:, None]
    return cache, last_out, jnp.where(in_prefix, prefix_fn(before, prefix), 0.0)


def admission_prefill(
    cfg: ModelConfig,
    params,
    context: Int[Array, "S W"],
    prompt_lens: Int[Array, " S"],
    prefix_len: Int[Array, " S"],
    prefix_fn: PrefixFn,
    *,
    prompt_width: int,
    response_len: int,
    carried_rows: int | None = None,
    mesh: Mesh | None = None,
) -> tuple[KVCache, Float[Array, "S O"], Float[Array, "S R"]]:
    """Prefill each slot's context (prompt + carried prefix) into a cache of P + R per slot.

    The first ``carried_rows`` slots (all when None) are prefilled at the full width W and
    yield ``prefix_fn`` of their outputs; the rest, which must carry no prefix, only at the
    prompt width P, and yield zeros. Prefill cost is then about K·W + (S − K)·P tokens, not
    S·W, and the [rows, W, O] outputs exist for the carried rows only.

    Returns (cache, head output at each slot's last context token, prefix quantities [S, R]),
    laid out along the slots over ``mesh`` when one is given.
    """
    slots = context.shape[0]
    k = slots if carried_rows is None else min(carried_rows, slots)
    prefill_rows = functools.partial(
        _prefill_rows, cfg, params, capacity=prompt_width + response_len,
        response_len=response_len, mesh=mesh,
    )  # fmt: skip
    if k == slots:
        return constrain_slots(
            prefill_rows(context, prompt_lens, prefix_len, prefix_fn=prefix_fn), mesh
        )
    fresh = prefill_rows(
        context[k:, :prompt_width], prompt_lens[k:], jnp.zeros_like(prefix_len[k:]), prefix_fn=None
    )
    if k == 0:
        return constrain_slots(fresh, mesh)
    carried = prefill_rows(context[:k], prompt_lens[:k], prefix_len[:k], prefix_fn=prefix_fn)
    # Caches share the capacity P + R, so the two parts stack along the slot axis.
    cache = KVCache(
        k=jnp.concatenate([carried[0].k, fresh[0].k], axis=1),
        v=jnp.concatenate([carried[0].v, fresh[0].v], axis=1),
        length=jnp.concatenate([carried[0].length, fresh[0].length]),
    )
    rest = (jnp.concatenate([a, b]) for a, b in zip(carried[1:], fresh[1:], strict=True))
    return constrain_slots((cache, *rest), mesh)


def admit_decode(
    cfg: ModelConfig,
    params,
    context: Int[Array, "S W"],
    prompt_lens: Int[Array, " S"],
    prefix_len: Int[Array, " S"],
    prefix_finished: Bool[Array, " S"],
    prompt_id: Int[Array, " S"],
    sample_index: Int[Array, " S"],
    base_key: jax.Array,
    active: Bool[Array, " S"],
    *,
    prompt_width: int,
    max_response_len: int,
    eos_ids: tuple[int, ...],
    pad_id: int,
    temperature: float,
    carried_rows: int | None = None,
    mesh: Mesh | None = None,
) -> DecodeState:
    """Admit slots that may carry a partial response (prompt + prefix in ``context``).

    The whole context is prefilled under the current parameters, which rebuilds the actor's
    cache and also yields the current policy's log-probs of the prefix tokens (stored in
    ``logprobs``: the "old" log-probs of this step). Decoding then continues at each slot's
    response position ``prefix_len[s]``, with the same sampling keys it would have used had
    it never been interrupted. ``prefix_finished`` slots are complete already. Only the first
    ``carried_rows`` slots may carry a prefix (see ``admission_prefill``; None: any slot).
    With a ``mesh`` the state comes out sharded along the slots (see the module docstring).
    """

    def prefix_logp(logits, prefix):
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        return jnp.take_along_axis(logp, prefix[..., None], axis=-1)[..., 0]

    cache, next_logits, logprobs = admission_prefill(
        cfg, params, context, prompt_lens, prefix_len, prefix_logp, prompt_width=prompt_width,
        response_len=max_response_len, carried_rows=carried_rows, mesh=mesh,
    )  # fmt: skip
    prefix = response_tokens(context, prompt_lens, max_response_len)
    in_prefix = jnp.arange(max_response_len)[None, :] < prefix_len[:, None]
    finished = ~active | prefix_finished
    state = DecodeState(
        cache=cache,
        next_logits=next_logits,
        tokens=jnp.where(in_prefix, prefix, pad_id).astype(jnp.int32),
        logprobs=logprobs,
        num_generated=prefix_len.astype(jnp.int32),
        finished=finished,
        finish_step=jnp.where(finished, 0, -1).astype(jnp.int32),
        prompt_id=prompt_id.astype(jnp.int32),
        sample_index=sample_index.astype(jnp.int32),
        step=jnp.zeros((), jnp.int32),
        base_key=base_key,
        eos_ids=tuple(eos_ids),
        pad_id=pad_id,
    )
    return constrain_slots(state, mesh)


def decode_step(cfg: ModelConfig, sampling: SamplingConfig, params, state: DecodeState):
    """Sample one token for every running slot, record it, and feed it to the model."""
    running = ~state.finished
    position = state.num_generated
    keys = token_keys(state.base_key, state.prompt_id, state.sample_index, position)
    token, logprob = sample_tokens(state.next_logits, keys, sampling)
    rows = jnp.arange(token.shape[0])
    write_at = jnp.where(running, position, state.response_capacity)  # out of range: dropped
    num_generated = position + running.astype(jnp.int32)
    is_eos = jnp.isin(token, jnp.asarray(state.eos_ids, jnp.int32))
    just_done = running & (is_eos | (num_generated >= state.response_capacity))
    feed = running & ~just_done

    def forward(_):
        logits, cache = _apply(cfg, params, token[:, None], state.cache, feed.astype(jnp.int32))
        return jnp.where(feed[:, None], logits[:, 0].astype(jnp.float32), state.next_logits), cache

    # Once every slot is done the forward pass is wasted work; skip it.
    next_logits, cache = jax.lax.cond(
        jnp.any(feed), forward, lambda _: (state.next_logits, state.cache), None
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


@flax.struct.dataclass
class CutRule:
    """When a rollout may stop: ``target`` active slots finished, and every must-finish one."""

    active: Bool[Array, " S"]  # slots holding a sequence this step
    must_finish: Bool[Array, " S"]  # slots whose sequence may not be carried again
    target: Int[Array, ""]  # B, sequences the step needs

    def ready(self, finished: Bool[Array, " S"]) -> Bool[Array, ""]:
        enough = jnp.sum(finished & self.active) >= self.target
        return enough & ~jnp.any(self.must_finish & ~finished)


def decode_chunk_emit(
    cfg: ModelConfig,
    sampling: SamplingConfig,
    chunk_size: int,
    params,
    state: DecodeState,
    rule: CutRule,
    mesh: Mesh | None = None,
) -> tuple[DecodeState, ChunkTokens]:
    """``decode_chunk`` that also returns the chunk's new tokens as fresh (undonated) arrays,
    and whether ``rule`` allows the rollout to stop after this chunk."""
    start = state.num_generated
    state = decode_chunk(cfg, sampling, chunk_size, params, state, mesh)
    offsets = jnp.arange(chunk_size)[None, :]
    cols = jnp.clip(start[:, None] + offsets, 0, state.response_capacity - 1)
    count = state.num_generated - start
    tokens = jnp.take_along_axis(state.tokens, cols, axis=1)
    tokens = jnp.where(offsets < count[:, None], tokens, state.pad_id)
    chunk = ChunkTokens(tokens, start, count, rule.ready(state.finished))
    return state, constrain_slots(chunk, mesh)


def decode_chunk(
    cfg: ModelConfig,
    sampling: SamplingConfig,
    chunk_size: int,
    params,
    state: DecodeState,
    mesh: Mesh | None = None,
) -> DecodeState:
    """Advance every slot by ``chunk_size`` lockstep decode steps (a ``lax.scan``); with a
    ``mesh``, the state stays sharded along the slots at every step."""

    def body(carry, _):
        return constrain_slots(decode_step(cfg, sampling, params, carry), mesh), None

    state, _ = jax.lax.scan(body, constrain_slots(state, mesh), None, length=chunk_size)
    return state


@functools.cache
def make_decode_chunk(
    cfg: ModelConfig, sampling: SamplingConfig, chunk_size: int, mesh: Mesh | None = None
):
    """``decode_chunk`` jitted for one (model, sampling, C, mesh), donating the state it
    replaces. Cached, so every caller with the same static settings shares one kernel.
    """
    fn = functools.partial(decode_chunk, cfg, sampling, chunk_size, mesh=mesh)
    return jax.jit(fn, donate_argnums=(1,))


@functools.cache
def make_decode_chunk_emit(
    cfg: ModelConfig, sampling: SamplingConfig, chunk_size: int, mesh: Mesh | None = None
):
    """``decode_chunk_emit`` jitted for one (model, sampling, C, mesh), donating the state."""
    fn = functools.partial(decode_chunk_emit, cfg, sampling, chunk_size, mesh=mesh)
    return jax.jit(fn, donate_argnums=(1,))


@functools.cache
def make_start_decode(cfg: ModelConfig, max_response_len: int, eos_ids, pad_id: int = 0):
    """``start_decode`` jitted for one model and response capacity."""
    fn = functools.partial(
        start_decode, cfg, max_response_len=max_response_len, eos_ids=tuple(eos_ids), pad_id=pad_id
    )
    return jax.jit(fn)
