"""Scoring at real widths after the rollout (non-streaming schedules): the batch's sequences
packed into rows with segment ids, one cache-less forward per scorer and call.

Without streaming, the scorers only need the B sequences the update takes, each scored once
when it enters a batch (a carried sequence is scored whole in the step that takes it; nothing
is computed for it while it waits). Their real tokens (prompt + response) are packed end to
end into rows of T = L columns (first-fit decreasing, ``shapes.score_calls``), and the rows are
dealt N at a time to calls of one shape [N, T] (``shapes.score_rows_per_call``), looped from
the host: one compiled program per scorer whatever the lengths, and the forward costs about
the real tokens, not [S, P + R] (only the last call's unused rows are padding).
A token attends only within its own sequence (segment ids) and its RoPE position restarts per
sequence, so every quantity equals that of the sequence's own forward (up to float rounding):

    logprob (reference):  log softmax(head(h[j]) / temperature)[token j + 1]
    value   (critic):     head(h[j])[0]            both at the position before a response token
    score   (reward):     head(h)[0] at the sequence's last token

Dimension letters: B sequences, L sequence width (P + R), N packed rows, T packed width.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from oppo_jax.base.shapes import score_calls, score_rows_per_call, score_width
from oppo_jax.models.heads import logprobs_at, scores_at
from oppo_jax.models.transformer import Transformer
from oppo_jax.scoring.stream import ScorerSpec


@dataclasses.dataclass(frozen=True)
class ScoringCall:
    """One packed scoring call: where its sequences' tokens go in its rows (host NumPy, from
    lengths only). Sequences of other calls have ``row`` N (their outputs are dropped)."""

    seq: np.ndarray  # [N, T] sequence of each packed token; -1 for padding
    col: np.ndarray  # [N, T] its index within the sequence (its RoPE position); 0 for padding
    row: np.ndarray  # [B] packed row of each sequence; N when another call scores it
    offset: np.ndarray  # [B] column of its first token

    @property
    def computed_tokens(self) -> int:
        return int(self.seq.size)

    @property
    def real_tokens(self) -> int:
        return int((self.seq >= 0).sum())

    @property
    def in_call(self) -> np.ndarray:
        """[B] whether this call scores each sequence."""
        return self.row < self.seq.shape[0]


def plan_packing(lengths, max_width: int) -> list[ScoringCall]:
    """The packed scoring calls of sequences of ``lengths`` tokens (each in [1, L]; L =
    ``max_width``): ``shapes.score_calls``' rows, N = ``score_rows_per_call(B)`` per call, of
    T = ``score_width(L)`` columns; every call has that one shape.

    Example: lengths [5, 12, 3], L 64 -> one call [1, 64]: 12 at 0, 5 at 12, 3 at 17.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size == 0 or lengths.min() < 1 or lengths.max() > max_width:
        raise ValueError(f"sequence lengths must lie in [1, {max_width}], got {lengths.tolist()}")
    rows, width = score_rows_per_call(lengths.size), score_width(max_width)
    plans = []
    for call in score_calls(lengths, max_width):
        seq = np.full((rows, width), -1, np.int32)
        col = np.zeros((rows, width), np.int32)
        row = np.full(lengths.size, rows, np.int32)
        offset = np.zeros(lengths.size, np.int32)
        for r, members in enumerate(call):
            start = 0
            for b in members:
                n = int(lengths[b])
                seq[r, start : start + n], col[r, start : start + n] = b, np.arange(n)
                row[b], offset[b] = r, start
                start += n
        plans.append(ScoringCall(seq, col, row, offset))
    return plans


@flax.struct.dataclass
class PackedBatch:
    """The device inputs of a packed scoring call."""

    sequences: Int[Array, "B L"]  # prompt then response then padding, per sequence
    prompt_len: Int[Array, " B"]
    response_len: Int[Array, " B"]
    seq: Int[Array, "N T"]  # ScoringCall.seq
    col: Int[Array, "N T"]  # ScoringCall.col
    row: Int[Array, " B"]  # ScoringCall.row
    offset: Int[Array, " B"]  # ScoringCall.offset


def packed_tokens(batch: PackedBatch, pad_id: int = 0) -> Int[Array, "N T"]:
    """The packed rows' tokens, gathered from the sequences (``pad_id`` on padding)."""
    b = jnp.maximum(batch.seq, 0)
    tokens = batch.sequences[b, batch.col]
    return jnp.where(batch.seq >= 0, tokens, pad_id)


def score_packed(
    spec: ScorerSpec, params, batch: PackedBatch, pad_id: int = 0
) -> Float[Array, "B R"] | Float[Array, " B"]:
    """One scorer over one call's packed sequences: per response token [B, R] ("logprob",
    "value", zero past each response) or the score at each sequence's last token [B]
    ("score"); a sequence of another call (``ScoringCall.in_call`` false) gets an unspecified
    value."""
    tokens = packed_tokens(batch, pad_id)
    # Padding forms its own segment (-1): it never mixes into a sequence.
    hidden, _ = Transformer(spec.model).apply(
        {"params": params}, tokens, positions=batch.col, segment_ids=batch.seq, return_hidden=True
    )
    if spec.kind == "score":
        last = batch.offset + batch.prompt_len + batch.response_len - 1
        return scores_at(spec.model, params, hidden[batch.row, last])
    if spec.kind == "logprob":
        following = jnp.concatenate([tokens[:, 1:], jnp.full_like(tokens[:, :1], pad_id)], axis=1)
        quantity = logprobs_at(spec.model, params, hidden, following, spec.temperature)
    else:
        quantity = scores_at(spec.model, params, hidden)
    # Response token i of sequence b reads the position before it: offset + prompt_len - 1 + i.
    i = jnp.arange(spec.response_len)[None, :]
    at = jnp.clip((batch.offset + batch.prompt_len - 1)[:, None] + i, 0, tokens.shape[1] - 1)
    picked = quantity[batch.row[:, None], at]
    return jnp.where(i < batch.response_len[:, None], picked, 0.0)
