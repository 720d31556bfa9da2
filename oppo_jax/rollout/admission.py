"""Admission: what enters a step's slots, and the prefill of their prompts.

A slot holds a new prompt, or a carried sequence (prompt + the response it had when its last
step was cut). The admission prefill here writes every slot's prompt into a fresh cache of
P + R columns; a carried slot's response prefix is then replayed into that cache in chunks of
its real length (``scoring.carried``, dispatched by ``pipeline.kernels.Kernels``), so no slot costs
more than its own tokens. Dimension letters: S slots, P prompt width, R response capacity,
W = P + R context width, D model width.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from oppo_jax.models.heads import gather_rows
from oppo_jax.models.kv_cache import KVCache, init_cache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer
from oppo_jax.parallel.sharding import batch_shards, constrain_slots
from oppo_jax.rollout.prefill_chunks import chunked_prefill, prefill_chunk


@flax.struct.dataclass
class Admission:
    """The inputs of one step's slots, in admission order (carried first): device arrays, or
    the host's NumPy arrays, which the jitted programs taking them transfer to their own
    shardings (an array put on one device would be resliced over a mesh by a small program)."""

    context: Int[ArrayLike, "S W"]  # prompt then carried response prefix, right-padded
    prompt_len: Int[ArrayLike, " S"]
    prefix_len: Int[ArrayLike, " S"]  # response tokens carried in (0 for new prompts)
    prefix_finished: Bool[ArrayLike, " S"]  # carried in already complete
    prefix_behaviour: Float[ArrayLike, "S R"]  # log-probs recorded when the prefix was sampled
    prompt_id: Int[ArrayLike, " S"]  # the prompt's id (its sampling key depends on it)
    sample_index: Int[ArrayLike, " S"]  # which of the prompt's samples this is
    active: Bool[ArrayLike, " S"]  # the slot holds a sequence
    must_finish: Bool[ArrayLike, " S"]  # the sequence may not be carried again

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
        )


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


def prompt_prefill(
    cfg: ModelConfig,
    params,
    admission: Admission,
    shape: tuple[int, int],
    mesh: Mesh | None = None,
    group_size: int = 1,
) -> tuple[KVCache, Float[Array, "S D"]]:
    """Prefill each slot's prompt (its first ``prompt_len`` context tokens) into a fresh cache
    of P + R columns per slot; ``shape`` is (P, R).

    With ``group_size`` G > 1 the admission's slots hold groups: slots gG .. gG + G - 1 hold
    G samples of one prompt (``pipeline.carry.admit``). Each prompt is then prefilled once, on
    the group's first slot, and its cache and hidden state copied to the other G - 1 slots:
    1/G of the prompt FLOPs, the same result as prefilling every slot (a row's prefill does
    not depend on the other rows'). The caller decides whether slots share
    (``pipeline.carry.prompt_sharing``: G must divide S, else it passes 1); a G that does not
    divide S is refused.

    A carried prefix is not prefilled here: ``scoring.carried`` appends it afterwards. The call
    runs in sequence chunks when its rows per device times P exceed
    ``prefill_chunks.PREFILL_TOKEN_BUDGET``, so its activations are one chunk's. Returns
    (cache, hidden state at each slot's last prompt token [S, D]), laid out along the slots
    over ``mesh`` when one is given.
    """
    if group_size > 1:
        if admission.num_slots % group_size:
            raise ValueError(
                f"prompt_prefill: group_size {group_size} does not divide the "
                f"{admission.num_slots} slots (pipeline.carry.prompt_sharing passes 1 then)"
            )
        firsts = jax.tree.map(lambda x: x[::group_size], admission)  # each group's first slot
        # on the mesh too: the groups' first slots split over its batch axes where they divide
        cache, last_hidden = prompt_prefill(cfg, params, firsts, shape, mesh)
        shared = (cache, last_hidden)
        # slots are axis 1 of the cache's keys and values [L, S, ...], axis 0 elsewhere
        copy = lambda x: jnp.repeat(x, group_size, axis=1 if x.ndim == 5 else 0)  # noqa: E731
        copied = jax.tree.map(copy, shared)
        return constrain_slots(copied, mesh)
    prompt_width, response_len = shape
    slots = admission.num_slots
    # Born sharded along the slots: a replicated [L, S, K, P + R, Dh] buffer would not fit.
    cache = constrain_slots(init_cache(cfg, slots, prompt_width + response_len), mesh)
    tokens, n_valid = admission.context[:, :prompt_width], admission.prompt_len
    chunk = prefill_chunk(_rows_per_device(slots, mesh), prompt_width)
    if chunk < prompt_width:  # one chunk's activations at a time
        last_hidden, cache = chunked_prefill(cfg, params, cache, tokens, n_valid, chunk, mesh)
    else:
        hidden, cache = prefill_hidden(cfg, params, cache, tokens, n_valid)
        last_hidden = gather_rows(hidden, jnp.maximum(n_valid - 1, 0)[:, None])[:, 0]
    return constrain_slots((cache, last_hidden), mesh)


def _rows_per_device(rows: int, mesh: Mesh | None) -> int:
    """Rows each device prefills: the slots split over the batch axes when they divide."""
    shards = 1 if mesh is None else batch_shards(mesh)
    return rows // shards if rows % shards == 0 else rows
