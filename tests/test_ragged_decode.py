"""Ragged decode attention (models.ragged_decode): each row reads only its own keys, from the
cache buffer itself. Both forms, Triton (GPU) and Mosaic (TPU, models.ragged_decode_tpu), in
Pallas's interpreter on the CPU against an independent softmax over the row's keys, over drawn
lengths, widths and head groupings; under a mesh; a whole rollout with it equal to the XLA one
(identical tokens, log-probs within 1e-5); and their lowerings at the 7B configs' shapes: one
Triton call (GH200) and one Mosaic call (TPU v5p, lowered here on the CPU) taking both cache
buffers whole (nothing sliced, transposed or copied before them)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.config import PPOConfig
from oppo_jax.models import ragged_decode as rd
from oppo_jax.models import ragged_decode_tpu as rd_tpu
from oppo_jax.models.attention import ragged_decode
from oppo_jax.models.model_config import preset
from oppo_jax.parallel.sharding import (
    DEFAULT_RULES,
    make_device_groups,
    make_mesh,
    param_shardings,
    tracing_rules,
)
from oppo_jax.pipeline.kernels import build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.step import slot_admission
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from oppo_jax.rollout.decode import CutRule
from oppo_jax.rollout.lengths import LengthSpec
from oppo_tools.sim.packing import RAGGED_KEY_BLOCK, RAGGED_KEY_BLOCK_TPU
from tests.ppo_fixtures import ACTOR, CRITIC, fresh_slots, make_spec
from tests.test_live_prefix import P, R, _admission, _params, _run, assert_same_steps

FEW = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _reference(q, k_cache, v_cache, layer, lengths, width):
    """Softmax over keys 0 .. lengths[s] - 1 of layer ``layer``, kv heads repeated (no
    grouping, no blocks, no splits); a row without keys gives zeros."""
    k = jnp.swapaxes(k_cache[layer], 1, 2)[:, :width]  # [S W K Dh]
    v = jnp.swapaxes(v_cache[layer], 1, 2)[:, :width]
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("shd,swhd->shw", q[:, 0], k) / q.shape[-1] ** 0.5
    seen = jnp.arange(width)[None, None, :] < lengths[:, None, None]
    weights = jnp.where(seen, jax.nn.softmax(jnp.where(seen, logits, -1e30), axis=-1), 0.0)
    return jnp.einsum("shw,swhd->shd", weights, v)[:, None]


def _inputs(s, heads, kv, capacity, dh, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    k_cache = jax.random.normal(keys[0], (3, s, kv, capacity, dh))
    v_cache = jax.random.normal(keys[1], (3, s, kv, capacity, dh))
    return jax.random.normal(keys[2], (s, 1, heads, dh)), k_cache, v_cache


LOWERINGS = ("triton", "mosaic")


@pytest.mark.parametrize("lowering", LOWERINGS)
@FEW
@given(
    data=st.data(),
    shape=st.sampled_from(
        [(4, 2, 80, 80), (6, 2, 96, 64), (2, 1, 40, 24), (8, 4, 256, 128), (4, 2, 64, 48)]
    ),
    seed=st.integers(0, 9),
)
def test_kernel_equals_a_softmax_over_each_rows_keys(lowering, data, shape, seed):
    """Drawn lengths (0, the width, anything between; past the width is clipped to it)."""
    heads, kv, capacity, width = shape
    s = 5
    lengths = data.draw(st.lists(st.integers(0, width + 3), min_size=s, max_size=s))
    lengths = jnp.asarray(lengths, jnp.int32)
    q, k_cache, v_cache = _inputs(s, heads, kv, capacity, 16, seed)
    layer = jnp.int32(data.draw(st.integers(0, 2)))
    got = jax.jit(rd.ragged_decode_attention, static_argnums=(5, 6))(
        q, k_cache, v_cache, layer, lengths, width, lowering
    )
    want = _reference(q, k_cache, v_cache, layer, jnp.minimum(lengths, width), width)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    assert not np.asarray(got)[np.asarray(lengths) == 0].any()  # no keys: zeros


def test_long_rows_split_over_programs_and_combine_exactly():
    """Past 2 x SPLIT_KEYS keys a row runs in several splits (flash-decoding's combine)."""
    width = 4 * rd.SPLIT_KEYS
    assert rd.splits_for(width) == 4 and rd.splits_for(rd.SPLIT_KEYS) == 1
    q, k_cache, v_cache = _inputs(2, 2, 1, width, 16, 0)
    lengths = jnp.asarray([width - 5, rd.SPLIT_KEYS + 3], jnp.int32)  # ends mid-split
    got = rd.ragged_decode_attention(q, k_cache, v_cache, jnp.int32(2), lengths, width)
    want = _reference(q, k_cache, v_cache, 2, lengths, width)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_mosaic_rows_span_several_key_blocks_and_stop_at_their_length():
    """Width 4096: four blocks of 1024; rows end mid-block, on a block edge, at 0 and at the
    width. The index map repeats a row's last block past its length (no further copy)."""
    width = 4096
    q, k_cache, v_cache = _inputs(5, 4, 2, width, 16, 3)
    lengths = jnp.asarray([1500, 1024, 0, width, 1], jnp.int32)
    got = rd.ragged_decode_attention(q, k_cache, v_cache, jnp.int32(1), lengths, width, "mosaic")
    want = _reference(q, k_cache, v_cache, 1, lengths, width)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    assert not np.asarray(got)[2].any()
    index = functools.partial(rd_tpu.cache_block_index, layer_ref=jnp.asarray([2]), block=1024)
    blocks = [[int(index(s, n, lengths_ref=lengths)[3]) for n in range(4)] for s in range(5)]
    assert blocks == [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 2, 3], [0, 0, 0, 0]]
    assert int(index(0, 3, lengths_ref=lengths)[0]) == 2  # the layer from the prefetched scalar


def test_key_blocks_splits_and_the_auto_choice():
    assert rd.KEY_BLOCK == RAGGED_KEY_BLOCK  # the blocks the simulator prices
    assert rd_tpu.KEY_BLOCK == RAGGED_KEY_BLOCK_TPU
    assert [rd.key_block(w) for w in (1536, 1024, 80, 24, 16)] == [128, 128, 16, 8, 16]
    assert [rd_tpu.key_block(w) for w in (2048, 2304, 1536, 528, 24)] == [1024, 256, 512, 16, 8]
    assert rd.block_for(2048, "mosaic") == 1024 and rd.block_for(2048, "triton") == 128
    assert rd.fits_gpu(128, 1536) and not rd.fits_gpu(8, 1536) and not rd.fits_gpu(128, 24)
    assert not rd.fits_gpu(96, 1024)  # Triton wants power-of-two heads
    # auto: the ragged kernel for a decode step on a GPU or a TPU, where its form takes the
    # shapes (a key block of >= 16); on a CPU only when asked for
    assert ragged_decode("auto", 128, 1024, backend="gpu")
    assert not ragged_decode("auto", 128, 1024, backend="cpu")
    assert ragged_decode("auto", 128, 1024, backend="tpu")
    assert ragged_decode("auto", 96, 1536, backend="tpu")  # any head width: a block spans it
    assert not ragged_decode("auto", 128, 24, backend="tpu")
    assert rd.lowering_for("tpu") == "mosaic" and rd.lowering_for("gpu") == "triton"
    with pytest.raises(ValueError, match="lowering 'cuda'"):
        rd.ragged_decode_attention(*_inputs(1, 2, 1, 16, 16, 0), jnp.int32(0),
                                   jnp.asarray([3]), 16, "cuda")  # fmt: skip
    assert not ragged_decode("auto", 8, 1024, backend="gpu")
    assert not ragged_decode("xla", 128, 1024, backend="gpu")
    assert not ragged_decode("cudnn", 128, 1024, backend="gpu")
    assert ragged_decode("ragged", 8, 24, backend="cpu")  # asked for: the interpreter


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_under_a_mesh_each_device_runs_its_slots_and_heads(lowering):
    mesh = make_mesh(2, 1, 2, jax.devices()[:4])
    q, k_cache, v_cache = _inputs(4, 4, 2, 64, 16, 1)
    lengths = jnp.asarray([0, 7, 64, 33], jnp.int32)
    cache = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), "tensor", None, None))
    heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def sharded(q, k_cache, v_cache, lengths):
        with tracing_rules(mesh, DEFAULT_RULES):
            return rd.ragged_decode_attention(
                q, k_cache, v_cache, jnp.int32(1), lengths, 64, lowering
            )

    args = (jax.device_put(q, heads), jax.device_put(k_cache, cache),
            jax.device_put(v_cache, cache), jax.device_put(lengths, rows))  # fmt: skip
    got = jax.jit(sharded)(*args)
    np.testing.assert_allclose(got, _reference(q, k_cache, v_cache, 1, lengths, 64), atol=2e-6)
    assert got.sharding.is_equivalent_to(heads, 4)


def test_a_mesh_that_splits_query_groups_is_a_clear_error():
    """4 query heads over 2 kv heads, tensor 4: a device would hold one query head of a group
    whose kv head lives elsewhere."""
    mesh = make_mesh(1, 1, 4, jax.devices()[:4])
    q, k_cache, v_cache = _inputs(2, 4, 2, 64, 16, 1)

    def sharded(q, k_cache, v_cache):
        with tracing_rules(mesh, DEFAULT_RULES):
            lengths = jnp.asarray([3, 9], jnp.int32)
            return rd.ragged_decode_attention(q, k_cache, v_cache, jnp.int32(0), lengths, 64)

    with pytest.raises(ValueError, match="whole groups per device; use model.attention=xla"):
        jax.jit(sharded)(q, k_cache, v_cache)


@functools.cache
def _kernels(attention: str):
    """The live-prefix tests' kernels, every model's attention on ``attention``."""
    spec = make_spec(PPOConfig(ppo_epochs=1, num_minibatches=2), temperature=1.0)
    spec = dataclasses.replace(spec, actor=ACTOR.replace(attention=attention))
    rollout = RolloutSpec(
        SamplingConfig(temperature=1.0), P, R, eos_ids=(1,), lengths=LengthSpec(8.0, 40.0)
    )
    return build_kernels(spec, rollout, reward_model=CRITIC.replace(attention=attention))


def _decode(kernels, admission, targets, chunk):
    """Decode every slot to its target length (the actor alone), reading the live widths."""
    actor = _params()[0]
    state, _ = kernels.prefill_actor(actor, admission, jax.random.key(0), ())
    state = state.replace(target_len=jnp.asarray(targets, jnp.int32))
    rule = CutRule(admission.active, admission.must_finish, jnp.int32(len(targets)))
    longest = int(np.max(np.asarray(admission.context_len)))
    for i in range(R + 1):
        width = kernels.chunk_width(longest, chunk, i)
        state, tokens = kernels.decode_tokens(actor, state, rule, chunk, width)
        if bool(tokens.ready):
            return state
    raise AssertionError("the rollout never finished")


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk=st.sampled_from([1, 4, 8]), seed=st.integers(0, 3))
def test_rollout_with_the_ragged_kernel_equals_the_xla_rollout(data, chunk, seed):
    """Drawn prompts, carried prefixes and lengths; finished slots (keys 0) ride along."""
    slots = 4
    prompt_lens = data.draw(st.lists(st.integers(1, P), min_size=slots, max_size=slots))
    targets = data.draw(st.lists(st.integers(1, R), min_size=slots, max_size=slots))
    prefixes = [data.draw(st.integers(0, t - 1)) for t in targets]
    admission = _admission(prompt_lens, prefixes, seed)
    got = _decode(_kernels("ragged"), admission, targets, chunk)
    want = _decode(_kernels("xla"), admission, targets, chunk)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.num_generated), np.asarray(want.num_generated))
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


@pytest.mark.slow  # whole OPPO steps (admission, streamed scoring, update) twice per example
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overcommit=st.sampled_from([0, 3]), chunk=st.sampled_from([4, 8]))
def test_oppo_steps_with_the_ragged_kernel_equal_the_xla_steps(overcommit, chunk):
    """Whole steps with Δ carried sequences: same batches, responses, carried work and
    per-token quantities; the ledger counts each fed row's own keys in whole blocks."""
    ragged, xla = (
        _run(_kernels("ragged"), overcommit, chunk),
        _run(_kernels("xla"), overcommit, chunk),
    )
    assert_same_steps(ragged, xla)
    for (a, _), (b, _) in zip(ragged, xla, strict=True):
        (computed, real), (computed_xla, real_xla) = a.work.keys, b.work.keys
        assert real == real_xla and real <= computed < computed_xla


def _sharded_decode(attention: str, shape: tuple[int, int, int] | None):
    """Admit 7 prompts and decode two chunks of 6 with every model's attention on
    ``attention``, on a colocated (data, fsdp, tensor) mesh (None: one device)."""
    actor_cfg = ACTOR.replace(attention=attention)
    spec = dataclasses.replace(make_spec(temperature=1.0), actor=actor_cfg)
    meshes, actor, slots = {}, _params()[0], 7
    if shape is not None:
        n = shape[0] * shape[1] * shape[2]
        groups = make_device_groups("colocated", *shape, 0, jax.devices()[:n])
        place = Placement(groups)
        meshes = {"mesh": groups.generation, "scoring_mesh": place.scoring_mesh}
        actor = jax.device_put(actor, param_shardings(actor_cfg, groups.generation))
        slots = place.num_slots(7)
    rollout = RolloutSpec(
        SamplingConfig(temperature=1.0), prompt_width=P, max_response_len=R, eos_ids=(1,),
        **meshes,
    )  # fmt: skip
    kernels = build_kernels(spec, rollout, reward_model=CRITIC)
    rng = np.random.default_rng(0)
    pairs = [(i, rng.integers(2, 64, rng.integers(1, P + 1))) for i in range(7)]
    admission = slot_admission(fresh_slots(pairs, P, R, extra_slots=slots - 7))
    state, _ = kernels.prefill_actor(actor, admission, jax.random.key(5), ())
    rule = CutRule(admission.active, admission.must_finish, jnp.int32(7))
    for _ in range(2):
        state, _ = kernels.decode_tokens(actor, state, rule, 6)
    return jax.device_get((state.tokens[:7], state.logprobs[:7], state.num_generated[:7]))


def test_rollout_on_a_mesh_with_the_ragged_kernel_equals_one_device_xla(monkeypatch):
    """Slots over data x fsdp, kv heads over tensor: each device runs the kernel on its own
    slots and heads inside the sharded decode, with the same tokens as one device on XLA."""
    seen = []  # (slots, query heads) each traced kernel call got: a device's share
    attend = rd._attend

    def spy(q, *args, **kwargs):
        seen.append(q.shape[:3:2])
        return attend(q, *args, **kwargs)

    monkeypatch.setattr(rd, "_attend", spy)
    tokens, logprobs, lengths = _sharded_decode("ragged", (2, 2, 2))
    assert seen and set(seen) == {(8 // 4, ACTOR.num_heads // 2)}
    want_tokens, want_logprobs, want_lengths = _sharded_decode("xla", None)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(lengths, want_lengths)
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=0)


def _lowered_for_gpu(cfg, slots: int, capacity: int, width: int) -> str:
    """The StableHLO of one layer's ragged attention lowered for CUDA (no GPU needed)."""
    from jax import export

    kv = (cfg.num_layers, slots, cfg.num_kv_heads, capacity, cfg.head_dim)
    args = (
        jax.ShapeDtypeStruct((slots, 1, cfg.num_heads, cfg.head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct(kv, jnp.bfloat16),
        jax.ShapeDtypeStruct(kv, jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
    )
    run = functools.partial(rd._attend, width=width, lowering="triton", interpret=False)
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    return export.export(jax.jit(run), platforms=["cuda"], disabled_checks=[triton])(
        *args
    ).mlir_module()


def test_lowers_to_one_triton_call_reading_the_cache_buffers_whole():
    """Qwen2.5-7B on one GH200 (configs/qwen2.5-7b_gh200x1.yaml): B + Δ = 120 slots, P + R =
    1536 cache columns, a live width of 1024. The cache buffers go to the Triton call as they
    are: a slice or transpose of them would copy the live cache at every layer and step."""
    cfg = preset("qwen2.5-7b")
    assert rd.fits_gpu(cfg.head_dim, 1024) and rd.fits_gpu(cfg.head_dim, 1536)
    text = _lowered_for_gpu(cfg, 120, 1536, 1024)
    calls = [line for line in text.splitlines() if "xla.gpu.triton" in line]
    assert len(calls) == 1, calls
    whole = f"tensor<{cfg.num_layers}x120x{cfg.num_kv_heads}x1536x{cfg.head_dim}xbf16>"
    assert calls[0].count(whole) == 2  # both buffers, whole
    assert "stablehlo.transpose" not in text
    assert "dynamic_slice" not in text  # the one slice left drops the padded query heads


def test_lowers_for_tpu_to_one_mosaic_call_reading_the_cache_buffers_whole():
    """Qwen2.5-7B on a TPU v5p-8 (configs/qwen2.5-7b_tpu-v5p-8.yaml: fsdp 2 x tensor 2): one
    device's share of B + Δ = 104 slots (52) and of the kv heads (2 of 4), P + R = 1536 cache
    columns, a live width of 1024 (one block). Lowered for a TPU on this CPU (the Mosaic
    lowering runs in Python; only its compilation needs a TPU)."""
    cfg, slots, capacity, width = preset("qwen2.5-7b"), 52, 1536, 1024
    heads, kv = cfg.num_heads // 2, cfg.num_kv_heads // 2
    cache = jax.ShapeDtypeStruct((cfg.num_layers, slots, kv, capacity, cfg.head_dim), jnp.bfloat16)
    args = (
        jax.ShapeDtypeStruct((slots, 1, heads, cfg.head_dim), jnp.bfloat16),
        cache,
        cache,
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
    )
    run = functools.partial(
        rd.ragged_decode_attention, width=width, lowering="mosaic", interpret=False
    )
    text = jax.jit(run).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    calls = [line for line in text.splitlines() if "tpu_custom_call" in line]
    assert len(calls) == 1, calls
    whole = f"tensor<{cfg.num_layers}x{slots}x{kv}x{capacity}x{cfg.head_dim}xbf16>"
    assert calls[0].count(whole) >= 2  # both buffers, whole, as operands
    assert "stablehlo.transpose" not in text
    assert "dynamic_slice" not in text and "stablehlo.slice" in text  # drops padded rows only
    assert rd_tpu.fits_tpu(cfg.head_dim, width) and rd_tpu.key_block(width) == 1024


def test_rollout_with_the_mosaic_form_equals_the_xla_rollout(monkeypatch):
    """The TPU form inside a whole decode (interpreted): finished slots and carried prefixes
    ride along; identical tokens, log-probs within 1e-5."""
    monkeypatch.setattr(rd, "lowering_for", lambda backend: "mosaic")
    admission = _admission([3, 1, 4, 2], [0, 2, 5, 0], 1)
    targets = [4, 9, 12, 1]
    got = _decode(_kernels.__wrapped__("ragged"), admission, targets, 4)
    want = _decode(_kernels("xla"), admission, targets, 4)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.num_generated), np.asarray(want.num_generated))
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
