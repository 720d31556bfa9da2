"""Inter-step overlap on real (tiny) models: chunk-size independence and carried-sequence
parity with a full recompute under the parameters current when they are finally used."""

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
from tests import tolerances
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

R, P, B, DELTA = 16, 4, 4, 3


@functools.cache
def _kernels():
    spec = make_spec(PPOConfig(ppo_epochs=1, num_minibatches=2), temperature=1.0)
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompt_width=P, max_response_len=R,
                          eos_ids=tuple(range(20, 26)))  # fmt: skip
    return spec, build_kernels(spec, rollout, reward_model=CRITIC)


def _run(chunk, steps=3, observe=None):
    """``steps`` OPPO steps with Δ = 3; ``observe(step, slots, result, params)`` sees each."""
    spec, kernels = _kernels()
    actor, critic = tiny_params(seed=5)
    reward = init_params(CRITIC, jax.random.key(11))
    place = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    state = init_train_state(spec, *jax.tree.map(jnp.copy, (actor, critic)))  # donated later
    rng = np.random.default_rng(0)
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(2, P + 1))) for i in range(64)])
    buffer, timeline, trace = CarryBuffer(), Timeline(), []
    engine = step_engine(kernels, place, actor, reward)
    for step in range(steps):
        before = jax.tree.map(jnp.copy, (state.actor_params, state.critic_params))
        plan = step_plan(step, B, overcommit=DELTA, chunk_size=chunk)
        state, carried, result = run_step(
            engine, SCHEDULES["oppo"], plan, state, buffer, prompts, timeline
        )
        buffer.extend(carried)
        if observe:
            observe(step, result.slots, result, before, (actor, reward))
        trace.append((result, [c.to_json() for c in carried]))
    return trace


@pytest.mark.slow
def test_results_do_not_depend_on_chunk_size_with_overcommit():
    small, large = _run(4), _run(32)
    assert any(len(carried) for _, carried in small)
    for (a, carried_a), (b, carried_b) in zip(small, large, strict=True):
        np.testing.assert_array_equal(a.responses, b.responses)
        assert a.selection.batch.tolist() == b.selection.batch.tolist()
        assert a.selection.cut == b.selection.cut
        assert [(c["prompt_id"], c["response"]) for c in carried_a] == [
            (c["prompt_id"], c["response"]) for c in carried_b
        ]
        # equal up to float32 rounding: tests/tolerances.py's bounds for minibatches of B / 2
        # rows of P + R columns
        names = ("reward", "kl", "policy_loss", "value_loss")
        n = tolerances.chain_summands((ACTOR, CRITIC), B // 2 * (P + R), P + R)
        tolerances.assert_same_metrics(a.metrics, b.metrics, names, n, 2, ACTOR.vocab_size)


@pytest.mark.slow
def test_carried_sequences_match_a_full_recompute_with_current_parameters():
    checked = []

    def observe(step, slots, result, params_before, frozen):
        actor, critic = params_before
        ref, reward = frozen
        rows = result.selection.batch
        carried_rows = [j for j, i in enumerate(rows) if slots.prefix_len[i] > 0]
        if not carried_rows:
            return
        batch = result.batch
        mask = np.asarray(batch.mask)
        temp = _kernels()[0].temperature
        old, _ = policy_logprobs(ACTOR, actor, batch.tokens, batch.prompt_len, R, temp)
        ref_logp, _ = policy_logprobs(ACTOR, ref, batch.tokens, batch.prompt_len, R, temp)
        values = critic_values(CRITIC, critic, batch.tokens, batch.prompt_len, R)
        seq_len = batch.prompt_len + mask.sum(1)
        scores = reward_scores(CRITIC, reward, batch.tokens, seq_len)
        for j in carried_rows:
            m = mask[j]
            np.testing.assert_allclose(batch.old_logp[j][m], old[j][m], atol=1e-5)
            np.testing.assert_allclose(batch.ref_logp[j][m], ref_logp[j][m], atol=1e-5)
            np.testing.assert_allclose(batch.old_values[j][m], values[j][m], atol=1e-5)
            np.testing.assert_allclose(batch.scores[j], scores[j], atol=1e-5)
            # Carried tokens were sampled by an older policy: behaviour != current log-probs.
            prefix = int(slots.prefix_len[rows[j]])
            assert np.any(batch.behaviour_logp[j][:prefix] != batch.old_logp[j][:prefix])
            checked.append(step)

    _run(8, steps=4, observe=observe)
    assert checked, "no carried sequence reached a batch; the test would prove nothing"


def test_decoding_stops_at_the_cut():
    """No slot decodes past the cut position (the last chunk stops where the rule holds), so
    a running slot holds exactly its prefix plus ``cut`` new tokens, and one that finished
    holds at most that."""
    ran = []

    def observe(step, slots, result, params_before, frozen):
        cut, r = result.selection.cut, result.rollout
        running = slots.active & (r.finish_step < 0)
        assert running.any()  # Δ > 0: some slot is still running at the cut
        np.testing.assert_array_equal(r.num_generated[running], slots.prefix_len[running] + cut)
        assert np.all(r.num_generated[slots.active] <= slots.prefix_len[slots.active] + cut)
        assert np.all(r.finish_step <= cut)
        ran.append(step)

    _run(32, steps=3, observe=observe)  # chunks longer than most cuts
    assert ran == [0, 1, 2]
