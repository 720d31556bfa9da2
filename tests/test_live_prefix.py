"""Live-prefix decode: a decode chunk (and a streamed scorer chunk) that reads only the first
``live_width`` cache columns gives the same tokens, log-probs and scores as one that reads the
whole P + R cache, over drawn lengths, chunk sizes and Δ; the widths a run compiles are few;
and the compiled chunk neither copies the cache nor grows with its capacity."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oppo_jax.config import PPOConfig
from oppo_jax.models import ModelConfig, Transformer, init_cache, init_params
from oppo_jax.models.kv_cache import MIN_LIVE_WIDTH, live_width, live_widths
from oppo_jax.parallel.sharding import make_device_groups
from oppo_jax.pipeline.accounting import WorkLedger, decode_keys
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.decode_loop import SlotMap
from oppo_jax.pipeline.kernels import Kernels, build_kernels, oppo_streamed_scoring
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.step import run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo.update import init_train_state
from oppo_jax.rollout import Admission, RolloutSpec, SamplingConfig
from oppo_jax.rollout.decode import CutRule
from oppo_jax.rollout.lengths import LengthSpec
from tests.ppo_fixtures import ACTOR, CRITIC, ListPrompts, make_spec, step_engine, step_plan
from tests.xla_flags import compile_as_in_production

P, R = 4, 28  # capacity 32: live widths 16 and 32
ROLES = ("reference", "reward")  # a per-token and a per-sequence scorer (all three: below)
FEW = settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _kernels(median: float) -> Kernels:
    """Kernels whose responses have log-normal lengths of this median (p99 = 5x, cap R)."""
    spec = make_spec(PPOConfig(ppo_epochs=1, num_minibatches=2), temperature=1.0)
    rollout = RolloutSpec(
        SamplingConfig(temperature=1.0), P, R, eos_ids=(1,), lengths=LengthSpec(median, 5 * median)
    )
    kernels = build_kernels(spec, rollout, reward_model=CRITIC)
    # P + R is under shapes.LIVE_WIDTH_MIN_CAPACITY, where a run reads the whole cache: the
    # live widths are switched on for these tests, which check them.
    return dataclasses.replace(kernels, live_prefix=True)


@functools.cache
def _params():
    keys = jax.random.split(jax.random.key(3), 3)
    return init_params(ACTOR, keys[0]), init_params(CRITIC, keys[1]), init_params(CRITIC, keys[2])


def _admission(prompt_lens, prefix_lens, seed):
    """Slots with prompts and carried prefixes (all prefilled at the full width P + R)."""
    rng = np.random.default_rng(seed)
    s = len(prompt_lens)
    context = np.zeros((s, P + R), np.int32)
    for i, (n, k) in enumerate(zip(prompt_lens, prefix_lens, strict=True)):
        context[i, : n + k] = rng.integers(2, ACTOR.vocab_size, n + k)
    return Admission(
        context=jnp.asarray(context),
        prompt_len=jnp.asarray(prompt_lens, jnp.int32),
        prefix_len=jnp.asarray(prefix_lens, jnp.int32),
        prefix_finished=jnp.zeros(s, bool),
        prefix_behaviour=jnp.zeros((s, R), jnp.float32),
        prompt_id=jnp.arange(s, dtype=jnp.int32) + 100 * seed,
        sample_index=jnp.zeros(s, jnp.int32),
        active=jnp.ones(s, bool),
        must_finish=jnp.ones(s, bool),  # the rollout runs until every slot has finished
    )


def _rollout(kernels: Kernels, admission: Admission, targets, chunk: int):
    """Decode every slot to its target length in chunks, streaming each chunk to the three
    scorers, with the widths ``kernels.chunk_width`` picks (None without live prefix)."""
    actor, critic, reward = _params()
    params = {"reference": actor, "critic": critic, "reward": reward}
    state, _ = kernels.prefill_actor(actor, admission, jax.random.key(0), ())
    state = state.replace(target_len=jnp.asarray(targets, jnp.int32))
    scorers = {r: kernels.prefill_prompts(r, params[r], admission)[0] for r in ROLES}
    rule = CutRule(admission.active, admission.must_finish, jnp.int32(len(targets)))
    longest = int(np.max(np.asarray(admission.context_len)))
    widths = []
    for i in range(R + 1):
        width = kernels.chunk_width(longest, chunk, i)
        widths.append(width)
        state, tokens = kernels.decode_tokens(actor, state, rule, chunk, width)
        for r in ROLES:
            spec = getattr(kernels.scorer_specs, r)  # every slot
            scorers[r] = oppo_streamed_scoring(
                params[r], scorers[r], tokens, None, spec=spec, kv_width=width, packed=False
            )[0]
        if bool(tokens.ready):
            return state, scorers, widths
    raise AssertionError("the rollout never finished")


def _assert_same_rollout(live, full):
    (state, scorers, _), (state_ref, scorers_ref, _) = live, full
    np.testing.assert_array_equal(np.asarray(state.tokens), np.asarray(state_ref.tokens))
    np.testing.assert_array_equal(
        np.asarray(state.num_generated), np.asarray(state_ref.num_generated)
    )
    np.testing.assert_allclose(state.logprobs, state_ref.logprobs, atol=1e-5, rtol=0)
    for r in ROLES:
        a, b = scorers[r], scorers_ref[r]
        np.testing.assert_allclose(a.per_token, b.per_token, atol=1e-5, rtol=0, err_msg=r)
        np.testing.assert_allclose(a.score, b.score, atol=1e-5, rtol=0, err_msg=r)


@FEW
@given(
    data=st.data(),
    slots=st.integers(2, 5),
    chunk=st.sampled_from([3, 8]),
    seed=st.integers(0, 3),
)
def test_live_prefix_rollout_equals_full_cache_rollout(data, slots, chunk, seed):
    """Drawn prompt, carried-prefix and response lengths: identical tokens, log-probs and
    streamed scores within 1e-5, with fewer columns read on the way."""
    prompt_lens = data.draw(st.lists(st.integers(1, P), min_size=slots, max_size=slots))
    targets = data.draw(st.lists(st.integers(1, R), min_size=slots, max_size=slots))
    prefixes = [data.draw(st.integers(0, t - 1)) for t in targets]
    admission = _admission(prompt_lens, prefixes, seed)
    kernels = _kernels(8.0)
    live = _rollout(kernels, admission, targets, chunk)
    full = _rollout(dataclasses.replace(kernels, live_prefix=False), admission, targets, chunk)
    _assert_same_rollout(live, full)
    assert set(full[2]) == {None}
    # Each chunk's width covers its longest possible context, is a listed bucket, never shrinks.
    longest = max(p + k for p, k in zip(prompt_lens, prefixes, strict=True))
    for i, width in enumerate(live[2]):
        assert width in live_widths(P + R)
        assert width >= min(longest + (i + 1) * chunk, P + R)
    assert live[2] == sorted(live[2])


def test_a_width_below_the_live_context_changes_the_result():
    """The comparison above can fail: reading fewer columns than the context holds drops keys."""
    kernels = _kernels(8.0)
    admission = _admission([4, 4], [18, 10], seed=0)  # contexts of 22 and 14 tokens
    targets = [26, 26]
    full = _rollout(dataclasses.replace(kernels, live_prefix=False), admission, targets, 4)
    short = dataclasses.replace(kernels, live_prefix=True)
    object.__setattr__(short, "chunk_width", lambda *_: 16)  # too narrow on purpose
    with pytest.raises(AssertionError):
        _assert_same_rollout(_rollout(short, admission, targets, 4), full)


@dataclasses.dataclass(frozen=True)
class _WidthSpy(Kernels):
    """Kernels that record the live width and the slots of every decode chunk dispatched."""

    seen: list = dataclasses.field(default_factory=list)
    slots: list = dataclasses.field(default_factory=list)

    def decode_tokens(self, params, state, rule, chunk_size, kv_width=None):
        self.seen.append(kv_width)
        self.slots.append(state.tokens.shape[0])
        return super().decode_tokens(params, state, rule, chunk_size, kv_width)


def _run(kernels: Kernels, overcommit: int, chunk: int, steps: int = 3):
    """``steps`` OPPO steps (streamed scoring, B = 4 + Δ carried) from fixed parameters."""
    actor, critic, reward = _params()
    place = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    state = init_train_state(kernels.spec, *jax.tree.map(jnp.copy, (actor, critic)))
    rng = np.random.default_rng(0)
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(1, P + 1))) for i in range(64)])
    buffer, timeline, results = CarryBuffer(), Timeline(), []
    engine = step_engine(kernels, place, actor, reward)
    for step in range(steps):
        plan = step_plan(step, 4, overcommit=overcommit, chunk_size=chunk)
        state, carried, result = run_step(
            engine, SCHEDULES["oppo"], plan, state, buffer, prompts, timeline
        )
        buffer.extend(carried)
        results.append((result, [(c.prompt_id, list(c.response)) for c in carried]))
    return results


def assert_same_steps(got, want) -> None:
    """Two ``_run``s agree: batches, responses, carried work, and the per-token quantities
    (behaviour and reference log-probs, values, scores) within 1e-5."""
    for (a, carried_a), (b, carried_b) in zip(got, want, strict=True):
        assert a.selection.batch.tolist() == b.selection.batch.tolist()
        np.testing.assert_array_equal(a.rollout.tokens, b.rollout.tokens)
        np.testing.assert_allclose(a.rollout.logprobs, b.rollout.logprobs, atol=1e-5, rtol=0)
        assert carried_a == carried_b
        for key in ("ref_logp", "old_values", "scores", "old_logp"):
            np.testing.assert_allclose(
                getattr(a.batch, key), getattr(b.batch, key), atol=1e-5, rtol=0, err_msg=key
            )


@pytest.mark.slow  # whole steps (admission, scoring, update) twice per example
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    median=st.sampled_from([4.0, 10.0]),
    overcommit=st.sampled_from([0, 3]),
    chunk=st.sampled_from([4, 8]),
)
def test_steps_with_carrying_equal_full_cache_steps(median, overcommit, chunk):
    """Whole OPPO steps with Δ carried sequences, decoding the live prefix and compacting the
    slots: same batches, responses, carried work, behaviour/reference log-probs, values and
    scores as reading the whole cache of every slot to the end."""
    base = _kernels(median)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Kernels)}
    spy = _WidthSpy(**{**fields, "compact_slots": True})
    live = _run(spy, overcommit, chunk)
    plain = dataclasses.replace(base, live_prefix=False, compact_slots=False)
    full = _run(plain, overcommit, chunk)
    assert_same_steps(live, full)
    # Few compiled widths: all from the listed buckets (here 16 and 32), and narrower ones used.
    # The work ledger: the same live keys, fewer keys read.
    for (a, _), (b, _) in zip(live, full, strict=True):
        assert a.work.keys[1] == b.work.keys[1]
        assert a.work.keys[0] <= b.work.keys[0]
    assert set(spy.seen) <= set(live_widths(P + R))
    assert min(spy.seen) < P + R
    # Compacted chunks run over power-of-two buckets below the B + Δ slots admitted.
    assert all(n == 4 + overcommit or (n < 4 + overcommit and n & (n - 1) == 0) for n in spy.slots)


@given(capacity=st.integers(1, 40_000), longest=st.integers(0, 50_000))
@settings(max_examples=200, deadline=None)
def test_live_widths_are_few_and_cover_the_context(capacity, longest):
    widths = live_widths(capacity)
    assert len(widths) <= max(1, math.ceil(math.log2(capacity / MIN_LIVE_WIDTH)) + 1)
    width = live_width(longest, capacity)
    assert width in widths
    assert width >= min(longest, capacity)
    assert width == capacity or width < 2 * max(longest, MIN_LIVE_WIDTH)


def test_kv_width_past_the_capacity_is_an_error():
    cache = init_cache(ACTOR, 1, 8)
    params = init_params(ACTOR, jax.random.key(0))
    with pytest.raises(ValueError, match="kv_width 9 outside 1..8"):
        Transformer(ACTOR).apply(
            {"params": params}, jnp.zeros((1, 1), jnp.int32), cache, kv_width=9
        )


def test_compiled_chunk_reads_a_slice_and_copies_no_cache():
    """At a larger shape (capacity 2048), a chunk of cached decode steps: the cache is updated
    in place (aliased, never copied whole), and the scratch memory follows the live width."""
    cfg = ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    s, capacity = 4, 2048
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    cache = jax.eval_shape(lambda: init_cache(cfg, s, capacity))
    tokens = jax.ShapeDtypeStruct((s, 1), jnp.int32)

    def chunk(params, cache, tokens, width):
        def step(_, cache):
            return Transformer(cfg).apply({"params": params}, tokens, cache, kv_width=width)[1]

        return jax.lax.fori_loop(0, 4, step, cache)

    kernel = jax.jit(chunk, static_argnums=3, donate_argnums=1)
    cache_shape = (cfg.num_layers, s, cfg.num_kv_heads, capacity, cfg.head_dim)
    cache_bytes = 2 * math.prod(cache_shape) * 4
    full_name = "f32[" + ",".join(map(str, cache_shape)) + "]"
    temps = {}
    for width in (None, 128):
        compiled = compile_as_in_production(kernel.lower(params, cache, tokens, width))
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes >= cache_bytes  # keys and values updated in place
        copies = [
            line
            for line in compiled.as_text().splitlines()
            if " copy(" in line and line.split("=")[1].strip().startswith(full_name)
        ]
        assert not copies, copies[:3]
        temps[width] = memory.temp_size_in_bytes
    layer_bytes = cache_bytes // cfg.num_layers  # one layer's keys and values, full width
    assert temps[128] < layer_bytes / 4 < temps[None]


def _rollout_compacting(kernels: Kernels, admission: Admission, targets, chunk: int):
    """``_rollout`` that gathers the running slots into a smaller bucket whenever they fit in
    half of it (``SlotMap``), and scatters every row back into the full layout at the end."""
    actor, critic, reward = _params()
    params = {"reference": actor, "critic": critic, "reward": reward}
    s = len(targets)
    state, _ = kernels.prefill_actor(actor, admission, jax.random.key(0), ())
    state = state.replace(target_len=jnp.asarray(targets, jnp.int32))
    states = {r: kernels.prefill_prompts(r, params[r], admission)[0] for r in ROLES}
    rule = CutRule(admission.active, admission.must_finish, jnp.int32(s))
    longest = int(np.max(np.asarray(admission.context_len)))
    slot_map, sizes = SlotMap(s), []
    for i in range(R + 1):
        width = kernels.chunk_width(longest, chunk, i)
        sizes.append(state.tokens.shape[0])
        state, tokens = kernels.decode_tokens(actor, state, rule, chunk, width)
        full = slot_map.full_chunk(tokens)  # the scorers stay in the admission's layout
        for r in ROLES:
            spec = getattr(kernels.scorer_specs, r)  # every slot
            states[r] = oppo_streamed_scoring(
                params[r], states[r], full, None, spec=spec, kv_width=width, packed=False
            )[0]
        if int(tokens.running) < 0:  # ready
            break
        running = int(tokens.running)
        state, _, rule = slot_map.maybe_compact(running, tokens.finished, state, tokens, rule)
    state = slot_map.restore(state)
    return state, states, sizes


@FEW
@given(
    data=st.data(),
    chunk=st.sampled_from([2, 5]),
    seed=st.integers(0, 3),
)
def test_compacted_rollout_equals_the_uncompacted_one(data, chunk, seed):
    """Slots gathered into smaller buckets as they finish: identical tokens, log-probs and
    streamed scores within 1e-5 (keys travel with the slots), on the original slot layout."""
    slots = 8
    prompt_lens = data.draw(st.lists(st.integers(1, P), min_size=slots, max_size=slots))
    targets = data.draw(st.lists(st.integers(1, R), min_size=slots, max_size=slots))
    targets[seed % slots] = R  # one long sequence, so the others finish first
    admission = _admission(prompt_lens, [0] * slots, seed)
    kernels = _kernels(8.0)
    compacted = _rollout_compacting(kernels, admission, targets, chunk)
    _assert_same_rollout(compacted, _rollout(kernels, admission, targets, chunk))
    assert min(compacted[2]) < slots  # it did compact


def test_decode_keys_on_hand_counted_cases():
    # chunks of 8 over 8 slots reading 16 then 32 columns; 12 steps: 8 + 4 steps run
    assert decode_keys([8, 8], [16, 32], 12, 8, ([2], [0], [0]))[0] == 8 * 8 * 16 + 8 * 4 * 32
    # prompt 2, 3 new tokens at response indices 0..2 need 3, 4 and 5 keys
    assert decode_keys([1], [16], 3, 8, ([2], [0], [3]))[1] == 3 + 4 + 5
    # a carried prefix of 1: the new tokens sit at indices 1..3 (4, 5 and 6 keys)
    assert decode_keys([1], [16], 3, 8, ([2], [1], [4]))[1] == 4 + 5 + 6
    # Ragged (blocks of 4): each fed row its own keys in whole blocks, finished rows none.
    assert decode_keys([1], [16], 3, 8, ([2], [0], [3]), [4]) == (4 + 4 + 8, 3 + 4 + 5)
    # Two chunks of 2 over a slot fed 3 times from prompt 2, prefix 1 (keys 4, 5 | 6), and a
    # slot that finished before the rollout (prefix 5, nothing fed): it reads nothing.
    lengths = ([2, 1], [1, 5], [4, 5])
    assert decode_keys([2, 2], [16, 16], 3, 2, lengths, [4, 4])[0] == (4 + 8) + 8
    assert decode_keys([2, 2], [16, 16], 3, 2, lengths, [4, None])[0] == (4 + 8) + 2 * 16 * 1
    ledger = WorkLedger()
    ledger.keys = (100, 40)
    assert ledger.to_record()["decode_keys"] == {"computed": 100, "real": 40, "efficiency": 0.4}


def test_take_slots_keeps_uncommitted_leaves_on_the_rows_mesh():
    """Rows computed on a two-device mesh gather an uncommitted leaf (the cut rule's flags, made
    by jnp) onto that mesh, not onto one device: a later kernel over the mesh takes both."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from oppo_jax.rollout.compaction import take_slots

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    rows = jax.device_put(jnp.array([1, 3], jnp.int32), NamedSharding(mesh, PartitionSpec()))
    flags = jnp.array([True, False, True, False])  # uncommitted, on the default device
    placed = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, PartitionSpec()))
    kept_flags, kept_values = take_slots((flags, placed), rows, 4)
    assert kept_flags.tolist() == [False, False] and kept_values.tolist() == [1.0, 3.0]
    assert kept_flags.sharding.device_set == set(jax.devices()[:2])
    both = jax.jit(lambda a, b: jnp.where(a, b, 0.0))(kept_flags, kept_values)
    assert both.tolist() == [0.0, 0.0]
