"""Streamed scoring with each chunk's tokens packed (``scoring.stream``) equals the
[S, C] call over every slot, and a full forward pass: the same log-probs, values, scores and
fed counts, with ragged lengths and carried rows, chunk by chunk and in whole OPPO steps; the
ledger counts the packed tokens; and the packed sizes a scorer compiles are few."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_jax.base.shapes import chunk_budget, chunk_groups
from oppo_jax.config import PPOConfig
from oppo_jax.models import init_params
from oppo_jax.models.chunk_layout import ChunkLayout
from oppo_jax.parallel.sharding import make_device_groups
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.decode_loop import SlotMap
from oppo_jax.pipeline.kernels import Kernels, build_kernels, oppo_decode, oppo_streamed_scoring
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.step import run_step
from oppo_jax.pipeline.step_scorers import StepScorers
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo.update import init_train_state
from oppo_jax.rollout import Admission, RolloutSpec, SamplingConfig
from oppo_jax.rollout.decode import CutRule
from oppo_jax.rollout.layout import assemble_sequences
from oppo_jax.rollout.lengths import LengthSpec
from oppo_jax.scoring.carried import plan_replay
from oppo_jax.scoring.stream import ScorerSpec, padding_plan, plan_chunk
from tests.oracles import admit_actor, admit_scorer, critic_values, policy_logprobs
from tests.ppo_fixtures import (
    ACTOR,
    CRITIC,
    ListPrompts,
    make_spec,
    reward_scores,
    step_engine,
    step_plan,
)

P, R = 4, 20


def test_chunk_budget_and_groups_on_hand_counted_cases():
    # M = pow2(S·C / 32) tokens, at least C; N = min(S, 4·M / C) rows
    assert chunk_budget(120, 256) == (16, 1024)  # the 7B configs' streamed calls
    assert chunk_budget(64, 32) == (8, 64) and chunk_budget(24, 8) == (4, 8)
    counts = np.zeros(24, int)
    counts[:9] = [8, 2, 3, 1, 4, 4, 3, 3, 2]  # 30 tokens in 9 slots: calls of 4 rows, 8 tokens
    # first-fit decreasing: 8 | 4 4 | 3 3 2 | 3 2 1, four calls (32 tokens for 30)
    assert chunk_groups(counts, 8) == [[0], [4, 5], [1, 2, 6], [3, 7, 8]]
    assert chunk_groups(np.zeros(24, int), 8) == []  # nothing to score: no call
    [plan] = plan_chunk(np.array([0, 3, 0, 1]), 4)  # S 4, C 4: budget (4, 4)
    assert plan["rows"].tolist() == [1, 3, 4, 4] and plan["count"].tolist() == [3, 1, 0, 0]
    assert plan["token_row"].tolist() == [0, 0, 0, 1]
    assert plan["token_col"].tolist() == [0, 1, 2, 0]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 32), st.integers(1, 16), st.integers(0, 2**32 - 1))
def test_chunk_groups_cover_each_live_slot_once_within_one_budget(slots, width, seed):
    rng = np.random.default_rng(seed)
    live = rng.random(slots) < rng.random()
    counts = rng.integers(1, width + 1, slots) * live
    rows, tokens = chunk_budget(slots, width)
    groups = chunk_groups(counts, width)
    assert sorted(s for g in groups for s in g) == np.flatnonzero(counts).tolist()
    for g in groups:
        assert len(g) <= rows and counts[g].sum() <= tokens
    # first-fit decreasing: no two calls would fit one budget together, so the calls are at
    # most twice the fewest possible
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            assert counts[a + b].sum() > tokens or len(a) + len(b) > rows
    plans = plan_chunk(counts, width)
    assert [p["rows"].shape + p["token_row"].shape for p in plans] == [(rows, tokens)] * len(groups)


def test_chunk_layout_places_each_token_at_its_slot_and_column():
    # the module docstring's example: counts [0, 3, 0, 1] (S 4, C 4), N 2, M 5 (one padding)
    plan = {"rows": [1, 3], "count": [3, 1], "token_row": [0, 0, 0, 1, 2],
            "token_col": [0, 1, 2, 0, 0]}  # fmt: skip
    layout = ChunkLayout(**{k: jnp.asarray(v, jnp.int32) for k, v in plan.items()}, width=4)
    assert layout.token_slots(4).tolist() == [1, 1, 1, 3, 4]
    tokens, in_rows = layout.positions(jnp.array([9, 5, 9, 7]))
    assert tokens.tolist() == [[5, 6, 7, 7, 7]]  # padding reads the last row's length
    assert in_rows.tolist() == [[5, 6, 7, 8], [7, 8, 9, 10]]
    x = jnp.arange(5.0).reshape(5, 1, 1) + 1
    rows = layout.to_rows(x)
    assert rows[..., 0, 0].tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert layout.from_rows(rows)[:4, 0, 0].tolist() == [1, 2, 3, 4]
    assert layout.is_last().tolist() == [False, False, True, True, False]


@functools.cache
def _params():
    keys = jax.random.split(jax.random.key(5), 4)
    return (
        init_params(ACTOR, keys[0]),
        init_params(ACTOR, keys[1]),
        init_params(CRITIC, keys[2]),
        init_params(CRITIC, keys[3]),
    )


def _carried_admission():
    """Six slots: two carry partial responses (3 and 7 tokens), one is empty, prompts ragged."""
    rng = np.random.default_rng(1)
    prompt_len = np.array([3, 4, 2, 4, 1, 3])
    prefix_len = np.array([3, 7, 0, 0, 0, 0])
    width = P + 8
    context = np.zeros((6, width), np.int32)
    for s in range(6):
        n = prompt_len[s] + prefix_len[s]
        context[s, :n] = rng.integers(30, 64, n)
    active = np.array([True, True, True, True, False, True])
    admission = Admission.fresh(jnp.asarray(context[:, :P]), jnp.asarray(prompt_len), R)
    return admission.replace(
        context=jnp.asarray(context),
        prefix_len=jnp.asarray(prefix_len, jnp.int32),
        prefix_behaviour=jnp.zeros((6, R), jnp.float32),
        active=jnp.asarray(active),
    )


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_packed_chunks_equal_every_slot_chunks_and_a_full_pass(chunk):
    actor, ref, critic, reward = _params()
    rollout = RolloutSpec(
        SamplingConfig(temperature=1.0), P, R, eos_ids=(1,), lengths=LengthSpec(3.0, 15.0)
    )
    admission = _carried_admission()
    c, n = (np.asarray(x) for x in (admission.context, admission.prompt_len))
    plan = plan_replay(c, n, np.asarray(admission.prefix_len), (P, R))
    state = admit_actor(ACTOR, actor, admission, jax.random.key(9), rollout, 1.0, plan)
    specs = {
        "ref": (ScorerSpec(ACTOR, "logprob", R, temperature=1.0), ref),
        "critic": (ScorerSpec(CRITIC, "value", R), critic),
        "reward": (ScorerSpec(CRITIC, "score", R), reward),
    }
    admit = {n: admit_scorer(s, p, admission, P, plan) for n, (s, p) in specs.items()}
    every = dict(admit)
    live = jax.tree.map(jnp.copy, admit)
    statics = dict(cfg=ACTOR, sampling=rollout.sampling, chunk_size=chunk, mesh=None, kv_width=None)
    rule = CutRule(admission.active, jnp.zeros(6, bool), jnp.int32(5))  # run to the end
    plans = []
    for _ in range(-(-R // chunk) + 1):
        state, emitted = oppo_decode(actor, state, rule, **statics)
        calls = plan_chunk(np.asarray(emitted.count), chunk)
        plans.append(calls)
        for name, (spec, params) in specs.items():
            score = functools.partial(oppo_streamed_scoring, spec=spec, kv_width=None)
            every[name], _ = score(params, every[name], emitted, packed=False)
            for plan in calls:
                live[name], _ = score(params, live[name], emitted, plan, packed=True)
    assert any(len(calls) > 1 for calls in plans)  # chunks took several calls
    assert any(len(calls) == 1 for calls in plans)  # and some (few live slots) one
    n = np.asarray(state.num_generated)
    assert len(set(n.tolist())) > 2
    mask = np.arange(R)[None, :] < n[:, None]
    for name in specs:
        a, b = live[name], every[name]
        np.testing.assert_array_equal(a.num_fed, b.num_fed)
        np.testing.assert_array_equal(a.cache.length, b.cache.length)
        np.testing.assert_allclose(
            np.asarray(a.per_token)[mask], np.asarray(b.per_token)[mask], atol=1e-5, rtol=0
        )
        np.testing.assert_allclose(a.score, b.score, atol=1e-5, rtol=0)
    # and both equal one full forward pass over prompt + whole response
    lens = admission.prompt_len
    tokens = assemble_sequences(admission.context[:, :P], lens, state.tokens, state.num_generated)
    ref_full, _ = policy_logprobs(ACTOR, ref, tokens, lens, R, 1.0)
    values_full = critic_values(CRITIC, critic, tokens, lens, R)
    scores_full = reward_scores(CRITIC, reward, tokens, lens + state.num_generated)
    on = np.asarray(admission.active)
    np.testing.assert_allclose(
        np.asarray(live["ref"].per_token)[mask], np.asarray(ref_full)[mask], atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(live["critic"].per_token)[mask], np.asarray(values_full)[mask], atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(live["reward"].score)[on], np.asarray(scores_full)[on], atol=1e-5
    )
    # a warm-up's padding plan compiles a shape and changes nothing
    spec, params = specs["critic"]
    before = [np.asarray(x) for x in jax.tree.leaves(live["critic"])]
    plan = padding_plan(chunk_budget(6, chunk), 6)
    after, _ = oppo_streamed_scoring(
        params, live["critic"], emitted, plan, spec=spec, kv_width=None, packed=True
    )
    for x, y in zip(before, jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)


def _run(engine, overcommit: int, chunk: int, steps: int = 3):
    """``steps`` OPPO steps (B = 4, Δ carried) from fixed parameters."""
    actor, _, critic, _ = _params()
    state = init_train_state(engine.kernels.spec, *jax.tree.map(jnp.copy, (actor, critic)))
    rng = np.random.default_rng(0)
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(1, P + 1))) for i in range(64)])
    buffer, timeline, results = CarryBuffer(), Timeline(), []
    for step in range(steps):
        plan = step_plan(step, 4, overcommit=overcommit, chunk_size=chunk)
        state, carried, result = run_step(
            engine, SCHEDULES["oppo"], plan, state, buffer, prompts, timeline
        )
        buffer.extend(carried)
        results.append(result)
    return results


@pytest.mark.parametrize(
    ("overcommit", "chunk", "compact"),
    [(1, 2, False), pytest.param(3, 3, True, marks=pytest.mark.slow)],  # compaction: slow tier
)
def test_oppo_steps_with_packed_chunks_equal_every_slot_steps(
    overcommit, chunk, compact, monkeypatch
):
    """Steps whose scorers pack each chunk (and, with ``compact``, whose decode compacts) equal
    steps scoring every chunk over every slot, the path of a scoring mesh that splits the
    slots (it never compacts); the scorers always get a chunk in the admission's S slots."""
    fed, compacted = [], []  # rows of each chunk the scorers got; whether each step compacted
    feed, restore = StepScorers.feed, SlotMap.restore

    def spy_feed(self, chunk_tokens, width, counts):
        fed.append(chunk_tokens.tokens.shape[0])
        return feed(self, chunk_tokens, width, counts)

    def spy_restore(self, state):
        compacted.append(self.parked is not None)
        return restore(self, state)

    monkeypatch.setattr(StepScorers, "feed", spy_feed)
    monkeypatch.setattr(SlotMap, "restore", spy_restore)
    spec = make_spec(PPOConfig(ppo_epochs=1, num_minibatches=2), temperature=1.0)
    rollout = RolloutSpec(
        SamplingConfig(temperature=1.0), P, R, eos_ids=(1,), lengths=LengthSpec(6.0, 18.0)
    )
    kernels = dataclasses.replace(
        build_kernels(spec, rollout, reward_model=CRITIC), compact_slots=compact
    )
    place = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    actor, ref, _, reward = _params()
    engine = step_engine(kernels, place, ref, reward)
    live = _run(engine, overcommit, chunk)
    assert any(compacted) == compact, "compaction did not run as configured"
    assert set(fed) == {live[0].slots.num_slots}
    monkeypatch.setattr(Kernels, "packs_chunks", property(lambda self: False))
    assert engine.kernels.compaction_floor is None  # unpacked scorers: no compaction
    every = _run(engine, overcommit, chunk)
    assert any(r.slots.prefix_len.max() > 0 for r in live)  # carried rows were streamed
    for a, b in zip(live, every, strict=True):
        assert a.selection.batch.tolist() == b.selection.batch.tolist()
        np.testing.assert_array_equal(a.rollout.tokens, b.rollout.tokens)
        for key in ("ref_logp", "old_values", "scores", "old_logp"):
            np.testing.assert_allclose(
                getattr(a.batch, key), getattr(b.batch, key), atol=1e-5, rtol=0, err_msg=key
            )
        # the same real tokens; fewer computed once slots finish
        assert a.work.real["scoring"] == b.work.real["scoring"]
        assert a.work.computed["scoring"] <= b.work.computed["scoring"]
    total = [sum(r.work.computed["scoring"] for r in run) for run in (live, every)]
    assert total[0] < total[1]
