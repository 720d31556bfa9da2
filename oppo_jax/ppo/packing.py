"""Packing the update's minibatches: each minibatch's sequences, prompt + response, laid end
to end in rows of a bucketed width, so the update computes on real tokens, not on [B, P + R].

The host plans (``plan_packing``) from the step's lengths and the epochs' permutations; the
update gathers each chunk from the padded ``PPOBatch`` with the plan's indices
(``gather_microbatch``). The minibatches are exactly the padded update's (same rows, drawn
from the same update key), and so are the microbatches its loss averages over.

A minibatch of A microbatches x m sequences packs as one group: its A·m sequences first-fit
decreasing into rows, the rows dealt in order to K chunks of Rp rows each (the gradient
accumulation steps: one fixed height, ``shapes.update_chunk_rows``, no larger than the padded
microbatch of m rows the config sized for memory; K, ``shapes.update_chunks``, enough for the
most rows a minibatch can need), and a chunk that holds no sequence does not run
(``PackIndices.used``): the update compiles once, and only the last chunk of a minibatch is
partly padding. A chunk then mixes microbatches, so every reduction of the loss and the
metrics is a weighted sum of its tokens with weights the host computes from the lengths
(``losses.TokenWeights``): token_mean 1 / the microbatch's valid tokens, seq_mean 1 / (the
sequence's valid tokens x the microbatch's sequences with any), dr_grpo 1 / (m x R), dapo
A / the minibatch's valid tokens, a metric's masked mean the token_mean weight. Summed over
the chunks and divided by A as the accumulation does, that is the padded update's mean over
microbatches of their own means: the same function of the same tokens. Packing each
microbatch alone instead would run every microbatch at the fullest one's rows.

Packed layout of one chunk (dimension letters: Rp packed rows, W packed width, N response
slots, K chunks per minibatch; n = A·m sequences in the minibatch):
- token slots [Rp, W]: sequence i occupies a contiguous run of ``prompt_len + response_len``
  slots of one row, with positions 0.. (RoPE restarts per sequence) and its own segment id
  (its index in the minibatch: attention never crosses a segment); unused slots hold -1,
  padding, which the segment attention skips by whole blocks (``models.segment_attention``).
- response slots [N]: one per real response token, in packed order; slot k reads the packed
  output at ``resp_at[k]`` (the position before its token) and carries the token's per-token
  PPO quantities and weights; unused slots have segment n, weight 0, and are masked out.

The shape (Rp, W, N), and K, are fixed by the config (``packed_shapes``), so the update is one
program: the width W is k x the padded width L = P + R (``ppo.pack_width_factor`` k, default
1), rounded up to the granule (every sequence fits a row; with k = 2 any two do, which long
fixed prompts need), and N = min(Rp · W, n · R) (a chunk's responses never outnumber its slots
nor the minibatch's). The plan is a pure function
of the step's data (never of which shapes compiled before): a resumed run packs exactly as
the uninterrupted one, so resume stays bit-identical.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from oppo_jax.base.shapes import (
    first_fit_decreasing,
    packed_width,
    update_chunk_rows,
    update_chunks,
)
from oppo_jax.parallel.sharding import to_host
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.losses import TokenWeights


def microbatch_rows(perms: np.ndarray, num_minibatches: int, grad_accum: int) -> np.ndarray:
    """[E, M, A, m] batch rows of every microbatch, as the padded update splits them.

    Epoch e shuffles the rows by ``perms[e]``; minibatch j takes shuffled rows j, j + M, ...
    and its microbatch a takes that minibatch's rows a, a + A, ... (strided: every part keeps
    an equal share of the rows on every device of the batch axes).
    """
    epochs, rows = perms.shape
    m = rows // (num_minibatches * grad_accum)
    mini = perms.reshape(epochs, rows // num_minibatches, num_minibatches).transpose(0, 2, 1)
    micro = mini.reshape(epochs, num_minibatches, m, grad_accum).transpose(0, 1, 3, 2)
    return micro


@flax.struct.dataclass
class PackIndices:
    """The plan's index arrays, leading axes [E, M, K] (epoch, minibatch, chunk)."""

    tok_src: Int[Array, "... Rp W"]  # flat index into tokens [B·L] of each token slot
    positions: Int[Array, "... Rp W"]  # position within its sequence (RoPE)
    segments: Int[Array, "... Rp W"]  # minibatch-local sequence index; -1 for unused slots
    resp_at: Int[Array, "... N"]  # flat packed slot [Rp·W] whose output is the response token's
    resp_src: Int[Array, "... N"]  # flat index into response-aligned arrays [B·R]
    tgt_src: Int[Array, "... N"]  # flat index into tokens [B·L] of the response token itself
    resp_seg: Int[Array, "... N"]  # minibatch-local sequence index; n for unused slots
    loss_weight: Float[Array, "... N"]  # TokenWeights.loss (module docstring); 0 when unused
    mean_weight: Float[Array, "... N"]  # TokenWeights.mean; 0 when unused
    used: Bool[Array, "..."]  # the chunk holds a sequence (else it does not run)

    __no_type_check__ = True  # host numpy arrays when planned, tracers inside the update


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """One step's packing: the indices (host arrays) and what they cost."""

    indices: PackIndices
    shape: tuple[int, int, int]  # (Rp, W, N) of every chunk (the config's one shape)
    tokens_real: int  # real tokens (prompt + response) the update's forward passes read
    tokens_computed: int  # token slots they compute: chunks that run x Rp x W


def _slots(rows: int, width: int, num_seqs: int, response_width: int, multiple: int) -> int:
    """N for Rp = ``rows``: every token slot could hold a response token, and a chunk holds
    at most the minibatch's ``num_seqs`` x R of them (a multiple of the shards)."""
    return min(rows * width, -(-num_seqs * response_width // multiple) * multiple)


def packed_shapes(
    num_seqs: int,
    full_width: int,
    response_width: int,
    granule: int = 16,
    row_multiple: int = 1,
    chunks: int = 1,
    width_factor: int = 1,
) -> tuple[tuple[int, int, int], int]:
    """The one (Rp, W, N) of every chunk ``plan_packing`` makes for minibatches of ``chunks``
    (A) microbatches of ``num_seqs`` (m) sequences, and K, the chunks per minibatch: what a
    warm-up compiles so that no measured step does.

    Example: m 8, L 48, R 32, granule 16, A 1: Rp 1, W 48, N 48; K 8.
    """
    width = packed_width(full_width, granule, width_factor)
    rows = update_chunk_rows(num_seqs, row_multiple, width_factor)
    n = num_seqs * chunks
    shape = (rows, width, _slots(rows, width, n, response_width, row_multiple))
    return shape, update_chunks(num_seqs, chunks, row_multiple, width_factor)


def token_weights(response_len: np.ndarray, micro: np.ndarray, agg: str, response_width: int):
    """(loss, mean) weight of each sequence's response tokens [B] for one minibatch's
    microbatches ``micro`` [A, m] under the loss aggregation ``agg`` (module docstring);
    sequences outside it get 0. dr_grpo divides by m x R (``response_width``), dapo by the
    minibatch's tokens, times A (the accumulation divides the sum by A; TRL's does not)."""
    loss, mean = np.zeros(len(response_len)), np.zeros(len(response_len))
    minibatch_tokens = max(int(response_len[micro.reshape(-1)].sum()), 1)
    for rows in micro:
        n = response_len[rows]
        mean[rows] = 1.0 / max(int(n.sum()), 1)
        if agg == "seq_mean":
            loss[rows] = 1.0 / (np.maximum(n, 1) * max(int((n > 0).sum()), 1))
        elif agg == "dr_grpo":
            loss[rows] = 1.0 / (len(rows) * response_width)
        elif agg == "dapo":
            loss[rows] = len(micro) / minibatch_tokens
        else:
            loss[rows] = mean[rows]
    return loss.astype(np.float32), mean.astype(np.float32)


def plan_packing(
    prompt_len: np.ndarray,
    response_len: np.ndarray,
    micro: np.ndarray,
    widths: tuple[int, int],
    granule: int = 16,
    row_multiple: int = 1,
    agg: str = "token_mean",
    width_factor: int = 1,
) -> PackPlan:
    """Pack every minibatch of ``micro`` [E, M, A, m] (see ``microbatch_rows``) of a batch
    whose sequences have these lengths [B] (host ints), padded width L and response width R
    (``widths`` = (L, R)), into A chunks each. ``row_multiple``: Rp and N are multiples of
    it (the devices the rows shard over); ``agg``: the loss aggregation (``token_weights``);
    ``width_factor``: rows of that many times L (``packed_width``)."""
    prompt_len, response_len = np.asarray(prompt_len, np.int64), np.asarray(response_len)
    if (prompt_len < 1).any():
        raise ValueError("packing needs every prompt to hold at least one token")
    lengths = prompt_len + response_len
    full_width, response_width = widths
    epochs, minibatches, chunks, m = micro.shape
    minis = micro.reshape(epochs * minibatches, chunks, m)
    (rows, width, slots), count = packed_shapes(
        m, full_width, response_width, granule, row_multiple, chunks, width_factor
    )
    members = [mini.reshape(-1) for mini in minis]  # minibatch-local index -> batch row
    bins = [first_fit_decreasing(lengths[seqs], width) for seqs in members]
    # Any k sequences fit a row of k·L, so first-fit decreasing needs at most ceil(A·m / k)
    # rows: K chunks of Rp always hold them (a row left out would lose its sequences).
    assert all(len(b) <= rows * count for b in bins), (rows, count, [len(b) for b in bins])
    dims = (rows, width, slots, full_width, response_width)
    arrays = []
    for mini, seqs, row_bins in zip(minis, members, bins, strict=True):
        weights = token_weights(response_len, mini, agg, response_width)
        for c in range(count):
            dealt = row_bins[c * rows : (c + 1) * rows]
            arrays.append(_pack_one(seqs, dealt, prompt_len, response_len, weights, dims))
    stacked = {
        k: np.stack([a[k] for a in arrays]).reshape(micro.shape[:2] + (count,) + arrays[0][k].shape)
        for k in arrays[0]
    }
    runs = sum(-(-len(b) // rows) for b in bins)
    return PackPlan(
        indices=PackIndices(**stacked),
        shape=(rows, width, slots),
        tokens_real=int(lengths[micro.reshape(-1)].sum()),
        tokens_computed=runs * rows * width,
    )


def padding_indices(outer: tuple, shape: tuple[int, int, int], num_seqs: int) -> PackIndices:
    """A plan of ``shape`` with every slot unused (leading axes ``outer`` = (E, M, K); a
    minibatch of ``num_seqs`` sequences): the throwaway input of a warm-up that compiles the
    update at that shape."""
    rows, width, slots = shape
    no_weights = (np.zeros(0, np.float32),) * 2
    out = _pack_one([0] * num_seqs, [], None, None, no_weights, (rows, width, slots, 0, 0))
    return PackIndices(**{k: np.broadcast_to(v, outer + v.shape).copy() for k, v in out.items()})


def _pack_one(seqs, row_bins, prompt_len, response_len, weights, dims):
    """Index arrays of one chunk: ``seqs`` [n] the minibatch's batch rows, ``row_bins`` the
    chunk's rows (lists of minibatch-local indices), ``weights`` (loss, mean) per batch row,
    ``dims`` = (Rp, W, N, L, R)."""
    rows, width, slots, full, resp_w = dims
    n = len(seqs)
    out = {
        "tok_src": np.zeros((rows, width), np.int32),
        "positions": np.zeros((rows, width), np.int32),
        "segments": np.full((rows, width), -1, np.int32),
        "resp_at": np.zeros(slots, np.int32),
        "resp_src": np.zeros(slots, np.int32),
        "tgt_src": np.zeros(slots, np.int32),
        "resp_seg": np.full(slots, n, np.int32),
        "loss_weight": np.zeros(slots, np.float32),
        "mean_weight": np.zeros(slots, np.float32),
        "used": np.asarray(bool(row_bins)),
    }
    k = 0
    for r, members in enumerate(row_bins):
        offset = 0
        for local in members:
            b = int(seqs[local])
            p, n_resp = int(prompt_len[b]), int(response_len[b])
            length = p + n_resp
            pos = np.arange(length)
            out["tok_src"][r, offset : offset + length] = b * full + pos
            out["positions"][r, offset : offset + length] = pos
            out["segments"][r, offset : offset + length] = local
            j = np.arange(n_resp)
            out["resp_at"][k : k + n_resp] = r * width + offset + p - 1 + j
            out["resp_src"][k : k + n_resp] = b * resp_w + j
            out["tgt_src"][k : k + n_resp] = b * full + p + j
            out["resp_seg"][k : k + n_resp] = local
            out["loss_weight"][k : k + n_resp] = weights[0][b]
            out["mean_weight"][k : k + n_resp] = weights[1][b]
            k += n_resp
            offset += length
    return out


@flax.struct.dataclass
class PackedMicrobatch:
    """One chunk on the packed layout: token slots [Rp, W] and response slots [N]."""

    tokens: Int[Array, "Rp W"]
    positions: Int[Array, "Rp W"]
    segments: Int[Array, "Rp W"]
    resp_at: Int[Array, " N"]  # flat packed slot whose output belongs to the response token
    targets: Int[Array, " N"]  # the response tokens
    weights: TokenWeights  # the reductions' per-token weights (module docstring)
    mask: Bool[Array, " N"]
    old_logp: Float[Array, " N"]
    behaviour_logp: Float[Array, " N"]
    old_values: Float[Array, " N"]
    advantages: Float[Array, " N"]
    returns: Float[Array, " N"]
    ref_logp: Float[Array, " N"]

    __no_type_check__ = True  # rebuilt with sharding leaves by tree maps


def gather_microbatch(batch: PPOBatch, idx: PackIndices, num_seqs: int) -> PackedMicrobatch:
    """The packed chunk ``idx`` (one chunk's indices) from the padded batch; ``num_seqs``
    sequences per minibatch (the unused slots' segment id)."""
    tokens = batch.tokens.reshape(-1)

    def per_token(x):
        return x.reshape(-1)[idx.resp_src]

    return PackedMicrobatch(
        tokens=tokens[idx.tok_src],
        positions=idx.positions,
        segments=idx.segments,
        resp_at=idx.resp_at,
        targets=tokens[idx.tgt_src],
        weights=TokenWeights(loss=idx.loss_weight, mean=idx.mean_weight),
        mask=per_token(batch.mask) & (idx.resp_seg < num_seqs),
        **{
            name: per_token(getattr(batch, name))
            for name in ("old_logp", "behaviour_logp", "old_values", "advantages", "returns")
        },
        ref_logp=per_token(batch.ref_logp),
    )


def host_lengths(batch: PPOBatch) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_len, response_len) [B] of a device batch, read to the host (one small read;
    the step passes lengths it already holds instead)."""
    prompt_len, mask = to_host((batch.prompt_len, batch.mask))  # global values, every process
    return np.asarray(prompt_len), np.asarray(mask).sum(axis=1)
