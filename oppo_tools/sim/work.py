"""What one step computes, stage by stage, under an engine: the counts a cost model prices.

``step_work(engine, facts, n_scorers, trained_scorers)`` turns a step's facts (slots, widths,
carried prefixes, finish positions, the cut: a measured trace or a simulated step) into

    actor admission       tokens prefilled
    scorers' admission    tokens over all scorers (one call each)
    decode, per chunk     (lockstep steps that run the model, Σ slots computed,
                           Σ slots × context positions read)
    scoring, per chunk    tokens over all scorers (streamed: one call each per chunk)
    sync scoring          tokens over all scorers (one call each after the rollout)
    update                tokens

Simulation prices this work (``CostModel``); calibration fits the prices to measured stage
times against the same counts, so both read an engine (``engines``) one way.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from oppo_tools.sim import packing
from oppo_tools.sim.engines import CAUSAL_BLOCK, Engine, pow2
from oppo_tools.sim.trace import forward_steps


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """One step as its work depends on it (all lengths in tokens)."""

    slots: int  # S
    prompt_len: int  # P, the prompt width
    capacity: int  # R, response capacity
    chunk: int  # C
    # the split admission's (engines without ``replayed_admission``): W, the context of
    # carried rows (P + prefix bucket; P without), and K, the leading rows admitted at W
    width: int
    carried_rows: int
    prefix: np.ndarray  # [S] response tokens each slot carried in
    finish: np.ndarray  # [S] decode position a slot finished at; -1: still running at the end
    cut: int  # decode position at which the rollout was cut
    batch_lengths: np.ndarray  # [B] response lengths of the batch the update takes
    chunks: int  # decode chunks dispatched
    # how the packed update splits the batch (a trace's step: as one microbatch)
    update_groups: packing.UpdateGroups = packing.UpdateGroups()
    # slots sharing each prompt's prefill where the engine shares it (``prompt_sharing``)
    shared_prompts: int = 1
    group_size: int = 1  # G: the batch's lengths hold whole groups, G contiguous each

    @classmethod
    def of_trace(cls, trace: dict, chunk: int, chunks: int) -> StepFacts:
        """The facts a trace records (``trace.step_trace``) of a step decoded in ``chunks``
        chunks of ``chunk`` tokens."""
        s, p = trace["slots"], trace["prompt_width"]
        return cls(
            slots=s,
            prompt_len=p,
            capacity=trace["response_capacity"],
            chunk=chunk,
            width=trace.get("width", p),
            carried_rows=trace.get("carried_rows", s if trace.get("width", p) > p else 0),
            prefix=np.asarray(trace["prefix"]),
            finish=np.asarray(trace["finish"]),
            cut=int(trace["cut"]),
            batch_lengths=np.asarray(trace["lengths"]),
            chunks=chunks,
            shared_prompts=int(trace.get("shared_prompts", 1)),
        )


@dataclasses.dataclass(frozen=True)
class Work:
    """A step's work per stage (module docstring)."""

    actor_tokens: float
    scorer_admit_tokens: float
    decode: list[tuple[float, float, float]]  # per chunk: steps, slot-steps, context reads
    score_chunks: list[float]  # per scored chunk (all scorers); the last chunk is never scored
    sync_score_tokens: float  # all scorers, the one call each when not streaming
    update_tokens: float
    # query-key pairs the update's attention computes in one pass (both models alike)
    update_pairs: float = 0.0
    # all scorers' admission when not streaming (None: as when streaming); 0: skipped, as
    # the packed sync scoring does (it scores prompt + response at once)
    sync_admit_tokens: float | None = None
    # prompt positions whose K and V one model copies from a group's first slot to its others
    # (a shared prompt prefill; ``CostModel.copy_kv_s`` prices them)
    copied_positions: float = 0.0


def decode_chunks(engine: Engine, cut: int, chunk: int) -> int:
    """Chunks dispatched: the active engine stops after the chunk holding the cut; the fixed-
    shape engine dispatches one more before the host reads that the rollout may stop."""
    scored = max(1, math.ceil(cut / chunk))
    return scored if engine.token_proportional else scored + 1


def step_work(engine: Engine, facts: StepFacts, n_scorers: int, trained_scorers: int) -> Work:
    """The work of one step (module docstring); ``trained_scorers`` of the ``n_scorers`` are
    trained (the critic) and always re-prefill carried rows."""
    f = facts
    # prompt tokens one model prefills per slot: P, or P / G where a group shares its prompt
    share = f.shared_prompts if engine.shared_prompt_kv else 1
    per_slot = f.prompt_len / share
    ends = np.where(f.finish < 0, f.cut + 1, f.finish)  # running at position t iff t < end
    new_tokens = np.minimum(ends, f.cut)  # response tokens each slot made up to the cut
    real_new = float(new_tokens.sum())
    if engine.token_proportional:
        decode, per_chunk = _active_decode(f, ends)
        actor = float(f.prefix.sum()) + f.slots * per_slot
        new_rows = int((f.prefix == 0).sum()) * per_slot
        sync = real_new
    else:
        decode, buckets = _fixed_decode(engine, f, ends)
        per_chunk = [b * f.chunk for b in buckets[: f.chunks - 1]]
        if engine.packed_chunk_scoring:  # each chunk's real tokens packed (packing.chunk_tokens)
            # over the admission's S slots, also once the decode has compacted: packing
            # scorers stay in that layout (pipeline.decode_loop)
            scored = min(len(per_chunk), math.ceil(f.cut / f.chunk))  # chunks up to the cut
            made = [np.clip(new_tokens - j * f.chunk, 0, f.chunk) for j in range(scored)]
            per_chunk = [packing.chunk_tokens(counts, f.chunk) for counts in made]
        if engine.replayed_admission:  # prompts, then each prefix in chunks (scoring.carried)
            actor = f.slots * per_slot + packing.replay_tokens(f.prefix, f.slots)
        else:
            k = f.carried_rows if engine.split_admission else f.slots
            actor = k * f.width + (f.slots - k) * f.prompt_len
        new_rows = (f.slots - f.carried_rows) * f.prompt_len
        full, sequences = f.prompt_len + f.capacity, f.prompt_len + f.batch_lengths
        sync = f.slots * f.capacity
        if engine.real_width_scoring:  # the batch's sequences packed, no admission prefill
            sync = packing.score_tokens(sequences, full)
    update, pairs = update_work(
        engine, f.prompt_len, f.capacity, f.batch_lengths, f.update_groups, f.group_size
    )
    frozen = n_scorers - trained_scorers
    kept = actor
    if engine.kept_scorer_caches:  # the built engine prefills every slot's prompt at P
        kept = new_rows if engine.token_proportional else f.slots * per_slot
    admit = float(trained_scorers * actor + frozen * kept)
    sync_admit = None if engine.token_proportional else trained_scorers * actor + frozen * actor
    if engine.real_width_scoring and not engine.token_proportional:
        sync_admit = 0  # kept caches only when streaming; packed sync scoring admits nothing
    return Work(
        actor_tokens=float(actor),
        scorer_admit_tokens=admit,
        decode=decode,
        score_chunks=[float(n_scorers * t) for t in per_chunk],
        sync_score_tokens=float(n_scorers * sync),
        update_tokens=float(update),
        update_pairs=float(pairs),
        sync_admit_tokens=None if sync_admit is None else float(sync_admit),
        # every slot's prompt K and V copied from its group's first slot (the refill's pricing)
        copied_positions=float(f.slots * f.prompt_len) if share > 1 else 0.0,
    )


def update_work(
    engine: Engine,
    prompt_len: int,
    capacity: int,
    lengths,
    groups: packing.UpdateGroups,
    group_size: int = 1,
) -> tuple[float, float]:
    """(tokens, query-key pairs) the update computes over a batch of response ``lengths``
    behind prompts of ``prompt_len``, in rows of P + R (``capacity``) split as ``groups``;
    with ``shared_prefix_update`` and G > 1 (the batch's groups: G contiguous lengths) each
    group's prompt once (``packing.shared_prefix_items``)."""
    shared = engine.shared_prefix_update and group_size > 1 and len(lengths)
    sequences = prompt_len + np.asarray(lengths)
    if engine.token_proportional and shared:  # a prompt's tokens and pairs once per group
        r, p, n = np.asarray(lengths, float), prompt_len, len(lengths) / group_size
        return n * p + r.sum(), n * p * (p + 1) / 2 + float((r * p + r * (r + 1) / 2).sum())
    if engine.token_proportional:  # each sequence its own tokens and causal pairs
        return float(sequences.sum()), float((sequences * (sequences + 1) / 2).sum())
    full = prompt_len + capacity
    segment = engine.packed_update and engine.segment_update_attention
    rows, row_width, pairs = sequences.size, full, None
    if shared and engine.packed_update:
        rows, row_width, pairs = packing.shared_update_work(
            prompt_len, lengths, full, groups, group_size, segment
        )
    elif engine.packed_update:
        rows, row_width = packing.update_rows(sequences, full, groups)
        pairs = packing.update_segment_pairs(sequences, full, groups) if segment else None
    if pairs is None:  # every key of a row (XLA), or its causal blocks (splash)
        pairs = rows * _row_pairs(row_width, engine.causal_update_attention)
    return float(rows * row_width), float(pairs)


def _row_pairs(width: int, causal: bool) -> float:
    """Query-key pairs the update's attention computes over one packed row of ``width``:
    every key of the row (XLA), or the causal blocks up to and with the diagonal's (splash)."""
    if not causal:
        return float(width) * width
    block = min(CAUSAL_BLOCK, width)
    blocks = math.ceil(width / block)
    return blocks * (blocks + 1) / 2 * block**2


def _running(ends: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Slots still running at each decode position ``t`` (end > t)."""
    return ends.size - np.searchsorted(np.sort(ends), t, side="right")


def _running_contexts(f: StepFacts, ends: np.ndarray):
    """Per decode position t < cut: (slots running, Σ of their contexts). O(cut + S log S):
    with the slots sorted by end, the running ones are a suffix."""
    order = np.argsort(ends, kind="stable")
    es, base = ends[order], (f.prompt_len + f.prefix)[order]
    t = np.arange(f.cut)
    done = np.searchsorted(es, t, side="right")
    running = ends.size - done
    return running, np.concatenate([np.cumsum(base[::-1])[::-1], [0]])[done] + t * running


def _active_decode(f: StepFacts, ends: np.ndarray):
    """Per chunk (steps, Σ running slots, Σ their contexts) and the real tokens per chunk,
    up to the cut: finished slots cost nothing, each running slot reads its own context."""
    running, ctx = _running_contexts(f, ends)
    starts = np.arange(0, f.cut, f.chunk)
    if not f.cut:
        return [], []
    steps = np.diff(np.append(starts, f.cut))
    slot_steps = np.add.reduceat(running, starts)
    reads = np.add.reduceat(ctx, starts)
    rows = zip(steps, slot_steps, reads, strict=True)
    decode = [(float(a), float(b), float(c)) for a, b, c in rows]
    return decode, [float(x) for x in slot_steps]


def _fixed_decode(engine: Engine, f: StepFacts, ends: np.ndarray):
    """Per chunk (forward steps, Σ slots computed, Σ slots × context read) of a fixed-shape
    engine, and each chunk's slot bucket (the streaming scorers run at it too)."""
    cut = f.cut if engine.decode_to_cut else None
    fwd = forward_steps(f.finish, f.chunks, f.chunk, cut)
    full = f.prompt_len + f.capacity
    bucket, decode, buckets = f.slots, [], []
    if engine.ragged_decode:  # each running row reads its own context, rounded up to the
        # kernel's key block; finished rows read nothing (models.ragged_decode)
        running, ctx_sum = _running_contexts(f, ends)
        per_position = ctx_sum + running * (engine.ragged_key_block / 2)
        ragged = np.add.reduceat(per_position, np.arange(0, f.cut, f.chunk)) if f.cut else []
    for j, steps in enumerate(fwd):
        ctx, gather = full, 0.0
        if engine.compact_slots and j >= 1:
            # The host sees a chunk's counts one chunk late: chunk j is sized by the slots
            # running when chunk j - 1 began; gathering them copies their caches once.
            # The engine's rule (rollout.compaction.compact_bucket): into pow2(live), at least
            # the floor, when that is at most half the bucket's power of two and smaller.
            live = int(_running(ends, np.array([(j - 1) * f.chunk]))[0])
            into = pow2(live, engine.compact_min_slots)
            if into <= pow2(bucket, engine.compact_min_slots) // 2 and into < bucket:
                bucket = into
                gather = 2.0 * bucket * full
        if engine.live_prefix_decode:  # the longest admitted context + the chunks so far
            longest = f.prompt_len + float(f.prefix.max(initial=0)) + (j + 1) * f.chunk
            ctx = packing.live_width(longest, full)
        reads = steps * bucket * ctx
        if engine.ragged_decode:
            reads = float(ragged[j]) if j < len(ragged) and steps else 0.0
        decode.append((float(steps), float(steps * bucket), float(reads + gather)))
        buckets.append(bucket)
    return decode, buckets
