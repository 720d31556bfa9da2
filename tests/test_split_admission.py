"""Split admission (carried rows at the full context width, fresh rows at the prompt width)
equals the unsplit admission prefill, for the actor and every scorer kind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.models import init_params
from oppo_jax.pipeline.carry import AdmitRule, Carried, CarryBuffer, admit, carried_bucket
from oppo_jax.pipeline.kernels import make_decode_chunk
from oppo_jax.pipeline.step import device_admission
from oppo_jax.rollout import Admission, RolloutSpec, SamplingConfig
from oppo_jax.rollout.decode import ChunkTokens, admit_decode
from oppo_jax.scoring.stream import ScorerSpec, score_chunk, scorer_admit
from tests.ppo_fixtures import ACTOR, CRITIC, ListPrompts

P, R, EOS = 5, 32, (20,)


def _slots():
    """8 slots: 3 carried (the second already finished), 3 new prompts, 2 empty."""
    rng = np.random.default_rng(3)

    def seq(pid, n_prompt, n_resp, finished=False):
        resp = [int(t) for t in rng.integers(30, 64, n_resp)]
        prompt = [int(t) for t in rng.integers(30, 64, n_prompt)]
        return Carried(pid, prompt, resp, [-1.0] * n_resp, [0] * n_resp, 1, finished)

    buffer = CarryBuffer([seq(0, 3, 9), seq(1, 5, 4, finished=True), seq(2, 2, 17)])
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(1, P + 1))) for i in (3, 4, 5)])
    return admit(buffer, prompts, AdmitRule(6, 8, True, max_deferrals=2), P, R)


def _valid_cache(cache):
    """Keys/values at filled positions only (the rest is scratch either path may leave)."""
    filled = jnp.arange(cache.capacity)[None, :] < cache.length[:, None]
    mask = filled[None, :, None, :, None]
    return np.asarray(jnp.where(mask, cache.k, 0)), np.asarray(jnp.where(mask, cache.v, 0))


def _assert_caches_close(a, b):
    np.testing.assert_array_equal(a.length, b.length)
    for x, y in zip(_valid_cache(a), _valid_cache(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_slot_batch_knows_its_carried_rows():
    slots = _slots()
    assert slots.context.shape == (8, P + 32)  # longest prefix 17 -> bucket 32
    assert slots.prefix_len.tolist()[:4] == [9, 4, 17, 0]
    assert slots.carried_rows == carried_bucket(3, 8) == 4
    assert [carried_bucket(k, 24) for k in (0, 1, 5, 8, 9, 17, 24)] == [0, 4, 8, 8, 16, 24, 24]


@pytest.mark.parametrize("carried_rows", [3, 4, 8])
def test_split_actor_admission_equals_unsplit(carried_rows):
    params = init_params(ACTOR, jax.random.key(0))
    s = _slots()

    rollout = RolloutSpec(SamplingConfig(temperature=0.7), P, R, EOS)

    def run(k):
        admission = device_admission(s).replace(carried_rows=k)
        state = admit_decode(ACTOR, params, admission, jax.random.key(7), rollout, 0.7)
        states = [state]
        decode = make_decode_chunk(ACTOR, SamplingConfig(temperature=0.7), 4)
        for _ in range(3):  # tokens sampled after admission must not change either
            states.append(decode(params, jax.tree.map(jnp.copy, states[-1])))
        return states

    for full, split in zip(run(None), run(carried_rows), strict=True):
        for name in ("tokens", "num_generated", "finished", "finish_step"):
            np.testing.assert_array_equal(getattr(full, name), getattr(split, name), err_msg=name)
        np.testing.assert_allclose(full.next_logits, split.next_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(full.logprobs, split.logprobs, rtol=1e-5, atol=1e-6)
        _assert_caches_close(full.cache, split.cache)
    first = run(carried_rows)[0]
    assert np.all(np.asarray(first.logprobs)[:3, :4] < 0)  # carried prefixes were scored
    assert bool(first.finished[1]) and not bool(first.finished[0])


@pytest.mark.parametrize("kind", ["logprob", "value", "score"])
def test_split_scorer_admission_equals_unsplit(kind):
    model = ACTOR if kind == "logprob" else CRITIC
    spec = ScorerSpec(model, kind, R, temperature=0.7)
    params = init_params(model, jax.random.key(1))
    s = _slots()
    admission = device_admission(s)
    rng = np.random.default_rng(5)
    count = jnp.asarray(np.where(s.active & ~s.prefix_finished, 3, 0), jnp.int32)
    tokens = jnp.asarray(rng.integers(30, 64, (8, 3)), jnp.int32)
    chunk = ChunkTokens(tokens, admission.prefix_len, count, jnp.bool_(True))
    for k in (3, 4):
        full, split = (
            scorer_admit(spec, params, admission.replace(carried_rows=rows), P)
            for rows in (None, k)
        )
        for _ in range(2):  # and stay equal as chunks stream in
            np.testing.assert_array_equal(full.num_fed, split.num_fed)
            np.testing.assert_allclose(full.last_hidden, split.last_hidden, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(full.score, split.score, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(full.per_token, split.per_token, rtol=1e-5, atol=1e-5)
            _assert_caches_close(full.cache, split.cache)
            full, split = (score_chunk(spec, params, st, chunk) for st in (full, split))


def test_no_carried_rows_is_the_prompt_width_path():
    params = init_params(ACTOR, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompts = jnp.asarray(rng.integers(30, 64, (4, P)), jnp.int32)
    lens = jnp.array([5, 2, 3, 1])
    spec = ScorerSpec(ACTOR, "logprob", R)
    admission = Admission.fresh(prompts, lens, R)
    full, fresh = (
        scorer_admit(spec, params, admission.replace(carried_rows=k), P) for k in (None, 0)
    )
    np.testing.assert_array_equal(full.last_hidden, fresh.last_hidden)
    np.testing.assert_array_equal(fresh.per_token, 0.0)
    _assert_caches_close(full.cache, fresh.cache)


def test_slots_out_of_the_carried_first_order_are_refused():
    """The split admission relies on carried sequences coming first; breaking that is an
    error, not a silently lost prefix."""
    s = _slots()
    s.prefix_len[4] = 1  # a new prompt's slot claims a prefix
    with pytest.raises(AssertionError, match="must fill the leading slots"):
        device_admission(s)
    s = _slots()
    s.deferrals[[0, 3]] = s.deferrals[[3, 0]]  # a carried sequence after a new one
    with pytest.raises(AssertionError, match="must fill the leading slots"):
        device_admission(s)
    s = _slots()
    object.__setattr__(s, "prefix_finished", s.prefix_finished.copy())
    s.deferrals[:], s.prefix_len[:], s.prefix_finished[:] = 1, 0, False
    s.prefix_len[7] = 3  # every slot carried, one prefix in the last: bucket covers it
    device_admission(s)
