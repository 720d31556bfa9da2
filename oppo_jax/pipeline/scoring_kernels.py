"""Compiled kernels of scoring at real widths and of the frozen scorers' kept caches (one jit
per static setting, like ``pipeline.kernels``), and the host side of the packed scoring of a
batch, dispatched through ``pipeline.step_scorers.StepScorers``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.base.shapes import chunk_budget
from oppo_jax.parallel.sharding import to_host
from oppo_jax.pipeline.kernels import family_jit
from oppo_jax.pipeline.placement import move
from oppo_jax.rollout.layout import assemble_sequences
from oppo_jax.scoring.kept import KeptCaches, put_rows, take_rows
from oppo_jax.scoring.packed import PackedBatch, ScoringCall, plan_packing, score_packed
from oppo_jax.scoring.packed_chunks import padding_plan
from oppo_jax.scoring.stream import ScorerSpec


@functools.cache
def make_packed_scorer(spec: ScorerSpec, pad_id: int, num_slots: int):
    """(params, outputs over the ``num_slots`` slots (donated), PackedBatch of one call, batch
    rows' slots [B]) -> (the outputs with this call's sequences written at their slots, a
    fresh marker). One program per scorer: every call has the one packed shape."""

    def run(params, out, batch: PackedBatch, slots):
        scored = score_packed(spec, params, batch, pad_id)
        rows = batch.seq.shape[0]
        at = jnp.where(batch.row < rows, slots, num_slots)  # other calls' sequences: dropped
        out = out.at[at].set(scored, mode="drop")
        return out, jnp.sum(scored)

    return family_jit("sync scoring", run, spec.mesh, donate_argnums=(1,))


def empty_outputs(spec: ScorerSpec, num_slots: int, sharding):
    """The zero outputs a scorer's packed calls write into: [S, R], or [S] for a score (host
    zeros moved over: no program compiles for them)."""
    shape = (num_slots,) if spec.kind == "score" else (num_slots, spec.response_len)
    return jax.device_put(np.zeros(shape, np.float32), sharding)


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


def batch_sequences(kernels, place, decoding, rows: np.ndarray, slots):
    """(sequences [B, P + R], response lengths [B]) of the batch ``rows`` (``slots``: the
    step's ``SlotBatch``), replicated where the scorers run."""
    prompts = np.asarray(slots.context[:, : kernels.rollout.prompt_width])
    made = make_batch_sequences(kernels.rollout.pad_id)(decoding, rows, prompts, slots.prompt_len)
    return move(made, _replicated(place))


def packed_inputs(sequences, response_len, prompt_len, plan: ScoringCall) -> PackedBatch:
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
    """Every scorer's output over the batch ``rows``, their real tokens packed into calls of
    one shape (``scoring.packed``); dispatched through ``scorers``
    (pipeline.step_scorers.StepScorers). Returns (role -> [S, R] or [S] output, tokens
    computed per scorer, real tokens per scorer)."""
    k, place = scorers.kernels, scorers.place
    r = k.rollout
    rows = np.asarray(rows, np.int32)
    prompt_len = slots.prompt_len[rows]
    lengths = prompt_len + to_host(decoding.num_generated)[rows]  # the cut's only extra read
    plans = plan_packing(lengths, r.prompt_width + r.max_response_len)
    on_scoring = _replicated(place)
    sequences, response_len = batch_sequences(k, place, decoding, rows, slots)
    batches = [packed_inputs(sequences, response_len, prompt_len, plan) for plan in plans]
    at = jax.device_put(rows, on_scoring)
    out = {}
    for role in scorers.roles:
        spec = getattr(k.scorer_specs, role)
        k.planned("sync scoring", ("packed",), role)
        kernel = make_packed_scorer(spec, r.pad_id, slots.num_slots)
        out[role] = empty_outputs(spec, slots.num_slots, on_scoring)
        for batch in batches:
            out[role] = scorers.dispatch("score", role, kernel, out[role], batch, at)
    computed = sum(plan.computed_tokens for plan in plans)
    return out, computed, sum(plan.real_tokens for plan in plans)


def compile_packed_chunks(kernels, role: str, params, state, chunk, kv_width: int | None):
    """Run ``role``'s packed chunk kernel at its one shape for a chunk like ``chunk``
    (``shapes.chunk_budget``), reading ``kv_width`` columns, on a plan that packs no
    token: what a warm-up compiles. Returns the state (donated along, unchanged)."""
    slots, width = chunk.tokens.shape
    kernel = kernels.scorer_chunk(role, kv_width)
    state, _ = kernel(params, state, chunk, padding_plan(chunk_budget(slots, width), slots))
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
