"""The warm-up of slot compaction (``pipeline.decode_loop``): every smaller slot bucket a step's
decode can move into, with the gathers and scatters of the move and the decode programs at
that bucket, run once on throwaway states before the run measures anything.

A step starts at the admission's S slots and, as slots finish, moves the running ones into the
power-of-two buckets ``compaction_moves`` lists (each move halves the bucket at least), then
scatters them back into S slots when the rollout ends. Each move is a handful of small gathers
over the decode state, the chunk and the cut rule, and each bucket has its own decode programs
(one per chunk size and live width). The chunks' consumers stay in the S-slot layout: at a
bucket only the scatter of each chunk back into it is new. The warm-up walks S -> n -> b for
every reachable pair (n, b) with the very ``SlotMap`` the step uses, so the same programs,
with the same input shardings, are compiled.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.pipeline.carry import prompt_sharing
from oppo_jax.pipeline.compile_plan import compaction_moves
from oppo_jax.pipeline.decode_loop import SlotMap
from oppo_jax.pipeline.step import critic_params, on_device
from oppo_jax.rollout.decode import CutRule


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)  # decode chunks donate their state


def _chunk(kernels, actor, state, rule, size, width):
    """One decode chunk on a copy of ``state``: (state, chunk)."""
    return kernels.decode_tokens(actor, _copy(state), rule, size, width)


def _at_bucket(kernels, actor, moved, pairs, slot_map: SlotMap, full_chunks: bool) -> None:
    """Every decode program at a bucket, from the moved state and from a decode's output (the
    step meets both input layouts), then the scatter back and the chunk's full-layout copy."""
    state, _, rule = moved
    out = None
    for size, width in pairs:
        once = _chunk(kernels, actor, state, rule, size, width)
        out = _chunk(kernels, actor, once[0], rule, size, width)
        jax.block_until_ready(out)
    if full_chunks:  # consumers in the slot layout: scorers, reward functions
        slot_map.full_chunk(out[1])
    jax.block_until_ready(copy.copy(slot_map).restore(out[0]))


def compile_compaction(ctx, schedule, host, state, admission, widths: dict) -> int:
    """Compile every slot-compaction move and bucket of a step (``admission``: a throwaway one
    of the step's S slots; ``widths``: chunk size -> the live widths its decode can read).
    Returns the number of moves run (0 when the run does not compact)."""
    engine = ctx.engine
    k = engine.kernels
    floor = k.compaction_floor
    if floor is None:
        return 0
    actor = state.actor_model_params
    full_chunks = schedule.stream or engine.rewards is not None
    g = prompt_sharing(admission.num_slots, k.rollout.group_size)  # as the step's admissions
    decoding, _ = k.prefill_actor(actor, admission, engine.sample_key, (), g)  # new prompts only
    target = on_device(host.plan(ctx.cfg).batch_size, np.int32)
    rule = CutRule(admission.active, admission.must_finish, target)
    moves = compaction_moves(admission.active.shape[0], floor)
    for size, size_widths in widths.items():  # a step decodes chunks of one size
        pairs = [(size, w) for w in size_widths]
        first = _chunk(k, actor, decoding, rule, *pairs[0])
        slots = first[0].tokens.shape[0]
        reached = {slots: (SlotMap(slots, minimum=floor), first, rule)}
        for n, bucket in moves:
            slot_map, (dec, chunk), rule_n = reached[n]
            slot_map = copy.copy(slot_map)
            moved = slot_map.maybe_compact(bucket, chunk.finished, dec, chunk, rule_n)
            if bucket not in reached:
                _at_bucket(k, actor, moved, pairs, slot_map, full_chunks)
                # The next move from this bucket starts after a decode there, as in a step.
                after = _chunk(k, actor, moved[0], moved[2], *pairs[0])
                reached[bucket] = (slot_map, after, moved[2])
    return len(moves) * len(widths)


def scorer_params(ctx, state) -> dict:
    """Role -> the parameters each scorer runs with, placed where the scorers run."""
    engine = ctx.engine
    critic = critic_params(engine, state)
    return {"reference": engine.ref_params, "critic": critic, "reward": engine.reward_params}
