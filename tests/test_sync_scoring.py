"""Scoring at real widths (non-streaming schedules): the batch's sequences packed with segment
ids equal each sequence's own forward pass, in a kernel and in whole steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_jax.base.shapes import score_rows_per_call, score_width
from oppo_jax.config import PPOConfig
from oppo_jax.models import init_params
from oppo_jax.parallel.sharding import make_device_groups
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.kernels import build_kernels, oppo_sync_scoring
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.step import run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo.update import init_train_state
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from oppo_jax.rollout.layout import assemble_sequences
from oppo_jax.scoring.packed import PackedBatch, plan_packing, score_packed
from oppo_jax.scoring.stream import ScorerSpec
from tests.oracles import critic_values, policy_logprobs
from tests.ppo_fixtures import (
    ACTOR,
    CRITIC,
    ListPrompts,
    make_spec,
    reward_scores,
    step_engine,
    step_plan,
    tiny_params,
)


def test_plan_packing_example():
    [plan] = plan_packing([5, 12, 3], 64)  # B 3: one row a call, 64 wide
    assert plan.seq.shape == (1, 64)
    assert plan.row.tolist() == [0, 0, 0] and plan.offset.tolist() == [12, 0, 17]
    assert plan.seq[0].tolist() == [1] * 12 + [0] * 5 + [2] * 3 + [-1] * 44
    assert plan.col[0, 12:17].tolist() == [0, 1, 2, 3, 4]
    assert plan.real_tokens == 20 and plan.computed_tokens == 64


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=20))
def test_plan_packing_places_every_token_once_in_calls_of_one_shape(lengths):
    plans = plan_packing(lengths, 40)
    shape = (score_rows_per_call(len(lengths)), score_width(40))
    assert all(plan.seq.shape == shape for plan in plans)  # one program, whatever the lengths
    rows_used = sum(int((plan.seq >= 0).any(axis=1).sum()) for plan in plans)
    assert len(plans) == -(-rows_used // shape[0])  # only the last call has unused rows
    calls = np.stack([plan.in_call for plan in plans])
    assert (calls.sum(axis=0) == 1).all()  # every sequence in exactly one call
    for b, n in enumerate(lengths):
        plan = plans[int(np.argmax(calls[:, b]))]
        where = np.argwhere(plan.seq == b)
        assert len(where) == n and (where[:, 0] == plan.row[b]).all()
        cols = where[:, 1]
        np.testing.assert_array_equal(cols, plan.offset[b] + np.arange(n))
        np.testing.assert_array_equal(plan.col[plan.row[b], cols], np.arange(n))
    assert sum(plan.real_tokens for plan in plans) == sum(lengths)


def _ragged(seed, rows=6, width=5, resp=9):
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(1, width + 1, rows)
    resp_len = rng.integers(1, resp + 1, rows)
    prompts = np.zeros((rows, width), np.int32)
    response = np.zeros((rows, resp), np.int32)
    for b in range(rows):
        prompts[b, : prompt_len[b]] = rng.integers(2, 64, prompt_len[b])
        response[b, : resp_len[b]] = rng.integers(2, 64, resp_len[b])
    args = map(jnp.asarray, (prompts, prompt_len, response, resp_len))
    return assemble_sequences(*args), prompt_len, resp_len


def test_packed_scores_equal_each_sequences_own_forward():
    """Reference log-probs, values and rewards from one packed forward equal full per-row
    passes over right-padded sequences (an independent path) within 1e-5."""
    seqs, prompt_len, resp_len = _ragged(3)
    r = 9
    plans = plan_packing(prompt_len + resp_len, seqs.shape[1])
    assert len(plans) < len(prompt_len)  # several sequences share a row
    actor, critic = tiny_params(seed=4)
    reward = init_params(CRITIC, jax.random.key(9))
    mask = np.arange(r)[None, :] < resp_len[:, None]
    pl = jnp.asarray(prompt_len)

    def scored(spec, params):  # each sequence from the call that packs it
        out = 0.0
        for plan in plans:
            where = map(jnp.asarray, (plan.seq, plan.col, plan.row, plan.offset))
            batch = PackedBatch(seqs, pl, jnp.asarray(resp_len), *where)
            got = np.asarray(score_packed(spec, params, batch))
            keep = plan.in_call.reshape((-1,) + (1,) * (got.ndim - 1))
            out = out + np.where(keep, got, 0.0)
        return out

    ref = scored(ScorerSpec(ACTOR, "logprob", r, 0.7), actor)
    want, _ = policy_logprobs(ACTOR, actor, seqs, pl, r, 0.7)
    np.testing.assert_allclose(ref, np.where(mask, want, 0.0), atol=1e-5)
    values = scored(ScorerSpec(CRITIC, "value", r), critic)
    want = critic_values(CRITIC, critic, seqs, pl, r)
    np.testing.assert_allclose(values, np.where(mask, want, 0.0), atol=1e-5)
    scores = scored(ScorerSpec(CRITIC, "score", r), reward)
    want = reward_scores(CRITIC, reward, seqs, pl + jnp.asarray(resp_len))
    np.testing.assert_allclose(scores, want, atol=1e-5)


R, P = 24, 4


@functools.cache
def _kernels():
    spec = make_spec(PPOConfig(ppo_epochs=1, num_minibatches=2), temperature=1.0)
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompt_width=P, max_response_len=R,
                          eos_ids=tuple(range(20, 24)))  # fmt: skip
    return spec, build_kernels(spec, rollout, reward_model=CRITIC)


def _run(schedule, steps=1, batch=6, delta=0):
    spec, kernels = _kernels()
    actor, critic = tiny_params(seed=5)
    reward = init_params(CRITIC, jax.random.key(11))
    place = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    state = init_train_state(spec, *jax.tree.map(jnp.copy, (actor, critic)))
    rng = np.random.default_rng(0)
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(2, P + 1))) for i in range(64)])
    engine = step_engine(kernels, place, actor, reward)
    buffer, results = CarryBuffer(), []
    for step in range(steps):
        before = jax.tree.map(jnp.copy, state.critic_params)
        plan = step_plan(step, batch, overcommit=delta, chunk_size=4)
        state, carried, result = run_step(
            engine, SCHEDULES[schedule], plan, state, buffer, prompts, Timeline()
        )
        buffer.extend(carried)
        results.append((result, before))
    return state, results, (actor, reward, critic, engine)


def _assert_batches_rescored(results, ref, reward) -> int:
    """Each step's batch scores equal a full recompute of its sequences (reference, reward
    model, that step's critic); returns how many carried sequences were checked."""
    checked = 0
    for result, critic in results:
        batch, rows = result.batch, result.selection.batch
        mask = np.asarray(batch.mask)
        ref_logp, _ = policy_logprobs(ACTOR, ref, batch.tokens, batch.prompt_len, R, 1.0)
        values = critic_values(CRITIC, critic, batch.tokens, batch.prompt_len, R)
        scores = reward_scores(CRITIC, reward, batch.tokens, batch.prompt_len + mask.sum(1))
        for j, i in enumerate(rows):
            m = mask[j]
            np.testing.assert_allclose(batch.ref_logp[j][m], ref_logp[j][m], atol=1e-5)
            np.testing.assert_allclose(batch.old_values[j][m], values[j][m], atol=1e-5)
            np.testing.assert_allclose(batch.scores[j], scores[j], atol=1e-5)
            checked += result.slots.prefix_len[i] > 0
    return checked


@pytest.mark.slow
def test_sync_step_scores_equal_each_sequences_own_forward():
    """A sync step's reference log-probs, values and rewards equal full per-sequence passes
    within 1e-5; the scoring computed fewer tokens than every slot over R; and every call of
    the step had the one packed shape: one program per scorer."""
    oppo_sync_scoring.clear_cache()  # from here, its entries are this run's programs
    _, results, (actor, reward, _, engine) = _run("sync")
    [(b, _)] = results
    assert len(set(b.response_len.tolist())) > 1
    _assert_batches_rescored(results, actor, reward)
    roles = ("reference", "critic", "reward")
    slots = len(b.slots.prompt_len)
    assert b.work.computed["scoring"] < len(roles) * slots * R
    assert oppo_sync_scoring._cache_size() == len(roles)  # one (shape, settings) per scorer


@pytest.mark.slow
def test_inter_scores_carried_sequences_whole_when_they_enter_a_batch():
    """Without streaming, carried rows are scored once, whole, in the step that takes them:
    equal to a full recompute (reference, reward model, this step's critic)."""
    _, results, (ref, reward, _, _) = _run("inter", steps=3, batch=4, delta=3)
    assert _assert_batches_rescored(results, ref, reward), "no carried sequence reached a batch"
