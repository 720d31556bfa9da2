"""The admission replays carried prefixes after the prompt prefill (scoring.carried): the actor's
decode state and every scorer kind's state equal one full pass over prompt + prefix, whatever
the replay chunk, on one device and with the slots sharded; its plan costs what the prefixes
need over few shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.models import init_params
from oppo_jax.models.heads import scores_at
from oppo_jax.models.kv_cache import init_cache
from oppo_jax.parallel.sharding import make_mesh
from oppo_jax.pipeline.carry import AdmitRule, Carried, CarryBuffer, admit
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from oppo_jax.rollout.admission import prefill_hidden
from oppo_jax.rollout.decode import ChunkTokens, admit_decode
from oppo_jax.scoring.carried import (
    ReplayChunk,
    plan_replay,
    replay_shapes,
    row_bucket,
)
from oppo_jax.scoring.stream import ScorerSpec, score_chunk, scorer_admit
from tests.oracles import critic_values, policy_logprobs, replay, scan_decode
from tests.ppo_fixtures import ACTOR, CRITIC, ListPrompts, eager_admission

P, R, EOS, T = 5, 32, (20,), 0.7


def _slots():
    """8 slots: 3 carried (the second already finished), 3 new prompts, 2 empty."""
    rng = np.random.default_rng(3)

    def seq(pid, n_prompt, n_resp, finished=False):
        resp = [int(t) for t in rng.integers(30, 64, n_resp)]
        prompt = [int(t) for t in rng.integers(30, 64, n_prompt)]
        return Carried(pid, prompt, resp, [-1.0] * n_resp, [0] * n_resp, 1, finished)

    buffer = CarryBuffer([seq(0, 3, 9), seq(1, 5, 4, finished=True), seq(2, 2, 17)])
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(1, P + 1))) for i in (3, 4, 5)])
    return admit(buffer, prompts, AdmitRule(6, 8, True, max_staleness=2), P, R)


def _valid_cache(cache):
    """Keys/values at filled positions only (the rest is scratch either path may leave)."""
    filled = jnp.arange(cache.capacity)[None, :] < cache.length[:, None]
    mask = filled[None, :, None, :, None]
    return np.asarray(jnp.where(mask, cache.k, 0)), np.asarray(jnp.where(mask, cache.v, 0))


def _assert_caches_close(a, b):
    np.testing.assert_array_equal(a.length, b.length)
    for x, y in zip(_valid_cache(a), _valid_cache(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def _one_pass(cfg, params, s):
    """The reference: every slot's whole context (prompt + prefix) in one cached call."""
    context_len = jnp.asarray(s.prompt_len + s.prefix_len)
    cache = init_cache(cfg, s.num_slots, P + R)
    hidden, cache = prefill_hidden(cfg, params, cache, jnp.asarray(s.context), context_len)
    last = hidden[jnp.arange(s.num_slots), jnp.maximum(context_len - 1, 0)]
    return cache, last


def test_plan_worked_example():
    context = np.arange(4 * 200).reshape(4, 200) % 50
    prompt_len, prefix = np.array([2, 3, 1, 4]), np.array([130, 70, 0, 10])
    plan = plan_replay(context, prompt_len, prefix, (4, 196), chunk=64)
    assert [c.rows for c in plan] == [4, 4, 4]
    assert [c.count.tolist() for c in plan] == [[64, 64, 0, 10], [64, 6, 0, 0], [2, 0, 0, 0]]
    assert [c.kv_width for c in plan] == [200, 200, 200]  # the whole cache: one width
    np.testing.assert_array_equal(plan[1].tokens[0], context[0, 2 + 64 : 2 + 128])
    np.testing.assert_array_equal(plan[0].tokens[3, :10], context[3, 4:14])
    assert plan[0].tokens[3, 10:].sum() == 0 and plan[2].tokens[1:].sum() == 0
    assert plan_replay(context, prompt_len, 0 * prefix, (4, 196)) == []
    assert _slots().context.shape == (8, P + R)  # room for any prefix: one admission width
    assert [row_bucket(k, 24) for k in (0, 1, 5, 8, 9, 17, 24)] == [0, 4, 8, 8, 16, 24, 24]


def test_plan_rows_follow_the_prefixes_and_shapes_cover_them():
    """Later chunks run over fewer rows once the shorter prefixes have ended, and every
    (rows, width) a plan picks is one the warm-up compiles."""
    rng = np.random.default_rng(0)
    slots, carried = 24, 17
    shapes = set(replay_shapes(slots, carried, (P, R)))
    assert shapes == {(4, P + R), (8, P + R), (16, P + R), (24, P + R)}  # row buckets only
    for _ in range(50):
        prefix = np.zeros(slots, int)
        prefix[:carried] = np.sort(rng.integers(0, R + 1, carried))[::-1]
        context = rng.integers(0, 9, (slots, P + R))
        plan = plan_replay(context, np.full(slots, P), prefix, (P, R), chunk=4)
        assert {(c.rows, c.kv_width) for c in plan} <= shapes
        for j, c in enumerate(plan):
            assert (prefix[c.rows :] <= 4 * j).all()  # nothing left outside the rows
            np.testing.assert_array_equal(c.count, np.clip(prefix[: c.rows] - 4 * j, 0, 4))
        assert sum(int(c.count.sum()) for c in plan) == prefix.sum()


@pytest.mark.parametrize("chunk", [3, 4, 64])
def test_replayed_actor_admission_equals_one_pass(chunk):
    params = init_params(ACTOR, jax.random.key(0))
    s = _slots()
    rollout = RolloutSpec(SamplingConfig(temperature=T), P, R, EOS)
    admission = eager_admission(s)
    plan = plan_replay(s.context, s.prompt_len, s.prefix_len, (P, R), chunk)
    spec = ScorerSpec(ACTOR, "logprob", R, T)
    state = replay(spec, params, scorer_admit(spec, params, admission, P), plan)
    made = (state.cache, state.last_hidden, state.per_token)
    replayed = admit_decode(ACTOR, params, admission, jax.random.key(7), rollout, made)
    cache, last = _one_pass(ACTOR, params, s)
    logp, _ = policy_logprobs(
        ACTOR, params, jnp.asarray(s.context), jnp.asarray(s.prompt_len), R, T
    )
    whole = admit_decode(ACTOR, params, admission, jax.random.key(7), rollout, (cache, last, logp))
    decode = scan_decode(ACTOR, SamplingConfig(temperature=T), 4)
    a, b = [whole], [replayed]
    for _ in range(3):  # tokens sampled after admission must not change either
        a.append(decode(params, jax.tree.map(jnp.copy, a[-1])))
        b.append(decode(params, jax.tree.map(jnp.copy, b[-1])))
    for one, many in zip(a, b, strict=True):
        for name in ("tokens", "num_generated", "finished", "finish_step"):
            np.testing.assert_array_equal(getattr(one, name), getattr(many, name), err_msg=name)
        np.testing.assert_allclose(one.next_logits, many.next_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(one.logprobs, many.logprobs, rtol=1e-5, atol=1e-6)
        _assert_caches_close(one.cache, many.cache)
    first = np.asarray(b[0].logprobs)
    assert np.all(first[0, :9] < 0) and np.all(first[2, :17] < 0)  # prefixes were scored
    assert np.all(first[0, 9:] == 0) and np.all(first[3:] == 0)  # and nothing else
    assert bool(b[0].finished[1]) and not bool(b[0].finished[0])


def _reference(kind, model, params, s):
    """(per-token quantities [S, R] of the prefixes, score [S]) from one full pass."""
    tokens, prompt_len = jnp.asarray(s.context), jnp.asarray(s.prompt_len)
    in_prefix = np.arange(R)[None, :] < s.prefix_len[:, None]
    if kind == "logprob":
        per_token = policy_logprobs(model, params, tokens, prompt_len, R, T)[0]
    else:
        per_token = critic_values(model, params, tokens, prompt_len, R)
    _, last = _one_pass(model, params, s)
    score = scores_at(model, params, last) if kind == "score" else jnp.zeros(s.num_slots)
    return np.where(in_prefix, per_token, 0.0) if kind != "score" else 0.0, score


@pytest.mark.parametrize("kind", ["logprob", "value", "score"])
def test_replayed_scorer_admission_equals_one_pass(kind):
    model = ACTOR if kind == "logprob" else CRITIC
    spec = ScorerSpec(model, kind, R, temperature=T)
    params = init_params(model, jax.random.key(1))
    s = _slots()
    admission = eager_admission(s)
    plan = plan_replay(s.context, s.prompt_len, s.prefix_len, (P, R), chunk=4)
    state = replay(spec, params, scorer_admit(spec, params, admission, P), plan)
    np.testing.assert_array_equal(state.num_fed, s.prefix_len)
    per_token, score = _reference(kind, model, params, s)
    np.testing.assert_allclose(state.per_token, per_token, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.score, score, rtol=1e-5, atol=1e-5)
    cache, last = _one_pass(model, params, s)
    np.testing.assert_allclose(state.last_hidden, last, rtol=1e-5, atol=1e-5)
    _assert_caches_close(state.cache, cache)
    # A chunk streamed in after the replay lands after each prefix.
    rng = np.random.default_rng(5)
    count = jnp.asarray(np.where(s.active & ~s.prefix_finished, 3, 0), jnp.int32)
    tokens = jnp.asarray(rng.integers(30, 64, (8, 3)), jnp.int32)
    chunk = ChunkTokens(tokens, state.num_fed, count, jnp.bool_(True))
    fed = score_chunk(spec, params, state, chunk)
    np.testing.assert_array_equal(fed.num_fed, s.prefix_len + np.asarray(count))
    np.testing.assert_array_equal(fed.cache.length, s.prompt_len + np.asarray(fed.num_fed))


@pytest.mark.parametrize("fsdp", [2, 4])  # slots sharded over the batch axis
def test_replay_on_sharded_slots_equals_one_device(fsdp):
    mesh = make_mesh(1, fsdp, 1, jax.devices()[:fsdp])
    params = init_params(CRITIC, jax.random.key(1))
    s = _slots()
    admission = eager_admission(s)
    plan = plan_replay(s.context, s.prompt_len, s.prefix_len, (P, R), chunk=4)
    got = []
    for m in (None, mesh):
        spec = ScorerSpec(CRITIC, "value", R, mesh=m)
        run = jax.jit(lambda p, a, spec=spec: replay(spec, p, scorer_admit(spec, p, a, P), plan))
        got.append(run(params, admission))
    np.testing.assert_allclose(got[0].per_token, got[1].per_token, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0].num_fed, got[1].num_fed)
    _assert_caches_close(got[0].cache, got[1].cache)
    assert got[1].cache.k.sharding.spec[1] is not None  # the cache stays split over the slots


def test_replay_chunk_touches_only_its_rows():
    """A chunk over the leading 4 rows leaves the other slots' state exactly as it was."""
    spec = ScorerSpec(ACTOR, "logprob", R, T)
    params = init_params(ACTOR, jax.random.key(0))
    admission = eager_admission(_slots())
    before = scorer_admit(spec, params, admission, P)
    chunk = ReplayChunk(np.full((4, 4), 33, np.int32), np.array([4, 0, 2, 1], np.int32), 16)
    after = replay(spec, params, jax.tree.map(jnp.copy, before), [chunk])
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        axis = 1 if x.ndim == 5 else 0
        rest = (slice(None),) * axis + (slice(4, None),)
        np.testing.assert_array_equal(np.asarray(x)[rest], np.asarray(y)[rest])
    np.testing.assert_array_equal(after.num_fed, [4, 0, 2, 1, 0, 0, 0, 0])


def test_slots_out_of_the_carried_first_order_are_refused():
    """The kept rows and the replay's leading buckets rely on carried sequences coming first;
    breaking that is an error, not a silently lost prefix."""
    s = _slots()
    s.prefix_len[4] = 1  # a new prompt's slot claims a prefix
    with pytest.raises(AssertionError, match="must fill the leading slots"):
        eager_admission(s)
    s = _slots()
    s.deferrals[[0, 3]] = s.deferrals[[3, 0]]  # a carried sequence after a new one
    with pytest.raises(AssertionError, match="must fill the leading slots"):
        eager_admission(s)
