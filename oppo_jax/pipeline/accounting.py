"""A step's record of its dispatches: per stage, the tokens its kernels computed and the real
tokens in them (``WorkLedger``), and each dispatch's timeline mark, both written by one
dispatch wrapper (``StepRecorder.dispatched``, which every ``Kernels`` method that dispatches a
program calls once).

Each dispatch records its own work in the step's ``WorkLedger``: the *computed* tokens come
from the shapes of the arrays the kernel is handed (so a kernel that changes its shapes — a
packed update, scoring at real widths, compacted decode slots — changes the count without
touching this module), the *real* tokens from the valid tokens in them (host-side lengths). A
decode chunk's work is known once the rollout has stopped (the chunk at the cut runs fewer
steps): each dispatch logs its slots and width (``decode_chunk``), and ``close_decode`` prices
them. A token
counts once per model pass over it, so the ratio ``efficiency = real / computed`` is what a
stage spends on real work:

    admission  every model's prefill of the slots' prompts and replay of carried prefixes
               (actor + each scorer); real: prompt + prefix tokens of the occupied slots
               for trained models, only new prompts' tokens for the frozen scorers
    decode     one token per slot per lockstep decode step; real: tokens the running slots
               sampled (a finished or empty slot's step is padding)
    scoring    every scorer's prefill of the response tokens (streamed chunks, or the one
               call after the rollout); real: the response tokens fed
    update     PPO epochs × trained models × the batch's token array; real: prompt + response
               tokens of the batch's sequences

``metrics.jsonl`` and ``bench.json`` carry ``tokens_computed``, ``tokens_real`` and
``efficiency`` per stage (``WorkLedger.to_record``). Plain Python and NumPy: no JAX (the
timeline's markers are opaque here).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oppo_jax.models.attention import ragged_decode
from oppo_jax.models.ragged_decode import block_for

STAGES = ("admission", "decode", "scoring", "update")


class StepRecorder:
    """The run's one dispatch wrapper for bookkeeping: every ``Kernels`` method that dispatches
    a program reports it here once (``dispatched``: its timeline mark and its tokens), so the
    step's orchestration (``run_step``, the decode loop, the scorers) records nothing itself.

    ``start`` opens a step's record (its ``Timeline`` and a fresh ``WorkLedger``, returned)
    and ``stop`` closes it. Outside a step (the warm-up, an evaluation between steps) nothing
    is recorded, so a finished step's ledger never changes after it was returned."""

    def __init__(self):
        self.timeline = None  # pipeline.timeline.Timeline of the open step, or None
        self.work: WorkLedger | None = None
        self.groups: dict[str, str] = {}  # "generation" / "scoring" -> the device group's name

    def start(self, timeline, generation_group: str, scoring_group: str) -> WorkLedger:
        """Open a step's record (``timeline.begin_step``); the dispatches of the actor go to
        the ``generation_group``, the scorers' to the ``scoring_group``. Returns its ledger."""
        timeline.begin_step()
        # Every stage listed, 0 where a schedule dispatched none (reward functions alone).
        zeros = dict.fromkeys(STAGES, 0)
        self.timeline, self.work = timeline, WorkLedger(dict(zeros), dict(zeros))
        self.groups = {"generation": generation_group, "scoring": scoring_group}
        return self.work

    def stop(self) -> tuple[list, float]:
        """Close the step's record (later dispatches are not recorded): the timeline's
        (events, wall seconds) of the step (``Timeline.end_step``)."""
        timeline, self.timeline, self.work = self.timeline, None, None
        return timeline.end_step()

    def dispatched(self, stage: str, marker, on: str = "generation", tokens=None) -> None:
        """Record a program dispatched for ``stage``: its ``marker`` (an array completing
        with it) on the timeline of device group ``on`` ("generation" or "scoring") and
        ``tokens`` = (ledger stage, computed, real) in the ledger (None: none to count)."""
        if self.timeline is None:
            return
        self.timeline.track(stage, self.groups[on], marker)
        if tokens is not None:
            self.work.add(*tokens)

    def decode_chunk(self, slots: int, width: int) -> None:
        """Log a decode chunk's slots and cache width (``WorkLedger.decode_chunk``)."""
        if self.work is not None:
            self.work.decode_chunk(slots, width)


@dataclasses.dataclass
class WorkLedger:
    """Tokens computed and real tokens per stage of one step (module docstring)."""

    computed: dict[str, int] = dataclasses.field(default_factory=dict)
    real: dict[str, int] = dataclasses.field(default_factory=dict)
    # The decode's attention, in cache keys read: (computed, real); see ``decode_keys``.
    keys: tuple[int, int] | None = None
    # (slots, cache columns read) of each decode chunk dispatched
    decode_chunks: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def add(self, stage: str, computed: int, real: int = 0) -> None:
        """Add a dispatch's tokens to ``stage`` (a stage may be added to many times)."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        self.computed[stage] = self.computed.get(stage, 0) + int(computed)
        self.real[stage] = self.real.get(stage, 0) + int(real)

    def decode_chunk(self, slots: int, width: int) -> None:
        """Log a decode chunk dispatched over ``slots`` slots reading ``width`` cache columns
        (plain host ints: nothing is computed in the decode loop)."""
        self.decode_chunks.append((int(slots), int(width)))

    def close_decode(self, steps: int, chunk_size: int, lengths: tuple, actor) -> None:
        """Price the logged decode chunks once the rollout ran ``steps`` lockstep steps:
        ``lengths`` is (prompt_len, prefix_len, num_generated) per slot; ``actor`` (a
        ModelConfig) decides where the ragged kernel's key blocks apply (``ragged_key_block``)."""
        slots, widths = (list(c) for c in zip(*self.decode_chunks, strict=True))
        blocks = [ragged_key_block(actor, w) for w in widths]
        new = generated(lengths[2], lengths[1])
        self.add("decode", decode_computed(slots, steps, chunk_size), new)
        self.keys = decode_keys(slots, widths, steps, chunk_size, lengths, blocks)

    def close_refill_decode(self, steps: int, chunk_size: int, real: int) -> None:
        """Price a refilling rollout's decode chunks as ``close_decode`` does; ``real``: the
        tokens its samples sampled in the step (a row holds several samples a step, so its
        length does not say). Its keys are not counted."""
        slots = [s for s, _ in self.decode_chunks]
        self.add("decode", decode_computed(slots, steps, chunk_size), real)

    def efficiency(self, stage: str) -> float | None:
        """real / computed of ``stage``; None when it computed nothing."""
        computed = self.computed.get(stage, 0)
        return self.real.get(stage, 0) / computed if computed else None

    def to_record(self) -> dict:
        """``{"tokens_computed": {...}, "tokens_real": {...}, "efficiency": {...}}`` over the
        stages this step ran (JSON-ready)."""
        stages = [s for s in STAGES if s in self.computed]
        record = {
            "tokens_computed": {s: self.computed[s] for s in stages},
            "tokens_real": {s: self.real[s] for s in stages},
            "efficiency": {s: self.efficiency(s) for s in stages},
        }
        if self.keys is not None:  # {"computed", "real", "efficiency"} of the decode's keys
            computed, real = self.keys
            ratio = real / computed if computed else None
            record["decode_keys"] = {"computed": computed, "real": real, "efficiency": ratio}
        return record


def admission_computed(num_slots: int, prompt_width: int, replay=(), shared: int = 1) -> int:
    """Tokens one model's admission computes: every slot's prompt at the prompt width P, each
    group of ``shared`` slots' once (``rollout.admission.prompt_prefill``), then each chunk of
    the carried prefixes' ``replay`` over its leading rows (``scoring.carried``). Example: S 8,
    P 16, one replay chunk of 4 rows x 64 -> 8·16 + 256 = 384; groups of 2: 4·16 + 256."""
    prompts = num_slots // shared * prompt_width
    return prompts + sum(chunk.computed_tokens for chunk in replay)


def admission_real(
    prompt_len, prefix_len, active, carrying, trained: int, frozen: int, shared: int = 1
) -> int:
    """Real admission tokens over all models: a trained model (actor, critic: new parameters)
    must prefill each occupied slot's prompt + carried prefix; a frozen scorer (reference,
    reward model) only the new prompts' tokens, since a carried row's cache from an earlier
    step stays exact for it (the token-proportional engine keeps it). With groups of
    ``shared`` slots sharing a prompt (``SlotBatch.shared_prompts``), a prompt counts once."""
    occupied = np.asarray(active, bool)
    prompt, prefix = np.asarray(prompt_len), np.asarray(prefix_len)
    once = np.arange(len(prompt)) % shared == 0  # each group's first slot
    prompts = int(prompt[occupied & once].sum())
    full = prompts + int(prefix[occupied].sum())
    fresh = int(prompt[occupied & once & ~np.asarray(carrying, bool)].sum())
    return trained * full + frozen * fresh


def decode_computed(slots_per_chunk: list[int], steps: int, chunk_size: int) -> int:
    """Slot-steps of a rollout that ran ``steps`` lockstep steps in chunks of ``chunk_size``,
    chunk j over ``slots_per_chunk[j]`` slots: every chunk runs C steps until the cut, where
    the while_loop stops (later chunks run none). Example: [8, 8, 4], 20 steps, C 8 ->
    8·8 + 8·8 + 4·4 = 144."""
    return sum(
        s * int(np.clip(steps - j * chunk_size, 0, chunk_size))
        for j, s in enumerate(slots_per_chunk)
    )


def decode_keys(
    slots_per_chunk: list[int],
    widths: list[int],
    steps: int,
    chunk_size: int,
    lengths: tuple,
    key_blocks: list[int | None] | None = None,
) -> tuple[int, int]:
    """(computed, real) cache keys the decode's attention read. Computed: chunk j reads
    ``widths[j]`` cache columns (its live width, or the capacity) per slot per step it ran;
    or, where ``key_blocks[j]`` is set (the ragged kernel, ``models.ragged_decode``), each
    fed row its own keys rounded up to whole blocks of that size, and a finished row none.
    Real: a token sampled at response index t of a slot with prompt length p is fed at
    position p + t and needs the p + t + 1 keys up to it; ``lengths`` is (prompt_len,
    prefix_len, num_generated) per slot. Example: [8, 8], widths [16, 32], 12 steps, C 8 ->
    computed 8·8·16 + 8·4·32 = 2048; one slot, prompt 2, prefix 0, 3 tokens -> real 3+4+5 = 12
    (ragged, blocks of 4: 4 + 4 + 8 = 16).
    """
    prompt, first, end = (np.asarray(x, np.int64) for x in lengths)
    blocks = key_blocks or [None] * len(widths)
    computed = 0
    for j, (s, w, block) in enumerate(zip(slots_per_chunk, widths, blocks, strict=True)):
        ran = int(np.clip(steps - j * chunk_size, 0, chunk_size))
        if block is None:
            computed += s * w * ran
            continue
        # Lockstep step i feeds response index first + i of a slot still running (i below
        # end - first): contexts p + first + i + 1 for the chunk's steps.
        lo = np.minimum(j * chunk_size, end - first)
        hi = np.minimum(j * chunk_size + ran, end - first)
        base = prompt + first
        computed += int(np.sum(_block_keys(base + hi, block) - _block_keys(base + lo, block)))
    # sum over t in [first, end) of (prompt + t + 1)
    n = np.maximum(end - first, 0)
    real = int(np.sum(n * (prompt + 1) + (first + end - 1) * n // 2))
    return computed, real


def ragged_key_block(actor, width: int) -> int | None:
    """The ragged kernel's key block for a decode chunk of live width ``width`` where the
    ``actor``'s (a ModelConfig) decode steps run it (``models.attention.ragged_decode``), else
    None (every slot reads the whole width)."""
    return block_for(width) if ragged_decode(actor.attention, actor.head_dim, width) else None


def _block_keys(upto, block: int):
    """Σ_{x=1}^{upto} ceil(x / block) · block: the keys whole-block reads take over contexts
    1 .. upto (elementwise). Example: block 4, upto 6 -> 4·4 + 2·8 = 32."""
    q, r = upto // block, upto % block
    return block * (block * q * (q + 1) // 2 + r * (q + 1))


def generated(num_generated, prefix_len) -> int:
    """Response tokens sampled this step (each slot's length less what it carried in)."""
    return int((np.asarray(num_generated) - np.asarray(prefix_len)).sum())
