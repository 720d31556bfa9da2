"""Segment attention (models.segment_attention): causal attention within the segments of packed
rows, visiting only the key blocks a query block's segment reaches. In Pallas's interpreter on
the CPU against XLA's attention with the same-segment causal mask, in values and gradients over
drawn packings, blocks and head groupings; the blocks it visits cover every pair the mask keeps
and are what the simulator prices; under a mesh; the packed update with it equals the update
with XLA's attention (tiny HF Qwen2 and Llama, loaded through the real path); and its GPU
lowering at the 7B config's packed-update shapes: three Triton calls, no [T, T] scores."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

import tests.test_packed_update as packed_update
from oppo_jax.models import attention, kernel_check
from oppo_jax.models import segment_attention as sa
from oppo_jax.models.attention import attend
from oppo_jax.models.model_config import preset
from oppo_jax.models.query_blocks import attention as xla_attention
from oppo_jax.parallel.sharding import DEFAULT_RULES, make_mesh, tracing_rules
from oppo_jax.ppo.packed_update import make_update
from oppo_tools.sim import packing as sim_packing


def _segments(rows: list[list[int]], width: int) -> np.ndarray:
    """Packed segment ids as ``ppo.packing`` lays them out: each row's sequences from column 0,
    ids 0.. (counted over the rows), the unused tail -1 (padding)."""
    seg = np.full((len(rows), width), -1, np.int32)
    ids = iter(range(10**6))
    for r, lengths in enumerate(rows):
        offset = 0
        for n in lengths:
            seg[r, offset : offset + n] = next(ids)
            offset += n
    return seg


def _xla(q, k, v, seg):
    same = seg[:, None, :, None] == seg[:, None, None, :]
    return xla_attention(q, k, v, same, True)


def _qkv(rng, s, t, h, kv, dh):
    return tuple(jnp.asarray(rng.normal(size=(s, t, n, dh)), jnp.float32) for n in (h, kv, kv))


@st.composite
def packings(draw):
    block = draw(st.sampled_from([16, 32]))
    width = block * draw(st.integers(1, 5))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        lengths, room = [], width
        while room and draw(st.booleans()):
            n = draw(st.integers(1, room))
            lengths.append(n)
            room -= n
        rows.append(lengths)
    heads = draw(st.sampled_from([(2, 1), (4, 2), (4, 4)]))
    return block, width, rows, heads


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=packings(), seed=st.integers(0, 2**16))
def test_equals_xla_with_the_segment_mask_in_values_and_gradients(case, seed):
    block, width, rows, (h, kv) = case
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, len(rows), width, h, kv, 16)
    seg = jnp.asarray(_segments(rows, width))
    real = (seg >= 0)[:, :, None, None]
    # Padding's outputs are read by nothing (the kernel zeroes whole blocks of it; XLA lets it
    # attend to itself): the loss weighs real queries only, as the update's does.
    weight = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * real

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * weight), out

    kernel = lambda q, k, v: sa.segment_attention(q, k, v, seg, block=block)  # noqa: E731
    xla = lambda q, k, v: _xla(q, k, v, seg)  # noqa: E731
    grad = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)
    (_, got), got_grads = grad(kernel, q, k, v)
    (_, want), want_grads = grad(xla, q, k, v)
    np.testing.assert_allclose(got * real, want * real, atol=1e-5, rtol=0)
    assert np.isfinite(np.asarray(got)).all()
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def _visited(first: np.ndarray, end: np.ndarray):
    """(query block, key block) pairs the forward (from ``first``) and the dK/dV kernel (from
    ``end``) visit, per row."""
    fwd = [{(i, j) for i, lo in enumerate(r) for j in range(lo, i + 1)} for r in first]
    bwd = [{(i, j) for j, e in enumerate(r) for i in range(j, e)} for r in end]
    return fwd, bwd


@settings(max_examples=30, deadline=None)
@given(case=packings())
def test_visited_blocks_cover_every_kept_pair_and_are_what_the_simulator_prices(case):
    block, width, rows, _ = case
    seg = _segments(rows, width)
    first, end = map(np.asarray, sa.visited_blocks(jnp.asarray(seg), block))
    fwd, bwd = _visited(first, end)
    assert fwd == bwd  # dQ, dK/dV and the forward visit the same blocks
    pos = np.arange(width)
    for r in range(len(rows)):
        real = seg[r] >= 0
        keep = (seg[r][:, None] == seg[r][None, :]) & (pos[None, :] <= pos[:, None])
        keep &= real[:, None]  # what a real query reads
        needed = {(i // block, j // block) for i, j in zip(*np.nonzero(keep), strict=True)}
        assert needed <= fwd[r]
        # Only blocks of the first query's own run: nothing from a run that ended before the
        # block's first query, and nothing for a block of padding only.
        run = np.cumsum(np.concatenate([[1], seg[r][1:] != seg[r][:-1]]))
        for i, j in fwd[r]:
            assert run[min((j + 1) * block, width) - 1] >= run[i * block]
            assert real[i * block : (i + 1) * block].any()
        # The simulator counts the same pairs from the sequences' lengths alone.
        priced = sim_packing.row_segment_pairs(rows[r], width, block)
        assert priced == len(fwd[r]) * block**2
    first, end = sa.visited_blocks(jnp.asarray([[0, 0, 0, 1, 1, 1, -1, -1]]), 2)
    assert first.tolist() == [[0, 0, 1, 4]] and end.tolist() == [[2, 3, 3, 3]]
    assert sim_packing.row_segment_pairs([10, 30], 64, 16) == (1 + 2 + 3 + 0) * 256


def test_blocks_and_shapes_it_takes():
    assert (sa.block_for(1536), sa.block_for(80), sa.block_for(1024)) == (64, 16, 64)
    # The simulator's JAX-free copy of the rule prices the blocks the kernel runs.
    assert all(sim_packing.segment_block(w) == sa.block_for(w) for w in range(16, 4097, 16))
    assert sa.fits(128, 1536) and sa.fits(16, 48)
    assert not sa.fits(8, 64) and not sa.fits(128, 24) and not sa.fits(96, 64)
    q, k, v = _qkv(np.random.default_rng(0), 1, 48, 2, 1, 16)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        sa.segment_attention(q, k, v, jnp.zeros((1, 48), jnp.int32), block=32)


def test_attend_routes_packed_rows_to_it_and_only_those():
    """Packed rows (causal within segments, no cache) with "ragged" (on a GPU: "auto" for half
    heads) take the kernel; any other form, heads it cannot take, or an explicit "cudnn" (the
    kernels before the Pallas ones) stay on XLA."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, 64, 4, 2, 16)
    seg = jnp.asarray(_segments([[20, 30], [64]], 64))
    calls = []
    real = sa.segment_attention
    assert kernel_check.trusted("segment")  # its self-check runs before the spy counts calls

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sa, "segment_attention", spy)
        got = attend(q, k, v, implementation="ragged", causal=True, segment_ids=seg)
        attend(q, k, v, implementation="xla", causal=True, segment_ids=seg)
        attend(q, k, v, implementation="cudnn", causal=True, segment_ids=seg)  # the fallback
        attend(q, k, v, implementation="ragged", causal=True)  # no segments
        attend(q[..., :8], k[..., :8], v[..., :8], implementation="ragged", causal=True,
               segment_ids=seg)  # fmt: skip
        # "auto" on a GPU (resolved as there) for bfloat16 heads: the kernel.
        resolve = attention.resolve
        mp.setattr(attention, "resolve", lambda i, d, h: resolve(i, d, h, "gpu"))
        half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        attend(*half, implementation="auto", causal=True, segment_ids=seg)
    assert calls == [q.shape, q.shape]
    np.testing.assert_allclose(got, _xla(q, k, v, seg), atol=1e-5, rtol=0)


def test_under_a_mesh_each_device_runs_its_rows_and_heads():
    mesh = make_mesh(2, 1, 2, jax.devices()[:4])
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 4, 64, 4, 2, 16)
    seg = jnp.asarray(_segments([[10, 40], [64], [1, 2, 3], []], 64))
    real = (seg >= 0)[:, :, None, None]
    heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))

    def sharded(q, k, v, seg):
        with tracing_rules(mesh, DEFAULT_RULES):
            return sa.segment_attention(q, k, v, seg, block=16)

    args = (*(jax.device_put(x, heads) for x in (q, k, v)), jax.device_put(seg, rows))
    got = jax.jit(sharded)(*args)
    np.testing.assert_allclose(got * real, _xla(q, k, v, seg) * real, atol=1e-5, rtol=0)
    assert got.sharding.is_equivalent_to(heads, 4)


@pytest.mark.parametrize(
    "model_type", ["qwen2", pytest.param("llama", marks=pytest.mark.slow)]
)  # fmt: skip
def test_packed_update_with_it_equals_the_update_with_xla(tmp_path, monkeypatch, model_type):
    """One packed update (2 minibatches x 2 accumulation steps, ragged and carried rows) of a
    tiny HF model with heads of 16 and rows of 32 (blocks of 32): the kernel's losses,
    gradient norms, Adam moments and parameter changes equal XLA's within the float32 bounds
    of tests/tolerances.py (a chain of 8·32 tokens + 2 layers of D = 64: n = 1408)."""
    monkeypatch.setattr(packed_update, "R", 28)  # P + R = 32: rows the kernel tiles
    monkeypatch.setattr(packed_update, "_models", packed_update._models.__wrapped__)
    changes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    save = packed_update.save_tiny_hf_model
    monkeypatch.setattr(
        packed_update, "save_tiny_hf_model", lambda *a, **kw: save(*a, **kw, **changes)
    )
    actor, critic = packed_update._models(model_type, str(tmp_path))
    assert actor.config.head_dim == 16
    spec = packed_update._spec(actor, critic, "token_mean")
    batch = packed_update._batch(spec, actor.params, critic.params, seed=3)
    key = jax.random.key(5)
    ragged = dataclasses.replace(
        spec,
        actor=actor.config.replace(attention="ragged"),
        critic=critic.config.replace(attention="ragged"),
    )
    traced = []
    real = sa.segment_attention
    spy = lambda *a, **kw: traced.append(1) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(sa, "segment_attention", spy)
    want_state, want = packed_update._run(make_update(spec), spec, actor, critic, batch, key)
    assert not traced
    got_state, got = packed_update._run(make_update(ragged), ragged, actor, critic, batch, key)
    assert traced  # the kernel ran in the update's layers (traced once per model and layer)
    assert packed_update._relative_diff(want_state.actor_params, actor.params) > 1e-4
    bounds = packed_update._bounds(actor, critic, keys=32)
    assert bounds.n == 1408  # the number tests/tolerances.py's docstrings work through
    packed_update.assert_updates_agree(actor, critic, got, want, got_state, want_state, bounds)


def test_lowers_for_gpu_at_the_7b_packed_update_shapes():
    """Qwen2.5-7B on one GH200 (configs/qwen2.5-7b_gh200x1.yaml): a microbatch of 4 packed rows
    of P + R = 1536 columns, 28 query and 4 kv heads of 128, bf16. Its forward and backward are
    three Triton calls (forward, dQ, dK/dV) and nothing computes [T, T] scores."""
    cfg = preset("qwen2.5-7b")
    rows, width = 4, 1536
    assert sa.fits(cfg.head_dim, width) and sa.block_for(width) == 64
    q = jax.ShapeDtypeStruct((rows, width, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((rows, width, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((rows, width), jnp.int32)

    def loss(q, k, v, seg):
        out = sa.segment_attention(q, k, v, seg, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    from jax import export

    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    text = export.export(grad, platforms=["cuda"], disabled_checks=[triton])(
        q, kv, kv, seg
    ).mlir_module()
    calls = [line for line in text.splitlines() if "xla.gpu.triton" in line]
    assert len(calls) == 3, calls
    assert f"x{width}x{width}x" not in text  # no score or probability tensor of the row


def test_a_mesh_that_splits_query_groups_is_a_clear_error():
    mesh = make_mesh(1, 1, 4, jax.devices()[:4])  # 4 tensor shards, 2 kv heads
    q, k, v = _qkv(np.random.default_rng(3), 1, 32, 4, 2, 16)
    seg = jnp.zeros((1, 32), jnp.int32)
    with tracing_rules(mesh, DEFAULT_RULES), pytest.raises(ValueError, match="whole groups"):
        jax.jit(lambda *a: sa.segment_attention(*a, block=16))(q, k, v, seg)


def test_sync_packed_scoring_with_it_equals_xla_and_each_sequences_own_forward(monkeypatch):
    """Sync's packed scoring (scoring.packed: rows of L, padding -1, whole rows of it in a
    call's unused rows) through the kernel: reference log-probs equal XLA's packed scoring
    and each sequence's own padded forward within 1e-5."""
    from oppo_jax.models import init_params
    from oppo_jax.models.model_config import ModelConfig
    from oppo_jax.rollout.layout import assemble_sequences
    from oppo_jax.scoring.packed import PackedBatch, plan_packing, score_packed
    from oppo_jax.scoring.stream import ScorerSpec
    from tests.oracles import policy_logprobs

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16)  # fmt: skip
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    rows, width, resp = 9, 6, 26
    prompt_len, resp_len = rng.integers(1, width + 1, rows), rng.integers(1, resp + 1, rows)
    prompts, response = np.zeros((rows, width), np.int32), np.zeros((rows, resp), np.int32)
    for b in range(rows):
        prompts[b, : prompt_len[b]] = rng.integers(2, 64, prompt_len[b])
        response[b, : resp_len[b]] = rng.integers(2, 64, resp_len[b])
    seqs = assemble_sequences(*map(jnp.asarray, (prompts, prompt_len, response, resp_len)))
    # The calls' rows (one a call for B 9) gathered into one batch with a row of padding only
    # after them, which the kernel must skip.
    plans = plan_packing(prompt_len + resp_len, seqs.shape[1])
    width = plans[0].seq.shape[1]
    seq = np.concatenate([p.seq for p in plans] + [np.full((1, width), -1, np.int32)])
    col = np.concatenate([p.col for p in plans] + [np.zeros((1, width), np.int32)])
    call = np.argmax(np.stack([p.in_call for p in plans]), axis=0)  # the call of each sequence
    rows_before = np.cumsum([0] + [p.seq.shape[0] for p in plans])[call]
    row = rows_before + np.choose(call, [p.row for p in plans])
    offset = np.choose(call, [p.offset for p in plans])
    assert seq.shape == (len(plans) + 1, 32) and (seq < 0).all(axis=1).any()  # a padding row
    batch = PackedBatch(seqs, jnp.asarray(prompt_len), jnp.asarray(resp_len),
                        *map(jnp.asarray, (seq, col, row, offset)))  # fmt: skip
    traced, real = [], sa.segment_attention
    monkeypatch.setattr(
        sa, "segment_attention", lambda *a, **kw: traced.append(1) or real(*a, **kw)
    )
    got = score_packed(ScorerSpec(cfg.replace(attention="ragged"), "logprob", resp), params, batch)
    assert len(traced) == cfg.num_layers  # the kernel ran in every layer
    xla = score_packed(ScorerSpec(cfg.replace(attention="xla"), "logprob", resp), params, batch)
    own, _ = policy_logprobs(cfg, params, seqs, jnp.asarray(prompt_len), resp, 1.0)
    mask = np.arange(resp)[None, :] < resp_len[:, None]
    np.testing.assert_allclose(got, xla, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, np.where(mask, own, 0.0), atol=1e-5, rtol=0)
