"""Property tests of inter-step overlap bookkeeping over random lengths and schedules."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_jax.pipeline.carry import (
    AdmitRule,
    CarryBuffer,
    HostRollout,
    admit,
    carry_out,
    select_batch,
)
from tests.ppo_fixtures import ListPrompts

R = 24  # response capacity


def _simulate_step(slots, lengths, chunk, step):
    """Lockstep decoding of the admitted slots, stopped at the first chunk boundary where
    the cut rule holds. A sequence's total response length is fixed by its prompt id."""
    n = slots.num_slots
    remaining = np.array([
        max(min(lengths[slots.prompt_ids[i]], R) - slots.prefix_len[i], 0) if slots.active[i]
        else 0 for i in range(n)
    ])  # fmt: skip
    finish_at = np.where(slots.prefix_finished, 0, remaining)
    clock = 0
    while True:
        clock += chunk
        finish_step = np.where(slots.active & (finish_at <= clock), finish_at, -1)
        # The device's rule (CutRule) and the host's batch choice are one rule: the host can
        # choose a batch exactly when the device says the rollout may stop.
        if select_batch(finish_step, slots.active, slots.must_finish, _B) or clock > 4 * R:
            break
    num_generated = np.where(
        finish_step >= 0, slots.prefix_len + finish_at, slots.prefix_len + clock
    ).clip(max=R)
    tokens = np.zeros((n, R), np.int32)
    for i in range(n):
        tokens[i] = slots.prompt_ids[i] * 1000 + np.arange(R)  # token j of a prompt: id*1000+j
    logprobs = -np.ones((n, R), np.float32)
    selection = select_batch(finish_step, slots.active, slots.must_finish, _B)
    rollout = HostRollout(tokens, logprobs, num_generated, finish_step)
    carried = carry_out(slots, selection, rollout, step)
    return selection, carried


_B = 4


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3 * R), min_size=80, max_size=80),
    delta=st.integers(0, _B),
    max_deferrals=st.integers(1, 3),
    chunk=st.sampled_from([1, 3, 8, 32]),
    steps=st.integers(1, 12),
)
def test_every_prompt_once_none_lost_bounded_staleness(lengths, delta, max_deferrals, chunk, steps):
    prompts = ListPrompts([(i, [5, 6]) for i in range(len(lengths))])
    buffer = CarryBuffer()
    seen = []
    for step in range(steps):
        rule = AdmitRule(_B + delta, _B + delta, True, max_deferrals)
        slots = admit(buffer, prompts, rule, 2, R)
        # Carried sequences come first; the rows after them are new (or empty) and hold their
        # prompt only (the replay of prefixes runs over leading rows: scoring.carried).
        slots.check_carried_first()
        fresh = slice(int((slots.deferrals > 0).sum()), None)
        assert not slots.prefix_len[fresh].any() and not slots.prefix_finished[fresh].any()
        assert not slots.context[fresh, 2:].any() and slots.context.shape[1] == 2 + R
        selection, carried = _simulate_step(slots, lengths, chunk, step)
        assert selection is not None and len(selection.batch) == _B
        batch_ids = slots.prompt_ids[selection.batch].tolist()
        assert max(slots.deferrals[selection.batch]) <= max_deferrals
        carried_ids = {c.prompt_id for c in carried}
        assert not carried_ids & set(batch_ids)
        assert len(carried) == int(slots.active.sum()) - _B
        seen.extend(batch_ids)
        for c in carried:
            assert c.deferrals <= max_deferrals
            assert c.response == [c.prompt_id * 1000 + j for j in range(len(c.response))]
            assert len(c.behaviour_logp) == len(c.version) == len(c.response)
        buffer.extend(carried)
    in_flight = [c.prompt_id for c in CarryBuffer.from_state(buffer.state()).take(len(buffer))]
    consumed = seen + in_flight
    assert len(seen) == _B * steps
    assert len(set(consumed)) == len(consumed)  # never duplicated
    assert sorted(consumed) == list(range(len(consumed)))  # never lost: ids taken in order


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3 * R), min_size=60, max_size=60),
    delta=st.integers(1, _B),
)
def test_batches_and_carried_sets_do_not_depend_on_chunk_size(lengths, delta):
    runs = []
    for chunk in (1, 4, 32):
        prompts = ListPrompts([(i, [5, 6]) for i in range(len(lengths))])
        buffer, trace = CarryBuffer(), []
        for step in range(6):
            slots = admit(buffer, prompts, AdmitRule(_B + delta, _B + delta, True, 2), 2, R)
            selection, carried = _simulate_step(slots, lengths, chunk, step)
            trace.append((slots.prompt_ids[selection.batch].tolist(), selection.cut,
                          [c.to_json() for c in carried]))  # fmt: skip
            buffer.extend(carried)
        runs.append(trace)
    assert runs[0] == runs[1] == runs[2]


def test_select_batch_worked_example():
    sel = select_batch(np.array([3, -1, 1, 3]), np.ones(4, bool), np.zeros(4, bool), 2)
    assert sel.batch.tolist() == [2, 0] and sel.cut == 3
    # A must-finish slot goes first even though it finished last, and holds the cut back.
    must = np.array([False, False, False, True])
    sel = select_batch(np.array([3, 1, 1, 5]), np.ones(4, bool), must, 2)
    assert sel.batch.tolist() == [3, 1] and sel.cut == 5
    assert select_batch(np.array([3, 1, 1, -1]), np.ones(4, bool), must, 2) is None
