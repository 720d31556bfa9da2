"""The shape rules: every size a compiled kernel can be called at, as a pure function of the
config's sizes and the step's lengths (NumPy and ints only; no JAX, no models).

One home for them: the kernels' host planners, the warm-up and ``oppo-jax compile-plan``
(``pipeline.compile_plan``), the token accounting, the memory report and the simulator all
import these functions, so a rule changed here changes every one of them.

The budget they keep: a run compiles a small, fixed set of programs, whatever its B, Δ or
lengths. Where work follows the data it is a fixed-shape call looped a variable number of
times from the host (``score_calls``: sync's packed scoring, ``chunk_groups``: a streamed
chunk's packed tokens), or a length passed as data; where a shape must vary, a power of two
(``pow2_at_least``, ``live_width``, ``row_bucket``); the packed update's chunks have one height
(``update_chunk_rows``), as many running as a minibatch needs.

Dimension letters: B sequences, S slots, C chunk width, L = P + R padded sequence width.
"""

from __future__ import annotations

import numpy as np

# The kernel families a run compiles (``pipeline.compile_plan``). Each family's jits carry its
# name (``program_name``), so compile events and logs say which family a program is.
FAMILIES = (
    "admission prefill",
    "decode start",
    "replay",
    "decode",
    "streamed scoring",
    "sync scoring",
    "experience",
    "update",
    "refill start",  # a refilling run's (rollout.refill_every) empty rows, its prompt stores
    "refill prompts",  # and the placements of samples into rows
    "refill place",
)
MIN_LIVE_WIDTH = 16  # the narrowest live cache width: shorter contexts share one program
MIN_ROW_WIDTH = 16  # packed rows' widths are multiples of this many tokens
# A streamed chunk's packed scoring calls hold pow2(S·C / CHUNK_SPLIT) tokens, at least one
# slot's C: a chunk whose slots all decode runs about CHUNK_SPLIT calls, the long tail's few
# live slots one, and at most one call's budget of a chunk is padding. 32 keeps the tail's
# calls near its real tokens (S 120, C 256: 1024 tokens a call, four slots' chunks); a coarser
# split pads the tail's calls (docs/PROJECTIONS.md, "Few programs").
CHUNK_SPLIT = 32
# Sync's packed scoring calls hold pow2(B / SCORE_SPLIT) rows of L tokens: a batch runs about
# SCORE_SPLIT / (sequences per row) calls, only the last partly padding (B 112: 4 rows a call;
# B / 8 would make it 16, up to 15 of them empty; docs/PROJECTIONS.md, "Few programs").
SCORE_SPLIT = 32


def program_name(family: str) -> str:
    """The function name a ``family``'s jitted kernels carry (jax reports "jit(<name>)").
    Example: "sync scoring" -> "oppo_sync_scoring"."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    return "oppo_" + family.replace(" ", "_")


def family_of(compiled_name: str) -> str | None:
    """The family of a compiled program jax named ``compiled_name`` ("jit(<name>)" or the
    name itself), None for a program of no family (a helper). Example: "jit(oppo_decode)" ->
    "decode"."""
    name = compiled_name.removeprefix("jit(").removesuffix(")")
    return next((f for f in FAMILIES if program_name(f) == name), None)


def pow2_at_least(n: int | float, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor). Example: 5 -> 8, 16 -> 16, 0 -> 1."""
    n = max(int(np.ceil(n)), floor, 1)
    return 1 << (n - 1).bit_length()


def pow4_bucket(n: int, most: int) -> int:
    """The smallest power of four >= ``n``, or ``most`` when that is smaller: a refill
    program's bucket of prompts or rows (coarser than powers of two: fewer programs, at most
    4x the rows). Example: (5, 128) -> 16, (100, 128) -> 128."""
    bucket = 1
    while bucket < n:
        bucket *= 4
    return min(bucket, most)


def pow4_buckets(most: int) -> tuple[int, ...]:
    """Every ``pow4_bucket`` up to ``most``. Example: 128 -> (1, 4, 16, 64, 128)."""
    return tuple(sorted({pow4_bucket(n, most) for n in range(1, most + 1)}))


def refill_store_rows(rows: int, group_size: int) -> int:
    """Rows of a refilling run's prompt store: groups one refill point prefills at most (the
    one group that can wait with samples unplaced, and a group per G free rows, rounded up),
    as a power of two. Example: 16 rows, G = 4 -> 8."""
    return pow2_at_least(1 + -(-rows // group_size))


def live_width(longest: int | float, capacity: int) -> int:
    """Cache columns to read when no token of the call sits at a position >= ``longest``: the
    next power of two (at least ``MIN_LIVE_WIDTH``), capped at the capacity.

    Example: capacity 528 -> longest 70 gives 128, 300 gives 512, 520 gives 528, 5 gives 16.
    """
    if capacity < 1:
        raise ValueError(f"cache capacity must be positive, got {capacity}")
    return min(pow2_at_least(longest, MIN_LIVE_WIDTH), capacity)


def live_widths(capacity: int) -> tuple[int, ...]:
    """Every width ``live_width`` can return for this capacity. Example: 100 -> (16, 32, 64,
    100)."""
    widths, width = [], MIN_LIVE_WIDTH
    while width < capacity:
        widths.append(width)
        width *= 2
    return (*widths, capacity)


def chunk_widths(capacity: int, chunk_size: int) -> tuple[int, ...]:
    """Every live width a decode chunk of ``chunk_size`` tokens (and the scorer chunk fed with
    it) can read: ``live_width`` of (longest admitted context + C) over every context
    1..capacity (later chunks only move further along the same widths).
    Example: capacity 48, C 8 -> (16, 32, 48); C 32 -> (48,)."""
    return tuple(sorted({live_width(n + chunk_size, capacity) for n in range(1, capacity + 1)}))


# The smallest cache whose live widths pay for their programs on a backend without a ragged
# decode kernel: a short cache costs little to read whole, so extra decode and streamed-scoring
# programs buy nothing; a long one read whole costs every slot the longest context. 256 lies
# between the demo's 80 (no gain) and the long-tail bench's 528 (a clear gain; BENCHMARKS.md,
# "Few programs": which shape families earn their programs on the CPU).
LIVE_WIDTH_MIN_CAPACITY = 256


def live_widths_pay(capacity: int, reads_lengths: bool) -> bool:
    """Whether decode and streamed scoring read power-of-two live widths (a program each)
    rather than the whole cache (one): not where the decode's attention takes lengths as data
    (``models.attention.reads_lengths``: it reads no key past a row's length anyway), nor on
    a cache under ``LIVE_WIDTH_MIN_CAPACITY``. Example: (528, False) -> True; (80, False) ->
    False; (1536, True) -> False."""
    return not reads_lengths and capacity >= LIVE_WIDTH_MIN_CAPACITY


def compaction_default(backend: str) -> bool:
    """Whether a backend ("cpu", "gpu", "tpu") compacts by default: on the CPU, where a decode
    step costs in proportion to its slots. On GPU and TPU the ragged decode attention
    (``models.ragged_decode``) already reads no keys of a finished slot: one mechanism for
    finished slots per backend."""
    return backend == "cpu"


def compaction_floor(
    compact: bool,
    reads_lengths: bool,
    batch_shards: int,
    scoring_shards: int,
    minimum: int,
    group_size: int = 1,
):
    """The smallest slot bucket a run's decode compacts into (``pipeline.decode_loop``), or None
    when it does not. One mechanism makes finished slots cost nothing: where the decode's
    attention takes each row's length as data (``reads_lengths``: the ragged kernel, on GPU
    and TPU) it reads no key of a finished slot, so nothing compacts; elsewhere (the CPU)
    ``compact`` decides. It compacts only where neither the generation mesh nor the scoring
    mesh splits the slots over batch shards: the chunks' consumers then pack each chunk over
    the admission's slots, and the moved rows never cross devices; and only without groups
    (``group_size`` 1): the cut counts a group's members, which a move would split."""
    single = batch_shards == 1 and scoring_shards == 1 and group_size == 1
    return max(minimum, 1) if compact and not reads_lengths and single else None


# Attention kernels' blocks (``models.ragged_decode``, ``models.ragged_decode_tpu``,
# ``models.segment_attention``): keys a ragged decode row reads at a time on a GPU and on a
# TPU, and queries and keys per block of the packed update's segment attention.
RAGGED_KEY_BLOCK = 128
RAGGED_KEY_BLOCK_TPU = 1024
SEGMENT_BLOCK = 64


def pow2_block(width: int, most: int) -> int:
    """The largest power of two <= ``most`` dividing ``width``: the block a kernel tiles a
    ``width`` with. Example: (528, 128) -> 16, (2048, 1024) -> 1024."""
    return min(width & -width, most)


def row_bucket(rows: int, num_slots: int) -> int:
    """Leading slots a replay chunk runs over: 0, or a power of two >= 4, capped at S.
    Example: S = 24: 0 -> 0, 1 -> 4, 5 -> 8, 8 -> 8, 9 -> 16, 17 -> 24."""
    if rows <= 0:
        return 0
    return min(max(4, 1 << (int(rows) - 1).bit_length()), num_slots)


def first_fit_decreasing(lengths, width: int, max_items: int | None = None) -> list[list[int]]:
    """Bins (rows) of item indices, each holding at most ``width`` (and at most ``max_items``
    items): longest first, each into the first bin with room. Deterministic (ties keep index
    order).

    Example: lengths [5, 3, 4, 2], width 8 -> [[0, 1], [2, 3]]; max_items 1 -> four bins.
    """
    lengths = np.asarray(lengths)
    cap = len(lengths) if max_items is None else max_items
    # Plain lists: a bin scan in Python beats a NumPy call per item at every size a step
    # plans (BENCHMARKS.md, "Host work between steps": the packed update's bin packing).
    rows: list[list[int]] = []
    room: list[int] = []  # each bin's room left
    slots: list[int] = []  # items each bin may still take
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        for b, r in enumerate(room):
            if r >= n and slots[b] > 0:
                rows[b].append(i)
                room[b], slots[b] = r - n, slots[b] - 1
                break
        else:
            rows.append([i])
            room.append(width - n)
            slots.append(cap - 1)
    return rows


# --- sync's packed scoring (scoring.packed): rows of one width, a fixed number per call ---


def score_width(full_width: int) -> int:
    """T, the packed scoring rows' width: L rounded up to ``MIN_ROW_WIDTH`` (any sequence fits
    a row). Example: 80 -> 80, 90 -> 96."""
    return -(-full_width // MIN_ROW_WIDTH) * MIN_ROW_WIDTH


def score_rows_per_call(batch_size: int) -> int:
    """N, the rows of every packed scoring call: pow2(B / ``SCORE_SPLIT``). Example: B 16 ->
    1, 112 -> 4, 256 -> 8."""
    return pow2_at_least(batch_size / SCORE_SPLIT)


def score_calls(lengths, full_width: int) -> list[list[list[int]]]:
    """Sync's packed scoring of sequences of ``lengths`` (prompt + response): their first-fit
    decreasing rows of ``score_width``, dealt ``score_rows_per_call(B)`` at a time (B the
    number of sequences) to calls of one shape. Returns each call's rows (lists of sequence
    indices).

    Example: lengths [70, 10, 60, 20, 5], L 80 (B 5: one row a call): rows [0, 1], [2, 3],
    [4] -> [[[0, 1]], [[2, 3]], [[4]]].
    """
    rows = first_fit_decreasing(lengths, score_width(full_width))
    per_call = score_rows_per_call(len(lengths))
    return [rows[i : i + per_call] for i in range(0, len(rows), per_call)]


# --- a streamed chunk's packed scoring (scoring.stream): one budget per call ---


def chunk_budget(num_slots: int, chunk_width: int) -> tuple[int, int]:
    """(N rows, M tokens) of every packed call of a streamed chunk of S slots x C columns:
    M = pow2(S·C / ``CHUNK_SPLIT``), at least C; N = min(S, 4·M / C), rows for slots with
    fewer than C new tokens (the long tail's ends, a carried slot's first chunk), so short
    slots share a call; rows beyond M / C attend over padding only, a small share of a scorer
    chunk's FLOPs (docs/PROJECTIONS.md, "Few programs").

    Example: S 24, C 16 -> (4, 16); S 120, C 256 -> (16, 1024); S 64, C 32 -> (8, 64).
    """
    whole = num_slots * chunk_width
    tokens = max(pow2_at_least(whole / CHUNK_SPLIT), chunk_width)
    return min(num_slots, max(1, 4 * tokens // chunk_width)), tokens


def chunk_groups(counts, chunk_width: int) -> list[list[int]]:
    """The slots with new tokens (``counts`` [S], each at most C) dealt to the chunk's packed
    calls, first-fit decreasing (``first_fit_decreasing``) within ``chunk_budget``'s M tokens
    and N rows a call; [] when no slot has a token.

    Example: counts [16, 0, 4, 4, 16, 3, 0, 0], C 16 (budget (2, 16)) -> [[0], [4], [2, 3],
    [5]].
    """
    counts = np.asarray(counts)
    rows, tokens = chunk_budget(counts.shape[0], chunk_width)
    live = np.flatnonzero(counts > 0)
    bins = first_fit_decreasing(counts[live], tokens, max_items=rows)
    return [sorted(int(live[i]) for i in b) for b in bins]


# --- the packed update (ppo.packing): chunks of one height, as many as a minibatch can need ---


def packed_width(full_width: int, granule: int, factor: int = 1) -> int:
    """W: ``factor`` x the padded width L rounded up to a multiple of ``granule`` (the longest
    sequence fits one row; with factor k any k do). Example: L 48, granule 16 -> 48; L 50 ->
    64; L 50, factor 2 -> 112."""
    return -(-factor * full_width // granule) * granule


# An update chunk holds pow2(m / UPDATE_SPLIT) rows (m sequences a microbatch), at least one:
# the last chunk of a minibatch is the only one partly padding, under Rp rows. 64: one row for
# m up to 64 (the 7B configs' 2 and 4, the demo's 16), two at 112; taller chunks pad the last
# one more (docs/PROJECTIONS.md, "Few programs").
UPDATE_SPLIT = 64


def update_row_cap(num_seqs: int, row_multiple: int = 1, width_factor: int = 1) -> int:
    """Rows of the padded microbatch's tokens: m / k rows of k·L, in whole shards. Example:
    m 16 -> 16; m 3, k 2 -> 2; m 3, shards 2 -> 4."""
    rows = -(-num_seqs // width_factor)
    return -(-rows // row_multiple) * row_multiple


def update_chunk_rows(num_seqs: int, row_multiple: int = 1, width_factor: int = 1) -> int:
    """Rp, the rows of every packed update chunk: pow2(cap / ``UPDATE_SPLIT``) in whole shards,
    at most ``update_row_cap`` (no chunk computes more than the padded microbatch the config
    sized its memory for). Example: m 16 -> 1; m 112 -> 2; m 64, shards 4 -> 4."""
    cap = update_row_cap(num_seqs, row_multiple, width_factor)
    units = pow2_at_least(-(-num_seqs // width_factor) / (UPDATE_SPLIT * row_multiple))
    return min(cap, units * row_multiple)


def update_chunks(
    num_seqs: int, chunks: int = 1, row_multiple: int = 1, width_factor: int = 1
) -> int:
    """K, the chunks a minibatch of ``chunks`` (A) microbatches of ``num_seqs`` (m) sequences is
    dealt to: enough Rp-row chunks for the ceil(A·m / k) rows first-fit decreasing can need
    (any k sequences fit a row of k·L); a chunk holding no sequence does not run. Example:
    m 16, A 1 -> 16; m 2, A 56 -> 112."""
    rows = -(-chunks * num_seqs // width_factor)
    return -(-rows // update_chunk_rows(num_seqs, row_multiple, width_factor))
