"""What a step's kernels compute: the engines the simulator can model, feature by feature.

Four engines, one dataclass:

- ``fixed``: the fixed-shape engine before the token-proportional changes (``FEATURES``).
  The decode chunk is a ``lax.while_loop`` that stops exactly at the cut, so no decode step
  runs past it and the chunk dispatched before the host reads ``ready`` runs zero steps;
  everything else has fixed shapes: every admitted slot costs every decode step, attention
  reads the whole P + R cache, ``sync`` scores one [S, R] call, the update runs over
  [B, P + R], and carried rows are re-prefilled in all four models at admission (split: K
  carried rows at the wide context W, the rest at the prompt width P).
- ``built``: this project's engine as it runs now (``oppo_jax.pipeline.step.run_step``): the
  fixed engine with the ``FEATURES`` that have landed switched on (``BUILT`` below), at the
  shapes the engine's own planners pick (``sim.packing`` mirrors them).
- ``padded``: the engine before the while_loop: whole decode chunks plus one more (the host
  reads the cut one chunk late; that chunk ran C steps whenever a slot was still running).
  ``docs/benchmarks/bench.json`` was recorded with it, before the split admission too.
- ``active``: the token-proportional reference (DESIGN.md §3, "cost follows tokens"): finished
  slots stop costing, attention reads each slot's own context, every prefill and the update
  cost their real tokens, and the frozen scorers keep the caches of carried rows.

The engine changes toward token-proportional cost are switches (``FEATURES``): the first five
(packed update, sync scoring at real widths, live-prefix decode, slot compaction, kept scorer
caches), then those the projections showed OPPO needs beside them (``packed_chunk_scoring``:
streamed chunks scored over their real tokens, and the rest). ``BUILT`` switches on those
that landed; the others stay what-ifs (``--with``). The simulator, the projections and the
traces ``oppo-jax bench`` records (``trace.step_trace`` stamps ``BUILT``) follow ``BUILT``.
"""

from __future__ import annotations

import dataclasses
import json
import math

from oppo_tools.sim import packing

# The token-proportional engine changes, in the order they were planned.
FEATURES = (
    "packed_update",  # the update over the batch's real tokens, packed into rows
    "real_width_scoring",  # sync scoring at the real widths, not [S, R]
    "live_prefix_decode",  # decode attention over a power-of-two bucket of the live prefix
    "compact_slots",  # finished slots gathered away when the live ones fit in half the bucket
    "kept_scorer_caches",  # the frozen scorers keep carried rows' caches (no re-prefill)
    # Beyond the first five: what the simulator shows OPPO also needs (docs/PROJECTIONS.md):
    "packed_chunk_scoring",  # each streamed chunk's real tokens packed (pow2), not [S, C]
    "ragged_decode",  # each running row's decode attention reads its own context only
    # the packed update's attention visits each query block's own segment's key blocks only
    "segment_update_attention",
    # carried prefixes replayed after the prompt prefill in chunks at their own lengths, not
    # all carried rows prefilled at P + pow2(longest prefix)
    "replayed_admission",
    # each group's prompt prefilled once and its K and V copied to the group's other slots
    # (rollout.admission.prompt_prefill), where S is a multiple of G
    "shared_prompt_kv",
    # the update computes each group's prompt once, its G responses after it attending to it
    # (docs/SHARED_PREFIX_UPDATE.md: planned, not built)
    "shared_prefix_update",
)


@dataclasses.dataclass(frozen=True)
class Engine:
    """The shapes an engine's kernels run at, as switches (module docstring)."""

    name: str
    token_proportional: bool = False  # every stage costs its real tokens (the active engine)
    decode_to_cut: bool = True  # decode stops at the cut; False: whole chunks plus one more
    split_admission: bool = True  # carried rows at W, the rest at P; False: every slot at W
    packed_update: bool = False  # update over real tokens packed in rows of a pow2 length
    real_width_scoring: bool = False  # sync scores min(S x pow2(longest), packed real tokens)
    live_prefix_decode: bool = False  # attention over pow2(P + longest prefix + C), not P + R
    compact_slots: bool = False  # slots gathered into pow2(live) once live <= half the slots
    compact_min_slots: int = 1  # the smallest bucket compaction moves into (a power of two)
    kept_scorer_caches: bool = False  # reference and reward keep carried rows' caches
    # a streamed chunk's real tokens packed into calls of one token budget, over S slots
    # also once compacted (packing.chunk_tokens)
    packed_chunk_scoring: bool = False
    # decode attention per row over its own context (whole key blocks), finished rows none
    ragged_decode: bool = False
    ragged_key_block: int = packing.RAGGED_KEY_BLOCK  # keys a ragged row reads at a time
    # the update's attention skips key blocks above the diagonal (splash on a TPU, blocks of
    # CAUSAL_BLOCK); False: every key of a row (XLA's attention over query blocks)
    causal_update_attention: bool = False
    # the update's attention visits, per query block, the key blocks from its first query's
    # segment start to the diagonal, none for padding (models.segment_attention, a GPU)
    segment_update_attention: bool = False
    # the prompt prefill of every slot, then each carried prefix fed in chunks of REPLAY_CHUNK
    # over leading row buckets (scoring.carried; packing.replay_tokens); False: the split
    # admission (``split_admission``) or every slot at the carried width
    replayed_admission: bool = False
    # a prompt prefilled once per group of G slots (S a multiple of G), not once per slot
    shared_prompt_kv: bool = False
    # the update's items are groups: the prompt once, then its G responses (``sim.work.
    # update_work``); an item wider than a row splits, its prompt once per part
    shared_prefix_update: bool = False

    def with_features(self, names) -> Engine:
        """This engine with the named ``FEATURES`` switched on (a what-if of ``built``)."""
        names = [n for n in names if n]
        unknown = sorted(set(names) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown engine feature(s) {unknown}; expected some of {FEATURES}")
        names = [n for n in names if not getattr(self, n)]  # those already on: no new label
        if not names:
            return self
        label = "+".join([self.name, *sorted(names, key=FEATURES.index)])
        return dataclasses.replace(self, name=label, **dict.fromkeys(names, True))

    @property
    def features(self) -> tuple[str, ...]:
        """The ``FEATURES`` switched on."""
        return tuple(f for f in FEATURES if getattr(self, f))

    def describe(self) -> str:
        """One line: the name and what it computes."""
        if self.token_proportional:
            return f"{self.name} (token-proportional reference: cost follows real tokens)"
        decode = "decode stops at the cut" if self.decode_to_cut else "whole decode chunks + 1"
        if not self.split_admission and not self.replayed_admission:
            decode += ", every slot admitted at the carried width"
        on = ", ".join(self.features) or "none"
        return f"{self.name} (fixed shapes, {decode}; on: {on})"

    def to_dict(self) -> dict:
        """Plain JSON form (a trace's ``engine`` stamp)."""
        return dataclasses.asdict(self)


PADDED = Engine("padded", decode_to_cut=False)
FIXED = Engine("fixed")
# This engine as built: the FEATURES that landed (see the docstring): the packed update
# (624cce5), sync scoring at real widths and the frozen scorers' kept caches (d8a8bca), decode
# over the live prefix (a952db9), streamed chunks scored packed (scoring.stream: the
# token-wise layers over the chunk's real tokens in a pow2 bucket, attention over min(S, M)
# rows; the cost model prices tokens). Slot compaction (78de8d3) is on by default only on the CPU
# (``base.shapes.compaction_default``), so the accelerator projections leave it off and
# a recorded trace stamps what its run did (``trace.step_trace``). Carried prefixes are
# replayed at their own lengths after the prompt prefill (scoring.carried), and each group's
# prompt is prefilled once, its K and V copied to the group's other slots (7e10f72).
BUILT = Engine(
    "built",
    packed_update=True,
    real_width_scoring=True,
    live_prefix_decode=True,
    kept_scorer_caches=True,
    packed_chunk_scoring=True,
    replayed_admission=True,
    shared_prompt_kv=True,
)
# On a GPU and a TPU the decode step's attention runs the ragged kernel (models.ragged_decode:
# "auto" picks it there), so each running row reads its own keys and finished rows none (in
# blocks of 128 keys on a GPU, 1024 on a TPU); on a GPU the packed update's attention runs the
# segment kernel (models.segment_attention): ``built_for``.
ACTIVE = Engine("active", token_proportional=True, kept_scorer_caches=True, shared_prompt_kv=True)
ENGINES = {"built": BUILT, "active": ACTIVE, "fixed": FIXED, "padded": PADDED}


CAUSAL_BLOCK = 128  # splash attention's default query and key block


def built_for(backend: str) -> Engine:
    """The engine as built on ``backend`` ("gpu", "tpu", "cpu"): ``BUILT``, on a GPU with the
    ragged decode attention and the segment attention of the packed update (both Triton), and
    on a TPU with the ragged decode attention (Mosaic) and splash's causal update attention,
    the kernels ``model.attention=auto`` picks there."""
    if backend == "gpu":
        return dataclasses.replace(BUILT, ragged_decode=True, segment_update_attention=True)
    if backend == "tpu":
        return dataclasses.replace(
            BUILT,
            ragged_decode=True,
            ragged_key_block=packing.RAGGED_KEY_BLOCK_TPU,
            causal_update_attention=True,
        )
    return BUILT


def pow2(n: int | float, floor: int = 1) -> int:
    """The power of two >= ``n`` (and >= ``floor``). Example: 5 -> 8, 8 -> 8, 0 -> 1."""
    return max(floor, 1 << max(math.ceil(n) - 1, 0).bit_length())


def packed(total: int | float, longest: int | float) -> int:
    """Tokens computed when ``total`` real tokens are packed into rows of pow2(``longest``)
    (a row holds at least the longest sequence). Example: 100 tokens, longest 20 -> 4 x 32."""
    if total <= 0:
        return 0
    row = pow2(longest)
    return row * math.ceil(total / row)


def recorded_engine(traces: list[dict]) -> Engine:
    """The engine that recorded ``traces`` (``bench.json`` records' ``trace``).

    New traces carry an ``engine`` stamp. Older ones do not: one where a slot finished past
    the cut came from the padded engine (its whole chunks decoded past the cut); if slots were
    carried and none did, the decode stopped at the cut (fixed: unstamped traces predate the
    ``FEATURES``); otherwise (no carrying seen)
    the two decode alike and the padded engine is assumed. Traces without ``carried_rows``
    predate the split admission.
    """
    stamps = {json.dumps(t["engine"], sort_keys=True) for t in traces if "engine" in t}
    if stamps and (len(stamps) > 1 or any("engine" not in t for t in traces)):
        raise ValueError("traces from different engines: fit them apart")
    if stamps:
        return Engine(**json.loads(stamps.pop()))
    past_cut = any(f > t["cut"] for t in traces for f in t["finish"])
    carried = any(f < 0 for t in traces for f in t["finish"])
    engine = FIXED if carried and not past_cut else PADDED
    split = all("carried_rows" in t for t in traces)
    return dataclasses.replace(engine, split_admission=split)
