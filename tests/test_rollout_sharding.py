"""The rollout sharded over the mesh: frozen scorers' parameters split like the train state, KV
caches and per-slot state split along the slots, and the same tokens and scores as one device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from oppo_jax.models import init_params
from oppo_jax.parallel.sharding import (
    abstract_params,
    batch_sharding,
    make_device_groups,
    param_shardings,
)
from oppo_jax.pipeline.carry import AdmitRule, Carried, CarryBuffer, admit
from oppo_jax.pipeline.kernels import build_kernels, oppo_decode, oppo_streamed_scoring
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.step import slot_admission
from oppo_jax.rollout import Admission, SamplingConfig
from oppo_jax.rollout.decode import CutRule
from oppo_jax.rollout.spec import RolloutSpec
from oppo_jax.scoring.carried import plan_replay
from oppo_jax.scoring.stream import ScorerSpec, plan_chunk
from oppo_tools.memory.abstract import per_device_bytes
from tests.oracles import admit_scorer, prefill_and_start
from tests.ppo_fixtures import (
    ACTOR,
    CRITIC,
    ListPrompts,
    fresh_slots,
    make_spec,
    tiny_params,
)
from tests.xla_flags import compile_as_in_production

P, R, CHUNK = 4, 16, 6


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _device0_bytes(tree) -> int:
    """Bytes of ``tree`` that live on the mesh's first device (one shard per array)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = next(s for s in x.addressable_shards if s.device == jax.devices()[0])
        total += shard.data.nbytes
    return total


@functools.cache
def _models():
    actor, critic = tiny_params(seed=3)
    return actor, critic, init_params(CRITIC, jax.random.key(7))


def _rollout(placement: Placement | None, num_sequences: int):
    """Admit ``num_sequences`` prompts (slots padded as a run pads them), decode one chunk and
    stream it to the reference and reward scorers; returns (decode state, chunk, scorers)."""
    spec = make_spec(temperature=1.0)
    meshes = {}
    if placement is not None:
        meshes = {"mesh": placement.groups.generation, "scoring_mesh": placement.scoring_mesh}
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompt_width=P, max_response_len=R,
                          eos_ids=(20, 21), **meshes)  # fmt: skip
    kernels = build_kernels(spec, rollout, reward_model=CRITIC)
    actor, _, reward = _models()
    ref = actor
    num_slots = num_sequences
    if placement is not None:
        actor = jax.device_put(actor, param_shardings(ACTOR, placement.groups.generation))
        ref = placement.scoring_params(ACTOR, ref)
        reward = placement.scoring_params(CRITIC, reward)
        num_slots = placement.num_slots(num_sequences)
    rng = np.random.default_rng(0)
    pairs = [(i, rng.integers(2, 64, rng.integers(2, P + 1))) for i in range(num_sequences)]
    slots = fresh_slots(pairs, P, R, extra_slots=num_slots - num_sequences)
    admission = slot_admission(slots)
    state, _ = kernels.prefill_actor(actor, admission, jax.random.key(5), ())
    rule = CutRule(jnp.asarray(slots.active), jnp.asarray(slots.must_finish), jnp.int32(1))
    state, chunk = kernels.decode_tokens(actor, state, rule, CHUNK)
    scorers, fed = {}, chunk if placement is None else placement.to_scoring(chunk)
    for role, params in (("reference", ref), ("reward", reward)):
        scorer, _ = kernels.prefill_prompts(role, params, admission)
        spec = getattr(kernels.scorer_specs, role)
        every_slot = functools.partial(
            oppo_streamed_scoring, spec=spec, kv_width=None, packed=False
        )
        scorers[role], _ = every_slot(params, scorer, fed)
    return state, chunk, scorers, (ref, reward)


def _placement(kind: str, data: int, fsdp: int, tensor: int, scoring: int = 0) -> Placement:
    devices = jax.devices()[: data * fsdp * tensor + scoring]
    return Placement(make_device_groups(kind, data, fsdp, tensor, scoring, devices))


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2)])
def test_colocated_rollout_is_sharded_and_matches_one_device(shape):
    data, fsdp, tensor = shape
    placement = _placement("colocated", *shape)
    # 7 sequences: the slot count is padded to 8 so the slots split evenly over data x fsdp.
    assert placement.num_slots(7) == 8
    state, chunk, scorers, (ref, reward) = _rollout(placement, 7)
    one_state, one_chunk, one_scorers, _ = _rollout(None, 7)
    assert state.tokens.shape[0] == 8 and one_state.tokens.shape[0] == 7

    # Slots over data x fsdp, kv-heads (2) over tensor: each device holds 1/8 of every cache.
    for cache in (state.cache, scorers["reference"].cache, scorers["reward"].cache):
        assert _device0_bytes((cache.k, cache.v)) * data * fsdp * tensor == _nbytes(
            (cache.k, cache.v)
        )
    assert _device0_bytes(state.tokens) * data * fsdp == state.tokens.nbytes
    assert _device0_bytes(scorers["reference"].per_token) * data * fsdp == (
        scorers["reference"].per_token.nbytes
    )
    # The frozen models are laid out like the train state: the sharded size, well under whole.
    for cfg, params in ((ACTOR, ref), (CRITIC, reward)):
        expected = per_device_bytes(
            abstract_params(cfg), param_shardings(cfg, placement.groups.training)
        )
        assert _device0_bytes(params) == expected
        assert expected < _nbytes(params) / 2

    # Same rollout as one device (the padding slot is empty and never samples).
    assert int(np.asarray(chunk.count)[7]) == 0
    np.testing.assert_array_equal(np.asarray(state.tokens)[:7], np.asarray(one_state.tokens))
    np.testing.assert_array_equal(np.asarray(chunk.tokens)[:7], np.asarray(one_chunk.tokens))
    assert int(np.asarray(one_chunk.count).sum()) > 0
    np.testing.assert_allclose(np.asarray(state.logprobs)[:7], one_state.logprobs, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(scorers["reference"].per_token)[:7], one_scorers["reference"].per_token,
        atol=1e-5,
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(scorers["reward"].score)[:7], one_scorers["reward"].score, atol=1e-5
    )


def test_disaggregated_scorers_shard_over_the_scoring_devices():
    placement = _placement("disaggregated", 1, 2, 2, scoring=4)
    mesh = placement.scoring_mesh
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
    assert set(mesh.devices.flat) == set(placement.groups.scoring.devices.flat)
    _, _, scorers, (ref, reward) = _rollout(placement, 8)
    _, _, one_scorers, _ = _rollout(None, 8)
    scoring_devices = set(mesh.devices.flat)
    for params, cfg in ((ref, ACTOR), (reward, CRITIC)):
        assert all(x.sharding.device_set == scoring_devices for x in jax.tree.leaves(params))
        expected = per_device_bytes(abstract_params(cfg), param_shardings(cfg, mesh))
        assert expected < _nbytes(params) / 2
    cache = scorers["reference"].cache
    assert cache.k.sharding.device_set == scoring_devices
    assert cache.k.addressable_shards[0].data.shape[1] == 8 // 4
    np.testing.assert_allclose(
        scorers["reference"].per_token, one_scorers["reference"].per_token, atol=1e-5
    )
    np.testing.assert_allclose(scorers["reward"].score, one_scorers["reward"].score, atol=1e-5)


def test_critic_copy_for_the_scorers_is_sharded_when_disaggregated():
    critic = _models()[2]
    split = _placement("disaggregated", 1, 2, 2, scoring=4)
    copied = split.critic_for_scoring(CRITIC, critic)
    scoring_devices = set(split.scoring_mesh.devices.flat)
    assert all(x.sharding.device_set == scoring_devices for x in jax.tree.leaves(copied))
    one_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(copied))
    assert one_device < _nbytes(critic) / 2  # not a whole copy per scoring device
    for got, want in zip(jax.tree.leaves(copied), jax.tree.leaves(critic), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    together = _placement("colocated", 2, 2, 2)
    assert together.critic_for_scoring(CRITIC, critic) is critic  # already in place


def test_one_scoring_device_keeps_whole_parameters():
    placement = _placement("disaggregated", 1, 1, 1, scoring=1)
    _, reward = _models()[1:]
    params = placement.scoring_params(CRITIC, reward)
    assert _nbytes(params) == sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params)
    )


def test_replayed_admission_with_carried_prefixes_shards_and_agrees():
    mesh = _placement("colocated", 2, 2, 2).groups.training
    buffer = CarryBuffer()
    rng = np.random.default_rng(2)
    for i in range(3):  # three carried partial responses, admitted into the leading slots
        prompt = rng.integers(2, 64, 3).astype(np.int32)
        prefix = rng.integers(30, 64, 5).astype(np.int32)
        buffer.extend([Carried(i, prompt.tolist(), prefix.tolist(), [-1.0] * 5, [0] * 5, 1)])
    pairs = [(10 + i, rng.integers(2, 64, 3)) for i in range(5)]
    slots = admit(buffer, ListPrompts(pairs), AdmitRule(8, 8, True, max_staleness=2), P, R)
    assert int(slots.prefix_len[:3].min()) == 5
    admission = slot_admission(slots)
    plan = plan_replay(slots.context, slots.prompt_len, slots.prefix_len, (P, R))
    actor = _models()[0]
    sharded, whole = (
        jax.jit(functools.partial(admit_scorer, prompt_width=P, plan=plan), static_argnums=0)(
            ScorerSpec(ACTOR, "logprob", R, mesh=m), p, admission
        )
        for m, p in ((mesh, jax.device_put(actor, param_shardings(ACTOR, mesh))), (None, actor))
    )
    assert sharded.cache.k.addressable_shards[0].data.shape[1] == 8 // 4
    np.testing.assert_allclose(sharded.per_token, whole.per_token, atol=1e-5)
    assert np.all(np.asarray(whole.per_token)[:3, :5] < 0)  # the prefixes were scored
    np.testing.assert_allclose(sharded.last_hidden, whole.last_hidden, atol=1e-5)


def _host_reads(fn):
    """(result of fn(), number of device arrays read into host memory meanwhile)."""
    from jax._src import array

    reads, original = [], array.ArrayImpl._value
    with pytest.MonkeyPatch.context() as m:

        def counted(self):
            reads.append(self.shape)
            return original.fget(self)

        m.setattr(array.ArrayImpl, "_value", property(counted))
        out = jax.block_until_ready(fn())
    return out, len(reads)


def test_copies_between_groups_stay_on_devices():
    """Disaggregated: 2 generation devices, 1 scoring device. Slot arrays split over the
    generation devices, and parameters sharded over them, reach the scoring device (and
    scores come back) without passing through host memory, with their values unchanged.
    (A plain jax.device_put reads each of them through the host here.)"""
    placement = _placement("disaggregated", 1, 2, 1, scoring=1)
    gen = placement.groups.generation
    slots = jax.device_put(jnp.arange(6 * 5).reshape(6, 5), batch_sharding(gen, 2))
    assert len(slots.sharding.device_set) == 2
    moved, reads = _host_reads(lambda: placement.to_scoring(slots))
    assert reads == 0
    assert moved.sharding.device_set == set(placement.scoring_mesh.devices.flat)
    np.testing.assert_array_equal(moved, np.arange(30).reshape(6, 5))
    back, reads = _host_reads(lambda: placement.to_generation(moved))
    assert reads == 0 and back.sharding.device_set == set(gen.devices.flat)
    critic = jax.device_put(_models()[1], param_shardings(CRITIC, gen))
    assert not all(x.sharding.is_fully_replicated for x in jax.tree.leaves(critic))
    copy, reads = _host_reads(lambda: placement.critic_for_scoring(CRITIC, critic))
    assert reads == 0
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(critic), strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_activations_are_split_along_the_slots():
    """The model's logical constraints act inside the rollout kernels (traced under the rules):
    on a 1x4x1 mesh each device computes the MLP of its own 2 of 8 slots, never all 8."""
    import re

    mesh = _placement("colocated", 1, 4, 1).groups.generation
    cfg = ACTOR.replace(intermediate_size=88)  # a width that appears nowhere else
    params = jax.device_put(init_params(cfg, jax.random.key(0)), param_shardings(cfg, mesh))
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), P, R, (20,), mesh=mesh)
    admission = Admission.fresh(jnp.full((8, P), 5, jnp.int32), jnp.full((8,), P), R)
    state = jax.jit(functools.partial(prefill_and_start, cfg, rollout=rollout))(
        params, admission, jax.random.key(0)
    )
    rule = CutRule(jnp.ones(8, bool), jnp.zeros(8, bool), jnp.int32(8))
    statics = dict(cfg=cfg, sampling=rollout.sampling, chunk_size=CHUNK, mesh=mesh, kv_width=None)
    # Lowering rebuilds the typed state with abstract leaves, which the runtime shape checks
    # (on in tests) reject: switch them off for the lowering only.
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        hlo = compile_as_in_production(oppo_decode.lower(params, state, rule, **statics)).as_text()
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    rows = set(re.findall(r"f32\[(\d+),1,88\]", hlo))
    assert rows == {"2"}, rows


def test_run_models_are_born_on_the_training_mesh():
    """prepare_run's models are read (or initialised) straight into their shardings over the
    training mesh, never first whole on one device."""
    from oppo_jax.config import load_config
    from oppo_jax.run.setup import _load_models

    cfg = load_config(None, [
        "model.actor_path=random", "model.reward_path=random", "model.preset=tiny",
        "data.prompts=random",
    ])  # fmt: skip
    mesh = _placement("colocated", 1, 2, 2).groups.training
    actor, reward, *_ = _load_models(cfg, mesh, progress=False)
    for model in (actor, reward):
        want = jax.tree.leaves(param_shardings(model.config, mesh))
        got = [x.sharding for x in jax.tree.leaves(model.params)]
        assert got == want
        assert not all(s.is_fully_replicated for s in got)


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 2, 2)])
def test_packed_chunks_on_a_mesh_match_one_device(shape):
    """A streamed chunk scored packed (scoring.stream) on a mesh equals the [S, C] call
    on it and on one device. Steps pack only where the scoring mesh keeps the slots whole
    (tensor only here); on one that splits them the kernel is still exact, but unused."""
    placement = _placement("colocated", *shape)
    meshes = {"mesh": placement.groups.generation, "scoring_mesh": placement.scoring_mesh}
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompt_width=P, max_response_len=R,
                          eos_ids=(20, 21), **meshes)  # fmt: skip
    kernels = build_kernels(make_spec(temperature=1.0), rollout, reward_model=CRITIC)
    actor, _, reward = _models()
    on_mesh = jax.device_put(actor, param_shardings(ACTOR, placement.groups.generation))
    params = {"reference": placement.scoring_params(ACTOR, actor),
              "reward": placement.scoring_params(CRITIC, reward)}  # fmt: skip
    rng = np.random.default_rng(1)
    pairs = [(i, rng.integers(2, 64, rng.integers(2, P + 1))) for i in range(8)]
    admission = slot_admission(fresh_slots(pairs, P, R))
    state, _ = kernels.prefill_actor(on_mesh, admission, jax.random.key(5), ())
    rule = CutRule(admission.active, admission.must_finish, jnp.int32(8))
    state, chunk = kernels.decode_tokens(on_mesh, state, rule, CHUNK)
    counts = np.array([6, 0, 2, 0, 0, 1, 0, 3], np.int32)  # most slots done: 12 of 48 tokens
    chunk = chunk.replace(count=jnp.asarray(counts))
    plans = plan_chunk(counts, CHUNK)
    assert [p["token_row"].size for p in plans] == [6, 6]  # budget (4 rows, 6 tokens): 6 | 3 2 1
    for role in ("reference", "reward"):
        fresh = [kernels.prefill_prompts(role, params[role], admission)[0] for _ in range(3)]
        spec = getattr(kernels.scorer_specs, role)
        score = functools.partial(oppo_streamed_scoring, kv_width=None)
        every, _ = score(params[role], fresh[0], chunk, spec=spec, packed=False)
        packed, packed_kernel = fresh[1], functools.partial(score, spec=spec, packed=True)
        for plan in plans:
            packed, _ = packed_kernel(params[role], packed, chunk, plan)
        single_spec = dataclasses.replace(getattr(kernels.scorer_specs, role), mesh=None)
        one_device = functools.partial(jax.device_put, device=jax.devices()[0])
        inputs = jax.tree.map(one_device, (params[role], fresh[2], chunk))
        one, _ = score(*inputs, spec=single_spec, packed=False)
        for a, b in ((packed, every), (packed, one)):
            np.testing.assert_array_equal(a.num_fed, b.num_fed)
            np.testing.assert_allclose(a.per_token, b.per_token, atol=1e-5, rtol=0)
            np.testing.assert_allclose(a.score, b.score, atol=1e-5, rtol=0)
    assert kernels.packs_chunks == (shape == (1, 1, 2))
