"""Scoring at real widths after the rollout (non-streaming schedules): the batch's sequences
packed into rows with segment ids, one cache-less forward per scorer.

Without streaming, the scorers only need the B sequences the update takes, each scored once
when it enters a batch (a carried sequence is scored whole in the step that takes it; nothing
is computed for it while it waits). Their real tokens (prompt + response) are packed end to
end into N rows of T columns (``plan_packing``: first-fit decreasing, T a power of two >= the
longest sequence, N bucketed by ``bucket_up``), so the forward costs about the real tokens, not
[S, P + R].
A token attends only within its own sequence (segment ids) and its RoPE position restarts per
sequence, so every quantity equals that of the sequence's own forward (up to float rounding):

    logprob (reference):  log softmax(head(h[j]) / temperature)[token j + 1]
    value   (critic):     head(h[j])[0]            both at the position before a response token
    score   (reward):     head(h)[0] at the sequence's last token

Why packed rather than every row at the bucketed width of the step's longest response: with
long-tailed lengths the longest of B responses is usually near the cap, so that width saves
little. Token accounting over 2,000 sampled batches of configs/bench_longtail_cpu.yaml's lengths
(B 16, prompts 5-10, responses lognormal median 56 / p99 448 capped at 512), tokens computed per
real token: R wide 5.91, bucketed width 4.41, packed 1.44 (efficiency 0.69) with N a power of
two; attention score pairs relative to R wide: 0.62 bucketed, 0.19 packed. N in 2^k and 1.5·2^k
raises the efficiency to ~0.82 there and from ~0.63 to ~0.77 at configs/bench_cpu.yaml's lengths
(300 sampled batches each), for 3 row buckets more per width in the warm-up (8 instead of 5 for
B = 16); ``bucket_up``'s four sizes per doubling (as the packed update's rows) raise it further
for 12 row buckets per width at B = 16, and its eight (every count up to 16) for 16 (the
efficiency is measured in BENCHMARKS.md).
Dimension letters: B sequences, L sequence width (P + R), N packed rows, T packed width.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from oppo_jax.models.heads import logprobs_at, scores_at
from oppo_jax.models.transformer import Transformer
from oppo_jax.ppo.packing import bucket_up
from oppo_jax.scoring.stream import ScorerSpec

MIN_WIDTH = 16  # narrowest packed row: fewer distinct compiled widths


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor). Example: 5 -> 8, 16 -> 16, 0 -> 1."""
    return 1 << (max(n, floor, 1) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each sequence's tokens go in the packed rows (host NumPy, from lengths only)."""

    seq: np.ndarray  # [N, T] sequence of each packed token; -1 for padding
    col: np.ndarray  # [N, T] its index within the sequence (its RoPE position); 0 for padding
    row: np.ndarray  # [B] packed row of each sequence
    offset: np.ndarray  # [B] column of its first token

    @property
    def computed_tokens(self) -> int:
        return int(self.seq.size)

    @property
    def real_tokens(self) -> int:
        return int((self.seq >= 0).sum())


def plan_packing(lengths, max_width: int) -> PackPlan:
    """Pack sequences of ``lengths`` tokens into rows: first-fit decreasing (ties by index),
    T = a power of two >= the longest (at least ``MIN_WIDTH``, at most ``max_width``), and N
    rounded up to 2^k·{1, 1.125, ..., 1.875} (``bucket_up``: under a ninth of the rows wasted), so
    few (N, T) shapes compile.

    Example: lengths [5, 12, 3], max_width 64 -> T 16; 12 -> row 0 at 0, 3 -> row 0 at 12,
    5 -> row 1 at 0; N 2.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size == 0 or lengths.min() < 1 or lengths.max() > max_width:
        raise ValueError(f"sequence lengths must lie in [1, {max_width}], got {lengths.tolist()}")
    width = min(pow2_at_least(int(lengths.max()), MIN_WIDTH), max_width)
    fill: list[int] = []  # tokens used in each row so far
    row = np.zeros(lengths.size, np.int64)
    offset = np.zeros(lengths.size, np.int64)
    for b in np.argsort(-lengths, kind="stable"):
        n = next((i for i, used in enumerate(fill) if used + lengths[b] <= width), len(fill))
        if n == len(fill):
            fill.append(0)
        row[b], offset[b] = n, fill[n]
        fill[n] += int(lengths[b])
    rows = bucket_up(len(fill))
    seq = np.full((rows, width), -1, np.int32)
    col = np.zeros((rows, width), np.int32)
    for b, length in enumerate(lengths):
        seq[row[b], offset[b] : offset[b] + length] = b
        col[row[b], offset[b] : offset[b] + length] = np.arange(length)
    return PackPlan(seq, col, row.astype(np.int32), offset.astype(np.int32))


@flax.struct.dataclass
class PackedBatch:
    """The device inputs of a packed scoring call."""

    sequences: Int[Array, "B L"]  # prompt then response then padding, per sequence
    prompt_len: Int[Array, " B"]
    response_len: Int[Array, " B"]
    seq: Int[Array, "N T"]  # PackPlan.seq
    col: Int[Array, "N T"]  # PackPlan.col
    row: Int[Array, " B"]  # PackPlan.row
    offset: Int[Array, " B"]  # PackPlan.offset


def packed_tokens(batch: PackedBatch, pad_id: int = 0) -> Int[Array, "N T"]:
    """The packed rows' tokens, gathered from the sequences (``pad_id`` on padding)."""
    b = jnp.maximum(batch.seq, 0)
    tokens = batch.sequences[b, batch.col]
    return jnp.where(batch.seq >= 0, tokens, pad_id)


def score_packed(
    spec: ScorerSpec, params, batch: PackedBatch, pad_id: int = 0
) -> Float[Array, "B R"] | Float[Array, " B"]:
    """One scorer over the packed sequences: per response token [B, R] ("logprob", "value",
    zero past each response) or the score at each sequence's last token [B] ("score")."""
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
