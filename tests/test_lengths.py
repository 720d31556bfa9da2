"""Synthetic long-tail lengths (rollout.length_sampler: lognormal): the distribution, responses
that end exactly at their drawn lengths, honest behaviour log-probs, and the schedule
invariants (chunk-size independence, Δ = 0 oppo = sync, carried sequences resume their own
length) with the sampler on."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import PPOConfig
from oppo_jax.models import init_params
from oppo_jax.parallel.sharding import make_device_groups
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.kernels import build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.step import run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo.update import init_train_state
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from oppo_jax.rollout.lengths import LengthSpec, target_lengths
from tests import tolerances
from tests.oracles import policy_logprobs, scan_decode, start_decode
from tests.ppo_fixtures import (
    ACTOR,
    CRITIC,
    ListPrompts,
    make_spec,
    step_engine,
    step_plan,
    tiny_params,
)

R, P = 24, 4
EOS = tuple(range(20, 28))  # 8 of 64 ids: the tiny random policy would stop within a few tokens
SPEC = LengthSpec(median=6.0, p99=20.0)


def _rollout(lengths=SPEC, temperature=1.0):
    sampling = SamplingConfig(temperature=temperature)
    return RolloutSpec(sampling, P, R, EOS, lengths=lengths)


def test_drawn_lengths_have_the_configured_median_and_p99():
    """2,000 draws per seed, ten seeds. A 99th percentile estimated from 2,000 draws has a
    standard error of about 7% at this spread (sigma = 0.82), so a single seed misses the 10%
    band about one time in ten; the pooled 20,000 draws pin it down."""
    spec, n = LengthSpec(median=48.0, p99=320.0), 2000
    ids = jnp.arange(n, dtype=jnp.int32)
    draw = jax.jit(lambda key: target_lengths(spec, key, ids, jnp.zeros_like(ids), 4096))
    runs = [np.asarray(draw(jax.random.key(seed))) for seed in range(10)]
    medians = np.array([np.median(x) for x in runs]) / 48
    p99s = np.array([np.percentile(x, 99) for x in runs]) / 320
    assert np.all(np.abs(medians - 1) < 0.1)
    assert np.sum(np.abs(p99s - 1) < 0.1) >= 8
    pooled = np.concatenate(runs)
    assert abs(np.percentile(pooled, 99) / 320 - 1) < 0.05
    assert abs(np.median(pooled) / 48 - 1) < 0.03
    assert pooled.min() >= 1


def test_drawn_lengths_depend_only_on_seed_prompt_and_sample():
    ids, zeros = jnp.array([5, 9, 700, 3]), jnp.zeros(4, jnp.int32)
    one = target_lengths(SPEC, jax.random.key(1), ids, zeros, R)
    # Same draws in another order and batch: a length follows its (prompt, sample) only.
    again = target_lengths(SPEC, jax.random.key(1), ids[::-1], zeros, R)[::-1]
    np.testing.assert_array_equal(one, again)
    others = [
        target_lengths(SPEC, jax.random.key(2), jnp.arange(64), jnp.zeros(64, jnp.int32), R),
        target_lengths(SPEC, jax.random.key(1), jnp.arange(64), jnp.ones(64, jnp.int32), R),
    ]
    base = target_lengths(SPEC, jax.random.key(1), jnp.arange(64), jnp.zeros(64, jnp.int32), R)
    for other in others:  # another seed or another sample index: other lengths
        assert np.mean(np.asarray(other) != np.asarray(base)) > 0.5
    wide = LengthSpec(50.0, 500.0)
    capped = target_lengths(wide, jax.random.key(0), jnp.arange(64), jnp.zeros(64, jnp.int32), R)
    assert int(capped.max()) == R and int(capped.min()) >= 1


def _decode(rollout, params, key=3, chunk=8):
    prompts = jax.random.randint(jax.random.key(4), (16, P), 28, 64)
    lens = jnp.full((16,), P)
    state = start_decode(ACTOR, rollout)(params, prompts, lens, jax.random.key(key))
    for _ in range(-(-R // chunk)):
        state = scan_decode(ACTOR, rollout.sampling, chunk)(params, state)
    return prompts, state


def test_responses_end_exactly_at_their_drawn_lengths():
    params = tiny_params(seed=5)[0]
    _, state = _decode(_rollout(), params)
    tokens, n = np.asarray(state.tokens), np.asarray(state.num_generated)
    expected = target_lengths(SPEC, jax.random.key(3), jnp.arange(16), jnp.zeros(16, jnp.int32), R)
    np.testing.assert_array_equal(n, expected)
    # Unsteered, the same policy stops elsewhere: before the target in some rows (EOS had to
    # be withheld there), after it in others (EOS had to be forced).
    policy = np.asarray(_decode(_rollout(lengths=None), params)[1].num_generated)
    assert (policy < n).any() and (policy > n).any()
    assert len(set(n.tolist())) > 4
    for row, length in zip(tokens, n, strict=True):
        assert row[length - 1] == EOS[0]  # forced at the target
        assert not np.isin(row[: length - 1], EOS).any()  # withheld before it


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_are_the_policys_own(temperature):
    """The recorded log-prob of each token (the forced EOS included) is the unmasked policy's,
    i.e. exactly what the update recomputes from the tokens."""
    params = tiny_params(seed=5)[0]
    prompts, state = _decode(_rollout(temperature=temperature), params)
    tokens = jnp.concatenate([prompts, state.tokens], axis=1)
    recomputed, _ = policy_logprobs(ACTOR, params, tokens, jnp.full((16,), P), R, temperature)
    mask = np.arange(R)[None, :] < np.asarray(state.num_generated)[:, None]
    np.testing.assert_allclose(
        np.asarray(state.logprobs)[mask], np.asarray(recomputed)[mask], atol=1e-5
    )


# --- the schedules with the sampler on --------------------------------------------------


@functools.cache
def _kernels():
    spec = make_spec(PPOConfig(ppo_epochs=1, num_minibatches=2), temperature=1.0)
    return spec, build_kernels(spec, _rollout(), reward_model=CRITIC)


def _steps(mode, chunk, batch, delta, steps):
    """``steps`` steps of ``mode``; returns [(StepResult, carried as JSON)]."""
    spec, kernels = _kernels()
    actor, critic = tiny_params(seed=5)
    reward = init_params(CRITIC, jax.random.key(11))
    place = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    state = init_train_state(spec, *jax.tree.map(jnp.copy, (actor, critic)))
    rng = np.random.default_rng(0)
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(2, P + 1))) for i in range(64)])
    buffer, timeline, out = CarryBuffer(), Timeline(), []
    engine = step_engine(kernels, place, actor, reward)
    for step in range(steps):
        plan = step_plan(step, batch, overcommit=delta, chunk_size=chunk)
        state, carried, result = run_step(
            engine, SCHEDULES[mode], plan, state, buffer, prompts, timeline
        )
        buffer.extend(carried)
        out.append((result, [c.to_json() for c in carried]))
    return out, state


def _bounds(batch: int) -> tolerances.UpdateBounds:
    """tests/tolerances.py's bounds of one step's update: 2 optimizer steps of minibatches of
    batch / 2 rows of P + R columns (make_spec's lr, 1e-3)."""
    return tolerances.update_bounds((ACTOR, CRITIC), batch // 2 * (P + R), P + R, 2, 1e-3)


def _same(a, b, batch: int):
    np.testing.assert_array_equal(a.responses, b.responses)
    np.testing.assert_array_equal(a.response_len, b.response_len)
    assert a.selection.batch.tolist() == b.selection.batch.tolist()
    names, n = ("reward", "kl", "policy_loss", "value_loss"), _bounds(batch).n
    tolerances.assert_same_metrics(a.metrics, b.metrics, names, n, 2, ACTOR.vocab_size)


@pytest.mark.slow
def test_oppo_without_overcommit_equals_sync_and_ignores_chunk_size():
    (sync,), sync_state = _steps("sync", 4, 8, 0, 1)
    (oppo,), oppo_state = _steps("oppo", 4, 8, 0, 1)
    (oppo32,), _ = _steps("oppo", 32, 8, 0, 1)
    assert len(set(sync[0].response_len.tolist())) > 3
    _same(sync[0], oppo[0], 8)
    _same(oppo[0], oppo32[0], 8)
    actor, critic = tiny_params(seed=5)
    before = {"actor": actor, "critic": critic}
    tolerances.assert_same_update(_bounds(8), before, oppo_state, sync_state)


@pytest.mark.slow
def test_overcommit_is_chunk_size_independent_and_carried_sequences_keep_their_length():
    small, _ = _steps("oppo", 4, 4, 3, 4)
    large, _ = _steps("oppo", 32, 4, 3, 4)
    for (a, carried_a), (b, carried_b) in zip(small, large, strict=True):
        _same(a, b, 4)
        assert [(c["prompt_id"], c["response"]) for c in carried_a] == [
            (c["prompt_id"], c["response"]) for c in carried_b
        ]
    resumed = 0
    for result, _ in small:
        slots, rows = result.slots, result.selection.batch
        ids = jnp.asarray(slots.prompt_ids[rows], jnp.int32)
        want = target_lengths(SPEC, jax.random.key(1), ids, jnp.zeros_like(ids), R)
        np.testing.assert_array_equal(result.response_len, want)  # engine's seed is 1
        resumed += int((slots.prefix_len[rows] > 0).sum())
    assert resumed > 0, "no carried sequence reached a batch; the test would prove nothing"


def test_lengths_are_a_static_rollout_setting():
    rollout = _rollout()
    assert hash(rollout) == hash(dataclasses.replace(rollout))
    assert _rollout(lengths=None) != rollout
