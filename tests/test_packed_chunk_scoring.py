"""Streamed scoring with each chunk's tokens packed (``scoring.packed_chunks``) equals the
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

from oppo_jax.config import PPOConfig
from oppo_jax.models import init_params
from oppo_jax.models.chunk_layout import ChunkLayout
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.kernels import (
    build_kernels,
    make_decode_chunk_emit,
    make_scorer_chunk,
)
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.slot_map import SlotMap
from oppo_jax.pipeline.step import run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo import packing
from oppo_jax.ppo.batch import critic_values, policy_logprobs
from oppo_jax.ppo.update import init_train_state
from oppo_jax.rollout import Admission, RolloutSpec, SamplingConfig
from oppo_jax.rollout.decode import CutRule
from oppo_jax.rollout.layout import assemble_sequences
from oppo_jax.rollout.lengths import LengthSpec
from oppo_jax.scoring.packed_chunks import (
    PACKED_LEVELS,
    chunk_shape,
    chunk_shapes,
    padding_plan,
    plan_chunk,
)
from oppo_jax.scoring.replay import admit_actor, admit_scorer, plan_replay
from oppo_jax.scoring.stream import ScorerSpec
from oppo_jax.sharding import make_device_groups
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


@pytest.mark.parametrize("steps", [4, 8])  # sizes per doubling: a CPU's, an accelerator's
def test_packed_sizes_on_hand_counted_cases(monkeypatch, steps):
    monkeypatch.setattr(packing, "bucket_steps", lambda: steps)
    # S 24, C 8: S·C 192, the smallest packed size 256 / 16 = 16
    counts = np.zeros(24, int)
    counts[:9] = [8, 2, 3, 1, 4, 4, 3, 3, 2]  # 30 tokens in 9 slots
    m = {4: (32, 80, 160), 8: (30, 72, 144)}[steps]  # 30, 70, 140 rounded up (1.25 / 1.125)
    assert chunk_shape(counts, 8) == (24, m[0])
    assert chunk_shape(np.array([1] * 5 + [0] * 19), 8) == (16, 16)
    assert chunk_shape(np.array([3] * 23 + [1]), 8) == (24, m[1])  # 70 tokens
    assert chunk_shape(np.array([6] * 20 + [5] * 4), 8) == (24, m[2])  # 140 tokens
    assert chunk_shape(np.array([8] * 20 + [5] * 4), 8) is None  # 180 tokens: 192 = S·C
    sizes = [(16, 16), (20, 20), (24, 24), (24, 28), (24, 32), (24, 40), (24, 48), (24, 56)]
    sizes += [(24, 64), (24, 80), (24, 96), (24, 112), (24, 128), (24, 160)]
    if steps == 8:
        sizes = [(16, 16), (18, 18), (20, 20), (22, 22), (24, 24), (24, 26), (24, 28), (24, 30)]
        sizes += [(24, m) for m in (32, 36, 40, 44, 48, 52, 56, 60, 64, 72, 80, 88, 96, 104)]
        sizes += [(24, m) for m in (112, 120, 128, 144, 160, 176)]
    assert chunk_shapes(24, 8) == sizes
    plan = plan_chunk(np.array([0, 3, 0, 1]), 4)
    assert plan["rows"].tolist() == [1, 3, 4, 4] and plan["count"].tolist() == [3, 1, 0, 0]
    assert plan["token_row"].tolist() == [0, 0, 0, 1]
    assert plan["token_col"].tolist() == [0, 1, 2, 0]
    # every shape a chunk can take is listed (what a warm-up compiles), few per width
    rng = np.random.default_rng(0)
    for slots in (1, 3, 8, 24):
        for width in (1, 3, 8):
            listed = set(chunk_shapes(slots, width))
            assert len(listed) <= steps * PACKED_LEVELS
            floor = max(1 << (slots * width - 1).bit_length() >> PACKED_LEVELS, 1)
            for _ in range(200):
                live = rng.random(slots) < rng.random()
                counts = rng.integers(1, width + 1, slots) * live
                shape = chunk_shape(counts, width)
                assert shape is None or shape in listed
                if shape is not None:  # rows hold the live slots, tokens the real ones
                    assert np.count_nonzero(counts) <= shape[0] and counts.sum() <= shape[1]
                    # and less than a fifth of a size above the floor is padding
                    assert shape[1] == floor or 5 * counts.sum() > 4 * shape[1]


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
    decode = make_decode_chunk_emit(ACTOR, rollout.sampling, chunk, None)
    rule = CutRule(admission.active, jnp.zeros(6, bool), jnp.int32(5))  # run to the end
    plans = []
    for _ in range(-(-R // chunk) + 1):
        state, emitted = decode(actor, state, rule)
        plan = plan_chunk(np.asarray(emitted.count), chunk)
        plans.append(plan)
        for name, (spec, params) in specs.items():
            every[name], _ = make_scorer_chunk(spec)(params, every[name], emitted)
            if plan is None:
                live[name], _ = make_scorer_chunk(spec)(params, live[name], emitted)
            else:
                kernel = make_scorer_chunk(spec, None, True)
                live[name], _ = kernel(params, live[name], emitted, plan)
    assert sum(p is not None for p in plans) >= 2  # chunks were packed
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
    plan = padding_plan(chunk_shapes(6, chunk)[-1], 6)
    after, _ = make_scorer_chunk(spec, None, True)(params, live["critic"], emitted, plan)
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
    streamed = []  # (compacted, rows of the chunk the scorers got, S) of each compacted step
    scorers_chunk = SlotMap.scorers_chunk

    def spy(self, chunk_tokens):
        out = scorers_chunk(self, chunk_tokens)
        streamed.append((self.parked is not None, out.tokens.shape[0], self.slots))
        return out

    monkeypatch.setattr(SlotMap, "scorers_chunk", spy)
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
    live_streamed, streamed[:] = list(streamed), []
    every = _run(dataclasses.replace(engine, packed_chunk_scoring=False), overcommit, chunk)
    if compact:  # packing scorers keep the admission's S slots; the others move with the rows
        assert any(c for c, _, _ in live_streamed), "no step compacted"
        assert all(n == s for c, n, s in live_streamed)
        assert any(c and n < s for c, n, s in streamed)
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
