"""The decode loop of one step: decode chunks until the cut rule holds, handing each chunk to
the step's scorers as it is done, and compacting the running slots as others finish.

Plain Python that dispatches ``Kernels.decode`` and never waits on it, except for one small
read per chunk (may the rollout be cut? how many slots still run? and, when streaming, the
chunk's token count per slot, which packs its scoring), read one chunk late so the actor's
queue never drains while the host looks.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np

from oppo_jax.parallel.sharding import to_host
from oppo_jax.pipeline.accounting import WorkLedger
from oppo_jax.pipeline.kernels import Kernels
from oppo_jax.pipeline.placement import GENERATION
from oppo_jax.pipeline.slot_map import SlotMap
from oppo_jax.pipeline.step_scorers import StepScorers
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.rollout.decode import CutRule, DecodeState


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How a step decodes: its cut rule, chunk size C and the longest context admitted (the
    live widths start there, ``Kernels.chunk_width``)."""

    rule: CutRule
    chunk_size: int
    longest_context: int


def decode_rollout(
    kernels: Kernels,
    timeline: Timeline,
    work: WorkLedger,
    params,
    state: DecodeState,
    chunking: Chunking,
    scorers: StepScorers | None = None,
) -> DecodeState:
    """Decode until the cut rule allows the cut. With ``scorers`` (streaming), each chunk is
    fed to them once it is done (``StepScorers.feed``), in the admission's slot layout, with
    the live width it was decoded at and its token counts (read with the loop's flag, once the
    next chunk is dispatched). Each chunk dispatched is logged in ``work``
    (``WorkLedger.decode_chunk``).

    Chunk i reads the cache's live prefix, sized on the host from the admitted lengths and i
    alone (``Kernels.chunk_width``). Where the kernels compact (``Kernels.compaction_floor``),
    the rows still running move into smaller slot buckets as the others finish
    (``pipeline.slot_map``), decided from their count, which the loop's one read per chunk
    carries; the state comes back in the admission's layout."""
    rule, size = chunking.rule, chunking.chunk_size
    floor = kernels.compaction_floor
    slot_map = None if floor is None else SlotMap(state.tokens.shape[0], minimum=floor)
    capacity = kernels.rollout.prompt_width + kernels.rollout.max_response_len

    def dispatch(i, state, rule):
        width = kernels.chunk_width(chunking.longest_context, size, i)
        read = capacity if width is None else width
        work.decode_chunk(state.tokens.shape[0], read)
        state, chunk = kernels.decode(size, width)(params, state, rule)
        timeline.track("decode", GENERATION, chunk.count)
        return state, chunk, width

    state, chunk, width = dispatch(0, state, rule)
    for i in itertools.count(1):
        last, last_width = chunk, width
        state, chunk, width = dispatch(i, state, rule)  # dispatched before the host reads
        if scorers is None:
            running = int(jax.device_get(last.running))  # the loop's only read: -1 once ready
        else:  # streaming: the chunk's counts with it (one transfer), then it is scored
            full = last if slot_map is None else slot_map.full_chunk(last)
            # to_host: on several processes the counts are sharded over their slots.
            running, counts = to_host((full.running, full.count))
            running = int(running)
            scorers.feed(full, last_width, np.asarray(counts))
        if running < 0:
            return state if slot_map is None else slot_map.restore(state)
        if slot_map is not None:
            state, chunk, rule = slot_map.maybe_compact(running, last.finished, state, chunk, rule)
