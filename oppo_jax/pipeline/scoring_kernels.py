"""Compiled kernels of scoring at real widths and of the frozen scorers' kept caches (one jit
per static setting, like ``pipeline.kernels``), and the host side that dispatches them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.pipeline.placement import move
from oppo_jax.ppo.packing import bucket_up
from oppo_jax.rollout.layout import assemble_sequences
from oppo_jax.scoring.kept import KeptCaches, put_rows, take_rows
from oppo_jax.scoring.packed import (
    MIN_WIDTH,
    PackedBatch,
    PackPlan,
    plan_packing,
    pow2_at_least,
    score_packed,
)
from oppo_jax.scoring.packed_chunks import chunk_shapes, padding_plan
from oppo_jax.scoring.stream import ScorerSpec
from oppo_jax.sharding import batch_shards, to_host, with_rules


@functools.cache
def make_packed_scorer(spec: ScorerSpec, pad_id: int, num_slots: int):
    """(params, PackedBatch, batch rows [B]) -> (the scorer's output laid out over the
    ``num_slots`` slots, zero outside the batch rows, and a fresh marker)."""

    def run(params, batch: PackedBatch, rows):
        out = score_packed(spec, params, batch, pad_id)
        slots = jnp.zeros((num_slots, *out.shape[1:]), out.dtype).at[rows].set(out)
        return slots, jnp.sum(out)

    return jax.jit(with_rules(run, spec.mesh))


@functools.cache
def make_batch_sequences(pad_id: int):
    """(decode state, batch rows [B], prompts [S, P], prompt_len [S]) -> (sequences
    [B, P + R]: prompt then the whole response, response lengths [B])."""

    def run(state, rows, prompts, prompt_len):
        response_len = state.num_generated[rows]
        seqs = assemble_sequences(
            prompts[rows], prompt_len[rows], state.tokens[rows], response_len, pad_id
        )
        return seqs, response_len

    return jax.jit(run)


def _replicated(place) -> NamedSharding:
    """Where packed scoring's inputs live: replicated over the scoring mesh (the same layout
    in a step and in a warm-up, so both hit one compilation)."""
    return NamedSharding(place.scoring_mesh, PartitionSpec())


def packed_inputs(sequences, response_len, prompt_len, plan: PackPlan) -> PackedBatch:
    """A PackedBatch from device sequences and a host plan (the plan's arrays go to the
    sequences' devices)."""
    sharding = getattr(sequences, "sharding", None)
    put = functools.partial(jax.device_put, device=sharding)
    return PackedBatch(
        sequences=sequences,
        prompt_len=put(np.asarray(prompt_len, np.int32)),
        response_len=response_len,
        seq=put(plan.seq),
        col=put(plan.col),
        row=put(plan.row),
        offset=put(plan.offset),
    )


def packed_outputs(scorers, decoding, rows: np.ndarray, slots) -> tuple[dict, int, int]:
    """Every scorer's output over the batch ``rows``, their real tokens packed; dispatched
    through ``scorers`` (pipeline.step_scorers.StepScorers). Returns (role -> [S, R] or [S] output,
    tokens computed per scorer, real tokens per scorer)."""
    k, place = scorers.kernels, scorers.place
    r = k.rollout
    rows = np.asarray(rows, np.int32)
    prompt_len = slots.prompt_len[rows]
    lengths = prompt_len + to_host(decoding.num_generated)[rows]  # the cut's only extra read
    plan = plan_packing(lengths, r.prompt_width + r.max_response_len)
    prompts = np.asarray(slots.context[:, : r.prompt_width])
    made = make_batch_sequences(r.pad_id)(decoding, rows, prompts, slots.prompt_len)
    on_scoring = _replicated(place)
    sequences, response_len = move(made, on_scoring)
    batch = packed_inputs(sequences, response_len, prompt_len, plan)
    on_scoring = jax.device_put(rows, on_scoring)
    out = {}
    for role in scorers.roles:
        kernel = make_packed_scorer(getattr(k.scorer_specs, role), r.pad_id, slots.num_slots)
        out[role] = scorers._dispatch("score", role, kernel, batch, on_scoring)
    return out, plan.computed_tokens, plan.real_tokens


def packed_shapes(batch_size: int, max_width: int) -> list[tuple[int, int]]:
    """Every (rows, width) ``plan_packing`` can pick for ``batch_size`` sequences of at most
    ``max_width`` tokens: what a warm-up compiles so that no measured step does."""
    widths = {min(pow2_at_least(n, MIN_WIDTH), max_width) for n in range(1, max_width + 1)}
    rows = {bucket_up(n) for n in range(1, batch_size + 1)}
    return [(n, w) for w in sorted(widths) for n in sorted(rows)]


def compile_packed_scoring(engine, params: dict, batch_size: int, num_slots: int, shape) -> None:
    """Run every scorer's packed kernel of ``engine`` (a StepEngine) once at ``shape`` =
    (rows, width) on padding-only inputs (``params``: role -> parameters where the scorers
    run)."""
    kernels, on_scoring = engine.kernels, _replicated(engine.placement)
    r, (rows, width) = kernels.rollout, shape
    ones = np.ones(batch_size, np.int32)
    zeros = np.zeros(batch_size, np.int32)
    seqs = np.zeros((batch_size, r.prompt_width + r.max_response_len), np.int32)
    plan = PackPlan(np.full((rows, width), -1, np.int32), np.zeros((rows, width), np.int32),
                    zeros, zeros)  # fmt: skip
    seqs, response_len = jax.device_put((seqs, ones), on_scoring)
    batch = packed_inputs(seqs, response_len, ones, plan)
    outputs = [
        make_packed_scorer(getattr(kernels.scorer_specs, role), r.pad_id, num_slots)(
            params[role], batch, jax.device_put(np.arange(batch_size, dtype=np.int32), on_scoring)
        )
        for role in kernels.scorer_specs.present()
    ]
    jax.block_until_ready(outputs)


def packs_chunks(engine) -> bool:
    """Whether ``engine``'s (a StepEngine) streaming scorers pack their chunks: switched on
    and on a scoring mesh that does not split the slots (``StepScorers.chunk_plan``)."""
    mesh = engine.kernels.scorer_specs.reference.mesh
    return engine.packed_chunk_scoring and (mesh is None or batch_shards(mesh) == 1)


def compile_packed_chunks(engine, role: str, params, state, chunk, kv_width: int | None):
    """Run ``role``'s packed chunk kernel at every packed size a chunk like ``chunk`` can take
    (``packed_chunks.chunk_shapes``), reading ``kv_width`` columns, on plans that pack no
    token: what a warm-up compiles. Returns the state (donated along, unchanged)."""
    if not packs_chunks(engine):
        return state
    slots, width = chunk.tokens.shape
    kernel = engine.kernels.scorer_chunk(role, kv_width, True)
    for shape in chunk_shapes(slots, width):
        state, _ = kernel(params, state, chunk, padding_plan(shape, slots))
    return state


@functools.cache
def _take():
    return jax.jit(take_rows)


@functools.cache
def _put():
    return jax.jit(put_rows, donate_argnums=(0,))


def keep_rows(states: dict, slots: list[int], bucket: int, ids: list) -> KeptCaches:
    """The frozen scorers' states of ``slots`` (carried rows, buffer order), gathered into a
    ``bucket``-row block (padding repeats the last row and is never used)."""
    rows = jnp.asarray(slots + [slots[-1]] * (bucket - len(slots)), jnp.int32)
    return KeptCaches({role: _take()(s, rows) for role, s in states.items()}, ids)


def restore_rows(state, kept_state, used: int):
    """``state`` (donated) with its first ``used`` slots taken from the kept block."""
    use = np.arange(kept_state.num_fed.shape[0]) < used  # host flags: no eager device ops
    return _put()(state, kept_state, use)
