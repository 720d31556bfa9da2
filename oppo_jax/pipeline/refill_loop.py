"""The decode loop of a refilling rollout (issue 44): refill points every ``every`` positions,
where the host harvests finished rows, places waiting and new samples into the free ones
(``pipeline.refill.Pool`` decides, from the finish positions it reads) and hands the device
the stop rule for the next interval; between two points the actor decodes ``every / C``
chunks with no read, stopping at the cut wherever it falls.

Chunk size: refill points sit at multiples of ``every``, a multiple of C, and the decode of
an interval does not depend on how it is chunked, so C changes no token and no decision.

The programs it adds (each recorded by the step's ``StepRecorder`` like every kernel): the
store prefill of the groups admitted at a point (``refill_prompts``, Q groups in a
power-of-four bucket, ``shapes.pow4_bucket``) and the placement of samples into rows
(``refill_place``, M rows in a power-of-four bucket, the rows given as data).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oppo_jax.base.shapes import pow4_bucket
from oppo_jax.parallel.sharding import to_host, tracing_rules
from oppo_jax.pipeline.kernels import Kernels, kernel_jit
from oppo_jax.pipeline.refill import Group, Placement, Pool
from oppo_jax.rollout.decode import CutRule, DecodeState
from oppo_jax.rollout.refill import PromptStore, empty_rows, place_samples, prefill_store


@kernel_jit("cfg", "rollout", "rows")
def oppo_refill_prompts(params, prompts, prompt_len, prompt_id, *, cfg, rollout, rows):
    """``prefill_store`` of Q prompts into a store of ``rows`` rows: (PromptStore, marker).
    One program per Q bucket; every store has one shape."""
    with tracing_rules(rollout.mesh):
        store = prefill_store(cfg, params, prompts, prompt_len, prompt_id, rollout, rows)
        return store, store.cache.length + 0


@kernel_jit("rollout", donate=("state",))
def oppo_refill_place(state, store, rows, source, sample_index, *, rollout):
    """``place_samples`` into M rows, donating the state: (state, marker)."""
    with tracing_rules(rollout.mesh):
        state = place_samples(state, store, rows, source, sample_index, rollout)
        return state, state.num_generated + 0


@kernel_jit("cfg", "rollout", "rows")
def oppo_refill_start(base_key, *, cfg, rollout, rows):
    """``empty_rows``: the state a refilling rollout starts from."""
    with tracing_rules(rollout.mesh):
        return empty_rows(cfg, rollout, rows, base_key)


# Prompt stores alive at once, at most: the one whose group still waits with samples unplaced
# (a group is admitted only while rows are free, so only the last one admitted can wait) and
# the one a refill point prefills before placing; ``Stores.forget_placed`` then drops the first.
STORES_HELD = 2


@dataclasses.dataclass
class Stores:
    """The prompt stores of groups with samples still waiting for a row: gid -> (store, its
    index in the store); ``STORES_HELD`` at most."""

    rows: int  # rows of every store (``RefillRule.store_rows``)
    of: dict[int, tuple[PromptStore, int]] = dataclasses.field(default_factory=dict)

    def forget_placed(self, pool: Pool) -> None:
        """Drop the stores no waiting sample needs any more (their buffers go)."""
        waiting = {g.gid for g in pool.groups if any(s.waiting for s in g.samples)}
        self.of = {gid: v for gid, v in self.of.items() if gid in waiting}


def start_rows(k: Kernels, base_key, rows: int) -> DecodeState:
    """A refilling run's first decode state: ``rows`` empty rows."""
    return oppo_refill_start(base_key, cfg=k.spec.actor, rollout=k.rollout, rows=rows)


def prefill_groups(k: Kernels, params, groups: list[Group], stores: Stores) -> None:
    """Prefill the prompts of the groups admitted at a refill point, once each, in a
    power-of-four bucket (the padding rows hold empty prompts), into one store of
    ``stores.rows`` rows."""
    if not groups:
        return
    most = stores.rows
    if len(groups) > most:  # Pool's admission keeps it within RefillRule.store_rows
        raise RuntimeError(f"refill: {len(groups)} prompts to prefill at once, room for {most}")
    r, q = k.rollout, pow4_bucket(len(groups), most)
    prompts = np.full((q, r.prompt_width), r.pad_id, np.int32)
    prompt_len, prompt_id = np.zeros(q, np.int32), np.zeros(q, np.int32)
    for i, g in enumerate(groups):
        prompts[i, : len(g.prompt)] = g.prompt
        prompt_len[i], prompt_id[i] = len(g.prompt), g.prompt_id
    k.planned("refill prompts", (q,))
    # host arrays straight into the program: the jit's own transfer (a device_put first costs
    # about 0.1 ms of the host's time on the CPU, each refill point)
    statics = dict(cfg=k.spec.actor, rollout=r, rows=most)
    store, marker = oppo_refill_prompts(params, prompts, prompt_len, prompt_id, **statics)
    real = int(prompt_len.sum())
    k.recorder.dispatched("prefill actor", marker, tokens=("admission", q * r.prompt_width, real))
    for i, g in enumerate(groups):
        stores.of[g.gid] = (store, i)


def place(k: Kernels, state: DecodeState, placed: list[Placement], stores: Stores):
    """Place the samples of ``placed`` into their rows: one call per store they come from, of
    a power-of-four bucket of rows (padding entries name row S: dropped)."""
    by_store: dict[int, list[tuple[Placement, int]]] = {}
    held: dict[int, PromptStore] = {}
    for p in placed:
        store, index = stores.of[p.gid]
        by_store.setdefault(id(store), []).append((p, index))
        held[id(store)] = store
    s = state.tokens.shape[0]
    for key, entries in by_store.items():
        m = pow4_bucket(len(entries), s)
        rows, source, sample = np.full(m, s, np.int32), np.zeros(m, np.int32), np.zeros(m, np.int32)
        for i, (p, index) in enumerate(entries):
            rows[i], source[i], sample[i] = p.row, index, p.sample_index
        k.planned("refill place", (m,))
        args = (rows, source, sample)  # host arrays: the jit transfers them (prefill_groups)
        state, marker = oppo_refill_place(state, held[key], *args, rollout=k.rollout)
        k.recorder.dispatched("admit rows", marker)
    return state


def harvest(state: DecodeState, pool: Pool, step: int, replayed: bool):
    """Read the rows' finish flags; every held row whose sample has finished leaves its response
    to the pool, which frees the row (one small read, and the rows' tokens when any finished).
    ``replayed``: this step's admission replayed the rows' earlier tokens. Returns each row's
    context length (the cache's, read with the flags) and the (group, sample) pairs that
    ended."""
    finished, finish_step, context = map(
        np.asarray, to_host((state.finished, state.finish_step, state.cache.length))
    )
    held = pool.holder()
    done = [row for row in held if finished[row]]
    if done:
        read_rows(state, {row: held[row][1] for row in done}, step, replayed)
        for row in done:
            pool.harvest(row, int(finish_step[row]))
    return context, [held[row] for row in done]


def read_rows(state: DecodeState, samples: dict, step: int, replayed: bool) -> None:
    """Each row's response so far into its sample (``samples``: row -> Sample)."""
    tokens, logprobs, n = map(
        np.asarray, to_host((state.tokens, state.logprobs, state.num_generated))
    )
    for row, sample in samples.items():
        sample.read(step, tokens[row, : n[row]], logprobs[row, : n[row]], replayed)


def interval_rule(pool: Pool, step: int) -> CutRule:
    """The device's stop rule until the next refill point (``Pool.cut_rule``)."""
    active, must, target, group = pool.cut_rule(step)
    return CutRule(active, must, np.int32(target), group)  # host arrays: the decode places them


def longest_context(context: np.ndarray, pool: Pool, placed: list[Placement]) -> int:
    """The longest context (prompt + response) of a held row: ``context`` as read at the refill
    point, a row placed there its prompt's."""
    now = {row: int(context[row]) for row in pool.holder()}
    groups = {g.gid: g for g in pool.groups}
    now.update({p.row: len(groups[p.gid].prompt) for p in placed})
    return max(now.values(), default=1)


@dataclasses.dataclass
class Rollout:
    """What a refilling run's rollout carries from step to step: the decode rows, the pool
    that says what each holds, and the stores of groups still waiting for rows."""

    state: DecodeState | None  # None: not started, or resumed (the rows are rebuilt)
    pool: Pool
    stores: Stores | None = None  # None: empty ones of the pool's ``store_rows``
    # reward functions started as samples ended (a streaming schedule's ``on_end``):
    # (gid, sample index) -> (tokens, future); not checkpointed (a resume submits at the cut)
    ended: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.stores is None:
            self.stores = Stores(self.pool.rule.store_rows)


def refill_rollout(
    k: Kernels,
    params,
    run: Rollout,
    step: int,
    prompts,
    chunk_size: int,
    replayed=True,
    on_end=None,
) -> None:
    """Decode step ``step``'s rollout with refill points until the batch can be taken
    (``Pool.cut_ready``), leaving ``run`` at the cut (rows still decoding keep their place for
    the next step, their responses so far read into their samples). ``prompts.take(k)`` ->
    [(prompt_id, tokens)] gives the new groups' prompts, in admission order. ``replayed``:
    the step began by replaying the rows' earlier tokens under ``params`` (carry_kv replay).
    ``on_end(group, sample)``: called for each sample that ended, at the refill point that
    harvests it, before the next interval is dispatched."""
    pool, stores, state = run.pool, run.stores, run.state
    every = pool.rule.every
    if every % chunk_size:
        raise ValueError(f"refill every {every} tokens: not a multiple of C = {chunk_size}")
    while True:
        context, ended = harvest(state, pool, step, replayed)
        for group, sample in ended if on_end is not None else ():
            on_end(group, sample)
        if pool.cut_ready(step):  # rows decoding on: their responses so far, for the carry
            read_rows(state, {row: x for row, (_, x) in pool.holder().items()}, step, replayed)
            run.state = state
            return
        placed, _ = pool.refill(step, prompts)
        # the groups admitted here, and waiting ones whose prompts a replay left unprefilled
        unstored = {p.gid for p in placed if p.gid not in stores.of}
        prefill_groups(k, params, [g for g in pool.groups if g.gid in unstored], stores)
        state = place(k, state, placed, stores)
        stores.forget_placed(pool)
        if not pool.holder():
            raise RuntimeError("refill: no row decodes and the batch cannot be taken")
        rule, longest = interval_rule(pool, step), longest_context(context, pool, placed)
        for i in range(every // chunk_size):
            width = k.chunk_width(longest, chunk_size, i)
            state, _ = k.decode_tokens(params, state, rule, chunk_size, width)
        run.state = state  # donated on: the run holds the live one
