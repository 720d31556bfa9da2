"""Streamed scorers (chunk-by-chunk prefill) equal full-sequence passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.models import init_params
from oppo_jax.pipeline.kernels import oppo_admission_prefill, oppo_decode, oppo_streamed_scoring
from oppo_jax.rollout import Admission, RolloutSpec, SamplingConfig
from oppo_jax.rollout.decode import CutRule
from oppo_jax.rollout.layout import assemble_sequences
from oppo_jax.scoring.stream import ScorerSpec
from tests.oracles import critic_values, policy_logprobs, start_decode
from tests.ppo_fixtures import ACTOR, CRITIC, reward_scores

R = 12


@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 3, 16, 40])
def test_streamed_scores_equal_full_sequence_pass(chunk):
    actor = init_params(ACTOR, jax.random.key(0))
    ref = init_params(ACTOR, jax.random.key(1))
    critic = init_params(CRITIC, jax.random.key(2))
    reward = init_params(CRITIC, jax.random.key(3))
    prompts = jnp.array([[5, 6, 7, 0], [8, 9, 0, 0], [10, 11, 12, 13]])
    lens = jnp.array([3, 2, 4])
    eos = (20,)  # a common-enough token that some rows end early
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompts.shape[1], R, eos)
    state = start_decode(ACTOR, rollout)(actor, prompts, lens, jax.random.key(9))
    specs = {
        "ref": (ScorerSpec(ACTOR, "logprob", R, temperature=0.7), ref),
        "critic": (ScorerSpec(CRITIC, "value", R), critic),
        "reward": (ScorerSpec(CRITIC, "score", R), reward),
    }
    admission = Admission.fresh(prompts, lens, R)
    scorer_states = {
        name: oppo_admission_prefill(params, admission, spec=spec, prompt_width=prompts.shape[1])[0]
        for name, (spec, params) in specs.items()
    }
    statics = dict(cfg=ACTOR, sampling=rollout.sampling, chunk_size=chunk, mesh=None, kv_width=None)
    rule = CutRule(jnp.ones(3, bool), jnp.zeros(3, bool), jnp.int32(3))  # run to the end
    for _ in range(-(-R // chunk)):
        state, emitted = oppo_decode(actor, state, rule, **statics)
        for name, (spec, params) in specs.items():
            scorer_states[name], _ = oppo_streamed_scoring(
                params, scorer_states[name], emitted, spec=spec, kv_width=None, packed=False
            )
    n = state.num_generated
    assert len(set(np.asarray(n).tolist())) > 1  # rows of different lengths
    tokens = assemble_sequences(prompts, lens, state.tokens, n)
    mask = np.arange(R)[None, :] < np.asarray(n)[:, None]
    ref_full, _ = policy_logprobs(ACTOR, ref, tokens, lens, R, 0.7)
    values_full = critic_values(CRITIC, critic, tokens, lens, R)
    scores_full = reward_scores(CRITIC, reward, tokens, lens + n)
    np.testing.assert_allclose(
        np.asarray(scorer_states["ref"].per_token)[mask], np.asarray(ref_full)[mask], atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(scorer_states["critic"].per_token)[mask], np.asarray(values_full)[mask],
        atol=1e-5,
    )  # fmt: skip
    np.testing.assert_allclose(scorer_states["reward"].score, scores_full, atol=1e-5)
    np.testing.assert_array_equal(scorer_states["ref"].num_fed, n)
