"""Continuous refill on the device: a group's prompt prefilled once into a store, and copied
into the decode rows its samples take as other rows free up (issue 44; the host decides which
rows and when, ``pipeline.refill``).

Dimension letters: S decode rows, Q groups in a store, M rows placed by one call (a fixed
bucket; unused entries name row S and are dropped), P prompt width, R response capacity,
W = P + R, V vocab.

Exactness: a placed row holds exactly what a fresh admission of that sample would hold (the
prompt's cache row prefilled in a fresh cache of W columns, the logits of its first token, an
empty response), and a token depends only on (seed, prompt id, sample index, position)
(``rollout.sampling.token_keys``). So a sample decodes to the same tokens and log-probs
whichever row it takes and whenever it takes it, as long as the weights are the same.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from oppo_jax.models.heads import apply_head
from oppo_jax.models.kv_cache import KVCache, init_cache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel.sharding import constrain_slots
from oppo_jax.rollout.admission import Admission, prompt_prefill
from oppo_jax.rollout.decode import DecodeState
from oppo_jax.rollout.lengths import NO_TARGET, target_lengths
from oppo_jax.rollout.spec import RolloutSpec


@flax.struct.dataclass
class PromptStore:
    """Q groups' prompts, each prefilled once, waiting for their samples to take rows."""

    cache: KVCache  # [L, Q, K, W, Dh]: each prompt in a fresh row of W columns
    next_logits: Float[Array, "Q V"]  # logits of each prompt's first response token (float32)
    prompt_id: Int[Array, " Q"]


def empty_rows(cfg: ModelConfig, rollout: RolloutSpec, rows: int, base_key) -> DecodeState:
    """A decode state of ``rows`` empty rows (every row finished, holding nothing): where a
    refilling rollout starts, its first refill point placing every sample."""
    r = rollout.max_response_len
    state = DecodeState(
        cache=init_cache(cfg, rows, rollout.prompt_width + r),
        next_logits=jnp.zeros((rows, cfg.head_out), jnp.float32),
        tokens=jnp.full((rows, r), rollout.pad_id, jnp.int32),
        logprobs=jnp.zeros((rows, r), jnp.float32),
        num_generated=jnp.zeros((rows,), jnp.int32),
        finished=jnp.ones((rows,), bool),
        finish_step=jnp.zeros((rows,), jnp.int32),
        prompt_id=jnp.zeros((rows,), jnp.int32),
        sample_index=jnp.zeros((rows,), jnp.int32),
        step=jnp.zeros((), jnp.int32),
        base_key=base_key,
        target_len=jnp.full((rows,), NO_TARGET, jnp.int32),
        eos_ids=tuple(rollout.eos_ids),
        pad_id=rollout.pad_id,
        fixed_lengths=rollout.lengths is not None,
    )
    return constrain_slots(state, rollout.mesh)


def prefill_store(
    cfg: ModelConfig,
    params,
    prompts: Int[Array, "Q P"],
    prompt_len: Int[Array, " Q"],
    prompt_id: Int[Array, " Q"],
    rollout: RolloutSpec,
    rows: int | None = None,
) -> PromptStore:
    """Each of Q prompts prefilled once (``admission.prompt_prefill``, in a fresh cache of
    P + R columns per prompt), with the logits its samples' first tokens are drawn from, in
    a store of ``rows`` >= Q rows (None: Q), so that a store has one shape however many
    prompts filled it. Rows past the real prompts (prompt_len 0) are padding, never placed."""
    admission = Admission.fresh(prompts, prompt_len, rollout.max_response_len, prompt_id)
    shape = (rollout.prompt_width, rollout.max_response_len)
    cache, last_hidden = prompt_prefill(cfg, params, admission, shape, rollout.mesh)
    next_logits = apply_head(cfg, params, last_hidden).astype(jnp.float32)
    store = PromptStore(cache, next_logits, admission.prompt_id)
    extra = (rows or prompts.shape[0]) - prompts.shape[0]
    if extra <= 0:
        return store
    # the store's axis: 1 of the keys and values [L, Q, ...], 0 elsewhere
    pad = lambda x, axis: jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
    return jax.tree.map(lambda x: pad(x, 1 if x.ndim == 5 else 0), store)


def place_samples(
    state: DecodeState,
    store: PromptStore,
    rows: Int[Array, " M"],
    source: Int[Array, " M"],
    sample_index: Int[Array, " M"],
    rollout: RolloutSpec,
) -> DecodeState:
    """``state`` with sample ``sample_index[m]`` of the store's group ``source[m]`` starting
    in decode row ``rows[m]`` (a row index S places nothing: a bucket's padding).

    The row's cache becomes the store's copy of its prompt (every column: the row reads as a
    fresh admission's), its response empties and it runs from the next decode step on; its
    synthetic length, where the rollout draws lengths, is the sample's own."""
    c, s = state.cache, store.cache
    put = lambda x, new: x.at[rows].set(new, mode="drop")  # noqa: E731 (slot axis 0)
    cache = KVCache(
        k=c.k.at[:, rows].set(s.k[:, source], mode="drop"),
        v=c.v.at[:, rows].set(s.v[:, source], mode="drop"),
        length=put(c.length, s.length[source]),
    )
    prompt_id = store.prompt_id[source]
    if rollout.lengths is None:
        target = jnp.full(rows.shape, NO_TARGET, jnp.int32)
    else:
        r = rollout.max_response_len
        target = target_lengths(rollout.lengths, state.base_key, prompt_id, sample_index, r)
    m = rows.shape[0]
    placed = state.replace(
        cache=cache,
        next_logits=put(state.next_logits, store.next_logits[source]),
        tokens=put(state.tokens, jnp.full((m, state.tokens.shape[1]), state.pad_id, jnp.int32)),
        logprobs=put(state.logprobs, jnp.zeros((m, state.logprobs.shape[1]), jnp.float32)),
        num_generated=put(state.num_generated, jnp.zeros((m,), jnp.int32)),
        finished=put(state.finished, jnp.zeros((m,), bool)),
        finish_step=put(state.finish_step, jnp.full((m,), -1, jnp.int32)),
        prompt_id=put(state.prompt_id, prompt_id.astype(jnp.int32)),
        sample_index=put(state.sample_index, sample_index.astype(jnp.int32)),
        target_len=put(state.target_len, target),
    )
    return constrain_slots(placed, rollout.mesh)
