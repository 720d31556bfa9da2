"""Admission: what enters a step's slots, and the prefill that starts a rollout from it.

A slot holds a new prompt, or a carried sequence (prompt + the response it had when its last
step was cut). Carried slots come first, so only a leading bucket of ``carried_rows`` slots
needs the full context width W; the rest are prefilled at the prompt width P. Dimension
letters: S slots, W context width (P + room for carried prefixes), R response capacity,
O head outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from oppo_jax.models.heads import gather_rows
from oppo_jax.models.kv_cache import KVCache, init_cache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer
from oppo_jax.rollout.layout import gather_response, response_tokens
from oppo_jax.rollout.prefill_chunks import chunked_prefill, prefill_chunk
from oppo_jax.sharding import batch_shards, constrain_slots


@flax.struct.dataclass
class Admission:
    """The device-side inputs of one step's slots, in admission order (carried first)."""

    context: Int[Array, "S W"]  # prompt then carried response prefix, right-padded
    prompt_len: Int[Array, " S"]
    prefix_len: Int[Array, " S"]  # response tokens carried in (0 for new prompts)
    prefix_finished: Bool[Array, " S"]  # carried in already complete
    prefix_behaviour: Float[Array, "S R"]  # log-probs recorded when the prefix was sampled
    prompt_id: Int[Array, " S"]  # the prompt's id (its sampling key depends on it)
    sample_index: Int[Array, " S"]  # which of the prompt's samples this is
    active: Bool[Array, " S"]  # the slot holds a sequence
    must_finish: Bool[Array, " S"]  # the sequence may not be carried again
    # Leading slots that may carry a prefix, prefilled at the full width W (a static bucket);
    # None: any slot may (all prefilled at W).
    carried_rows: int | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def num_slots(self) -> int:
        return self.prompt_len.shape[0]

    @property
    def context_len(self) -> Int[Array, " S"]:
        return self.prompt_len + self.prefix_len

    @classmethod
    def fresh(
        cls,
        prompts: Int[Array, "S P"],
        prompt_len: Int[Array, " S"],
        response_len: int,
        prompt_id: Int[Array, " S"] | None = None,
        active: Bool[Array, " S"] | None = None,
    ) -> Admission:
        """New prompts only (no carried prefixes); ``prompt_id`` defaults to the slot index."""
        s = prompts.shape[0]
        zeros = jnp.zeros((s,), jnp.int32)
        return cls(
            context=jnp.asarray(prompts, jnp.int32),
            prompt_len=jnp.asarray(prompt_len, jnp.int32),
            prefix_len=zeros,
            prefix_finished=zeros.astype(bool),
            prefix_behaviour=jnp.zeros((s, response_len), jnp.float32),
            prompt_id=jnp.arange(s, dtype=jnp.int32) if prompt_id is None else prompt_id,
            sample_index=zeros,
            active=jnp.ones((s,), bool) if active is None else jnp.asarray(active, bool),
            must_finish=zeros.astype(bool),
            carried_rows=0,
        )


# prefix_fn(hidden states before each prefix token [rows, R, D], prefix tokens [rows, R])
#   -> the consumer's quantity per prefix token [rows, R] (a log-prob, a value)
PrefixFn = Callable[[Float[Array, "S R D"], Int[Array, "S R"]], Float[Array, "S R"]]


def prefill_hidden(
    cfg: ModelConfig, params, cache: KVCache, tokens: Int[Array, "S T"], n_valid: Int[Array, " S"]
) -> tuple[Float[Array, "S T D"], KVCache]:
    """Append ``n_valid[s]`` tokens of each right-padded row to the cache; return the final
    hidden states (heads are applied only where a value is needed: ``models.heads``).

    Any split of a sequence into successive prefills gives the same outputs as one call.
    """
    apply = Transformer(cfg).apply
    return apply({"params": params}, tokens, cache, n_valid, return_hidden=True)


def prefill(
    cfg: ModelConfig, params, cache: KVCache, tokens: Int[Array, "S T"], n_valid: Int[Array, " S"]
) -> tuple[Float[Array, "S T O"], KVCache]:
    """``prefill_hidden`` with the head applied at every position (float32): for tests and
    small models; the kernels never build this [S, T, V] tensor."""
    out, cache = Transformer(cfg).apply({"params": params}, tokens, cache, n_valid)
    return out.astype(jnp.float32), cache


def _feed(cfg, params, cache, tokens, n_valid, keep_rows, mesh, filled=0):
    """Append rows' tokens to ``cache`` in one call, or in sequence chunks when rows per device
    x width exceed the budget: (hidden state at each row's last valid token, every hidden
    state of the first ``keep_rows`` rows or None, cache)."""
    chunk = prefill_chunk(_rows_per_device(tokens.shape[0], mesh), tokens.shape[1])
    if chunk < tokens.shape[1]:  # one chunk's activations at a time
        return chunked_prefill(cfg, params, cache, tokens, n_valid, chunk, keep_rows, mesh, filled)
    hidden, cache = prefill_hidden(cfg, params, cache, tokens, n_valid)
    last = gather_rows(hidden, jnp.maximum(n_valid - 1, 0)[:, None])[:, 0]
    return last, hidden[:keep_rows] if keep_rows else None, cache


def _prefix_quantities(hidden, context, context_len, prefix_len, prefix_fn, response_len):
    """``prefix_fn`` at each carried prefix token [rows, R] from the rows' hidden states
    [rows, W, D], zero past each prefix."""
    prompt_len = context_len - prefix_len
    before = gather_response(hidden, prompt_len, response_len)
    prefix = response_tokens(context, prompt_len, response_len)
    in_prefix = jnp.arange(response_len)[None, :] < prefix_len[:, None]
    return jnp.where(in_prefix, prefix_fn(before, prefix), 0.0)


def _prefill_rows(cfg, params, context, context_len, prefix_len, prefix_fn, rows_spec):
    """Prefill rows into a fresh cache: (cache, hidden state at the last context token,
    prefix quantities [rows, R], zero past each prefix; all zero when ``prefix_fn`` is None)."""
    capacity, response_len, mesh = rows_spec
    rows = context.shape[0]
    # Born sharded along the slots: a replicated [L, S, K, P + R, Dh] buffer would not fit.
    cache = constrain_slots(init_cache(cfg, rows, capacity), mesh)
    keep = rows if prefix_fn is not None else 0  # heads read hidden states along the rows
    last_hidden, hidden, cache = _feed(cfg, params, cache, context, context_len, keep, mesh)
    if prefix_fn is None:
        return cache, last_hidden, jnp.zeros((rows, response_len), jnp.float32)
    c = (context, context_len, prefix_len)
    return cache, last_hidden, _prefix_quantities(hidden, *c, prefix_fn, response_len)


def _carried_tail(cfg, params, head, a: Admission, k: int, prefix_fn, shape, mesh):
    """Continue the first ``k`` (carried) rows past the prompt width P into ``head`` = (cache,
    last hidden states, the k rows' hidden states over the first P columns), written back in
    place; returns (cache, last hidden states [S, D], the k rows' prefix quantities [k, R])."""
    (cache, last_hidden, head_hidden), (prompt_width, response_len) = head, shape
    rows = KVCache(k=cache.k[:, :k], v=cache.v[:, :k], length=cache.length[:k])
    tail_len = a.context_len[:k] - rows.length
    keep = k if prefix_fn is not None else 0
    tail_last, tail_hidden, rows = _feed(
        cfg, params, rows, a.context[:k, prompt_width:], tail_len, keep, mesh, prompt_width
    )
    # A k-row update of the whole cache's buffers: written in place, never a second cache.
    cache = KVCache(
        k=cache.k.at[:, :k].set(rows.k),
        v=cache.v.at[:, :k].set(rows.v),
        length=cache.length.at[:k].set(rows.length),
    )
    last_k = jnp.where((tail_len > 0)[:, None], tail_last, last_hidden[:k])
    last_hidden = last_hidden.at[:k].set(last_k)
    if prefix_fn is None:
        return cache, last_hidden, jnp.zeros((k, response_len), jnp.float32)
    hidden = jnp.concatenate([head_hidden, tail_hidden], axis=1)  # [k, W, D]
    c = (a.context[:k], a.context_len[:k], a.prefix_len[:k])
    return cache, last_hidden, _prefix_quantities(hidden, *c, prefix_fn, response_len)


def admission_prefill(
    cfg: ModelConfig,
    params,
    admission: Admission,
    prefix_fn: PrefixFn | None,
    shape: tuple[int, int],
    mesh: Mesh | None = None,
) -> tuple[KVCache, Float[Array, "S D"], Float[Array, "S R"]]:
    """Prefill each slot's context (prompt + carried prefix) into a cache of P + R per slot.

    ``shape`` is (P, R). The first ``admission.carried_rows`` slots (all when None) are
    prefilled at the full width W and yield ``prefix_fn`` of their hidden states (zeros when
    ``prefix_fn`` is None: a consumer that needs no per-token quantity); the rest, which
    carry no prefix, only at the prompt width P, and yield zeros: every slot's first P columns
    go into the one cache, then the carried rows continue from column P (on a mesh that splits
    the slots, the two parts are prefilled apart and concatenated). Prefill cost is then
    about K·W + (S − K)·P tokens, not S·W, and no head runs over a whole row. Each call runs
    in sequence chunks when its rows per device times its width exceed
    ``prefill_chunks.PREFILL_TOKEN_BUDGET``, so its activations are one chunk's.

    Returns (cache, hidden state at each slot's last context token [S, D], prefix quantities
    [S, R]), laid out along the slots over ``mesh`` when one is given.
    """
    prompt_width, response_len = shape
    a, slots = admission, admission.num_slots
    k = slots if a.carried_rows is None else min(a.carried_rows, slots)
    capacity = prompt_width + response_len
    rows_spec = (capacity, response_len, mesh)
    if k == slots:
        every = (a.context, a.context_len, a.prefix_len, prefix_fn)
        return constrain_slots(_prefill_rows(cfg, params, *every, rows_spec), mesh)
    if k and mesh is not None and batch_shards(mesh) > 1:
        # Slots split over devices: the leading k rows sit on the first devices, and an
        # in-place k-row write makes the partitioner gather the cache (7B on 4 devices: 28.8
        # instead of 14.5 GiB of CPU temporaries), so the two parts are concatenated.
        return constrain_slots(_two_parts(cfg, params, a, k, prefix_fn, rows_spec), mesh)
    # Every slot's first P columns into one cache of all S slots; then only the carried rows
    # go on from column P. One cache buffer: two caches concatenated would hold a second one.
    cache = constrain_slots(init_cache(cfg, slots, capacity), mesh)
    head_len = jnp.minimum(a.context_len, prompt_width)
    keep = k if prefix_fn is not None else 0
    last_hidden, head_hidden, cache = _feed(
        cfg, params, cache, a.context[:, :prompt_width], head_len, keep, mesh
    )
    quantities = jnp.zeros((slots, response_len), jnp.float32)
    if k == 0 or a.context.shape[1] == prompt_width:  # nothing is carried past P
        return constrain_slots((cache, last_hidden, quantities), mesh)
    head = (cache, last_hidden, head_hidden)
    cache, last_hidden, carried = _carried_tail(cfg, params, head, a, k, prefix_fn, shape, mesh)
    return constrain_slots((cache, last_hidden, quantities.at[:k].set(carried)), mesh)


def _two_parts(cfg, params, a: Admission, k: int, prefix_fn, rows_spec):
    """The carried rows at the full width and the fresh ones at P, prefilled apart and
    concatenated along the slots (caches share the capacity P + R)."""
    prompt_width = rows_spec[0] - rows_spec[1]
    fresh = (a.context[k:, :prompt_width], a.prompt_len[k:], 0 * a.prefix_len[k:], None)
    fresh = _prefill_rows(cfg, params, *fresh, rows_spec)
    carried = (a.context[:k], a.context_len[:k], a.prefix_len[:k], prefix_fn)
    carried = _prefill_rows(cfg, params, *carried, rows_spec)
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=_slot_axis(x)), carried, fresh)


def _slot_axis(x) -> int:
    """Slot axis of an admission output: 1 for cache keys/values [L, S, ...], else 0."""
    return 1 if x.ndim == 5 else 0


def _rows_per_device(rows: int, mesh: Mesh | None) -> int:
    """Rows each device prefills: the slots split over the batch axes when they divide."""
    shards = 1 if mesh is None else batch_shards(mesh)
    return rows // shards if rows % shards == 0 else rows
