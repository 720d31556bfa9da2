"""The warm-up of slot compaction (``pipeline.slot_map``): every smaller slot bucket a step's
decode can move into, with the gathers and scatters of the move and the decode and scorer
programs at that bucket, run once on throwaway states before the run measures anything.

A step starts at the admission's S slots and, as slots finish, moves the running ones into the
power-of-two buckets ``compaction_moves`` lists (each move halves the bucket at least), then
scatters them back into S slots when the rollout ends. Each move is a handful of small gathers
and scatters over the decode state, the chunk, the cut rule and the scorers' states, and each
bucket has its own decode programs (one per chunk size and live width), and scorer-chunk
programs too unless the scorers pack their chunks (then they stay in the S-slot layout and
only the scatter of each chunk back into it is compiled per bucket). The
warm-up walks S -> n -> b for every reachable pair (n, b) with the very ``SlotMap`` the step
uses, so the same programs, with the same input shardings, are compiled.
"""

from __future__ import annotations

import copy
import types

import jax
import jax.numpy as jnp

from oppo_jax.pipeline.compile_plan import compaction_moves
from oppo_jax.pipeline.scoring_kernels import packs_chunks
from oppo_jax.pipeline.slot_map import SlotMap
from oppo_jax.rollout.decode import CutRule
from oppo_jax.scoring.stream import ScorerStates


class _Scorers(types.SimpleNamespace):
    """What ``SlotMap`` needs of the step's scorers: their ``states`` (None: not streaming)."""


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)  # decode and scorer chunks donate their state


def _feed(run, states, chunk, width):
    """Every scorer's chunk prefill of ``chunk`` reading ``width`` columns (states donated)."""
    k, place = run.engine.kernels, run.engine.placement
    params = run.scorer_params
    on_scoring, w = place.to_scoring(chunk), () if width is None else (width,)
    return states.replace(
        **{
            r: k.scorer_chunk(r, *w)(params[r], getattr(states, r), on_scoring)[0]
            for r in k.scorer_specs.present()
        }
    )


def _chunk(run, state, rule, states, size, width):
    """One decode chunk (and its scorer feed when streaming): (state, chunk, states)."""
    w = () if width is None else (width,)
    state, chunk = run.engine.kernels.decode(size, *w)(run.actor, _copy(state), rule)
    if states is not None:
        states = _feed(run, _copy(states), chunk, width)
    return state, chunk, states


def _at_bucket(run, moved, pairs, slot_map: SlotMap, scorers) -> None:
    """Every decode (and scorer) program at a bucket, from the moved state and from a decode's
    output (the step meets both input layouts), then the scatter back and the chunk's
    full-layout copy."""
    state, chunk, rule = moved
    if scorers.states is not None:  # the chunk moved with the slots is streamed next
        for _, width in pairs:
            _feed(run, _copy(scorers.states), chunk, width)
    out = None
    for size, width in pairs:
        once = _chunk(run, state, rule, scorers.states, size, width)
        out = _chunk(run, once[0], rule, once[2], size, width)
        jax.block_until_ready(out)
    if run.engine.rewards is not None or run.full_chunks:  # consumers in the slot layout:
        slot_map.full_chunk(out[1])  # reward functions, and scorers that pack their chunks
    done = copy.copy(slot_map)
    jax.block_until_ready(done.restore(out[0], _Scorers(states=out[2])))


def compile_compaction(ctx, schedule, host, state, admission, widths: dict) -> int:
    """Compile every slot-compaction move and bucket of a step (``admission``: a throwaway one
    of the step's S slots; ``widths``: chunk size -> the live widths its decode can read).
    Returns the number of moves run (0 when the run does not compact)."""
    engine = ctx.engine
    k, place = engine.kernels, engine.placement
    floor = k.compaction_floor(place.num_slots(1))
    if floor is None:
        return 0
    # Scorers that pack their chunks stay in the admission's layout (pipeline.slot_map): only
    # the scatter of each chunk back into it is new at a bucket, not their programs.
    moves_scorers = schedule.stream and not packs_chunks(engine)
    run = types.SimpleNamespace(
        engine=engine,
        actor=state.actor_model_params,
        scorer_params=scorer_params(ctx, state),
        full_chunks=schedule.stream and not moves_scorers,
    )
    decoding, _ = k.admit(run.actor, admission, engine.sample_key, ())  # new prompts only
    target = jnp.int32(host.plan(ctx.cfg).batch_size)
    rule = CutRule(admission.active, admission.must_finish, target)
    states = _streamed_states(run, place.to_scoring(admission)) if moves_scorers else None
    moves = compaction_moves(admission.active.shape[0], floor)
    for size, size_widths in widths.items():  # a step decodes chunks of one size
        pairs = [(size, w) for w in size_widths]
        first = _chunk(run, decoding, rule, states, *pairs[0])
        _moves(run, moves, pairs, first, rule, floor)
    return len(moves) * len(widths)


def _moves(run, moves, pairs, first, rule, floor: int) -> None:
    """Walk every move from the first chunk's outputs ``first`` (state, chunk, states), into
    buckets of at least ``floor`` slots (``Kernels.compaction_floor``)."""
    slots = first[0].tokens.shape[0]
    reached = {slots: (SlotMap(slots, minimum=floor), first, rule)}
    for n, bucket in moves:
        slot_map, (dec, chunk, states_n), rule_n = reached[n]
        slot_map, scorers = copy.copy(slot_map), _Scorers(states=states_n)
        moved = slot_map.maybe_compact(bucket, chunk.finished, dec, chunk, rule_n, scorers)
        if bucket not in reached:
            _at_bucket(run, moved, pairs, slot_map, scorers)
            # The next move from this bucket starts after a decode there, as in a step.
            after = _chunk(run, moved[0], moved[2], scorers.states, *pairs[0])
            reached[bucket] = (slot_map, after, moved[2])


def _streamed_states(run, on_scoring) -> ScorerStates:
    k, params = run.engine.kernels, run.scorer_params
    roles = k.scorer_specs.present()
    return ScorerStates(**{r: k.scorer_admit(r)(params[r], on_scoring)[0] for r in roles})


def scorer_params(ctx, state) -> dict:
    """Role -> the parameters each scorer runs with, placed where the scorers run."""
    engine = ctx.engine
    k, place = engine.kernels, engine.placement
    critic = place.critic_for_scoring(k.spec.critic, state.critic_model_params)
    return {"reference": engine.ref_params, "critic": critic, "reward": engine.reward_params}
