"""Meshes, logical-axis rules, sharded init, abstract memory estimates and role device groups."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from oppo_jax.models.model_config import ModelConfig, preset
from oppo_jax.models.transformer import init_params
from oppo_jax.parallel import sharding as sh
from oppo_tools.memory.abstract import per_device_bytes

TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=True,
)


def _spec_of(tree, *path):
    for k in path:
        tree = tree[k]
    return tree.sharding.spec


def test_make_mesh_shape_and_error():
    mesh = sh.make_mesh(2, 2, 2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert [d.id for d in mesh.devices.flat] == list(range(8))
    with pytest.raises(ValueError, match=r"data=3 x fsdp=1 x tensor=2 = 6.*8 devices"):
        sh.make_mesh(3, 1, 2)


@pytest.fixture(scope="module")
def reference_params():
    """Eager ``init_params`` and the single-program jitted init (8x1x1 leaves every param whole)."""
    key = jax.random.PRNGKey(3)
    eager = init_params(TINY, key)
    jitted = sh.init_sharded_params(TINY, key, sh.make_mesh(8, 1, 1))
    return key, eager, jitted


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_init_sharded_equals_init_params(shape, reference_params):
    key, eager, jitted = reference_params
    mesh = sh.make_mesh(*shape)
    got = sh.init_sharded_params(TINY, key, mesh)
    assert jax.tree.structure(got) == jax.tree.structure(eager)
    leaves = (jax.tree.leaves(got), jax.tree.leaves(eager), jax.tree.leaves(jitted))
    for g, e, j in zip(*leaves, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        # Bitwise equal across meshes: the sharding never changes a value (partitionable RNG).
        np.testing.assert_array_equal(np.asarray(g), np.asarray(j))
        # Eager init rounds after every op; XLA fuses normal() * stddev in one program, which
        # moves a few values by one float32 ulp. That is the only allowed difference.
        np.testing.assert_array_max_ulp(np.asarray(g), np.asarray(e), maxulp=1)
    # Specs follow the default rules; every shard really lives on this mesh.
    # Layer parameters are stacked on a leading "layers" axis (the model scans over layers),
    # which the rules keep whole on every device.
    attn = got["layers"]["self_attn"]
    assert _spec_of(attn, "q_proj", "kernel") == P(None, "fsdp", "tensor")
    assert _spec_of(attn, "q_proj", "bias") == P(None, "tensor")
    assert _spec_of(attn, "k_proj", "kernel") == P(None, "fsdp", "tensor")
    assert _spec_of(attn, "o_proj", "kernel") == P(None, "tensor", "fsdp")
    assert _spec_of(got, "layers", "mlp", "down_proj", "kernel") == P(None, "tensor", "fsdp")
    assert _spec_of(got, "embed_tokens", "embedding") == P("tensor", "fsdp")
    assert _spec_of(got, "lm_head", "kernel") == P("fsdp", "tensor")
    assert _spec_of(got, "norm", "scale") == P(None)
    assert _spec_of(got, "layers", "input_layernorm", "scale") == P(None, None)
    q = attn["q_proj"]["kernel"]
    assert q.sharding.mesh == mesh
    # On 1x4x2 the (2, 32, 32) q kernel splits into 8 distinct (2, 8, 16) shards.
    expected = (TINY.num_layers, 32 // shape[1], 32 // shape[2])
    assert {s.data.shape for s in q.addressable_shards} == {expected}


def test_non_divisible_dim_warns_and_replicates():
    cfg = TINY.replace(vocab_size=63)
    mesh = sh.make_mesh(1, 4, 2)
    with pytest.warns(UserWarning) as record:
        shardings = sh.param_shardings(cfg, mesh)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert "['embed_tokens']['embedding'] dim 0 (size 63)" in messages[0]
    assert "['lm_head']['kernel'] dim 1 (size 63)" in messages[1]
    assert all("mesh axis 'tensor'" in m for m in messages)
    emb, head = shardings["embed_tokens"]["embedding"], shardings["lm_head"]["kernel"]
    assert emb.spec == P(None, "fsdp") and emb.shard_shape((63, 32)) == (63, 8)
    assert head.spec == P("fsdp", None) and head.shard_shape((32, 63)) == (8, 63)
    # Divisible parameters are unaffected.
    assert shardings["layers"]["self_attn"]["q_proj"]["kernel"].spec == P(None, "fsdp", "tensor")


def test_per_device_bytes_qwen7b_abstract():
    cfg = preset("qwen2.5-7b", param_dtype="bfloat16", dtype="bfloat16")
    n = cfg.num_params()
    assert 7.5e9 < n < 7.7e9
    abstract = sh.abstract_params(cfg)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract)) == n
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(abstract))
    sharded = per_device_bytes(abstract, sh.param_shardings(cfg, sh.make_mesh(1, 4, 2)))
    assert abs(sharded - n * 2 / 8) / (n * 2 / 8) < 0.01
    assert sharded > n * 2 / 8  # norms and biases are (partly) replicated
    full = per_device_bytes(abstract, sh.param_shardings(cfg, sh.make_mesh(8, 1, 1)))
    assert full == n * 2


def test_rules_context_makes_logical_constraint_effective():
    mesh = sh.make_mesh(2, 2, 2)
    rules = sh.DEFAULT_RULES

    @jax.jit
    def f(x):
        h = nn.with_logical_constraint(x * 2.0, ("batch", "length", "embed"))
        m = nn.with_logical_constraint(x + 1.0, ("batch", "length", "mlp"))
        return h, m

    x = jnp.ones((8, 4, 16))
    # Outside the context flax treats the constraint as a no-op.
    assert f(x)[0].sharding.is_fully_replicated
    with rules.context(mesh):
        h, m = f(x)
        hlo = f.lower(x).as_text()
    # "embed" would want fsdp too, but "batch" took it first, so embed stays unsharded.
    assert h.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, None)), 3)
    assert m.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")), 3)
    assert h.sharding.shard_shape(h.shape) == (2, 4, 16)
    assert m.sharding.shard_shape(m.shape) == (2, 4, 8)
    assert '[{"data", "fsdp"}, {}, {"tensor"}]' in hlo
    np.testing.assert_array_equal(np.asarray(h), 2.0)
    assert rules.spec(("embed", "heads")) == P("fsdp", "tensor")
    assert sh.batch_sharding(mesh, 3).shard_shape((8, 4, 16)) == (2, 4, 16)
    assert sh.replicated(mesh).is_fully_replicated


def test_device_groups():
    co = sh.make_device_groups("colocated", 2, 2, 2)
    for role in ("generation", "training", "scoring"):
        assert sorted(d.id for d in getattr(co, role).devices.flat) == list(range(8))
    assert co.placement == "colocated"

    dis = sh.make_device_groups("disaggregated", 7, 1, 1, scoring_devices=1)
    gen = {d.id for d in dis.generation.devices.flat}
    score = {d.id for d in dis.scoring.devices.flat}
    assert gen == set(range(7)) and score == {7} and not gen & score
    assert dict(dis.generation.shape) == {"data": 7, "fsdp": 1, "tensor": 1}
    assert dis.training is dis.generation
    assert dict(dis.scoring.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    text = dis.describe()
    assert "scoring: devices [7]" in text and "generation: devices [0, 1, 2, 3, 4, 5, 6]" in text

    two = sh.make_device_groups("disaggregated", 3, 1, 2, scoring_devices=2)
    assert dict(two.scoring.shape) == {"data": 2, "fsdp": 1, "tensor": 1}
    assert [d.id for d in two.scoring.devices.flat] == [6, 7]

    with pytest.raises(ValueError, match=r"= 8 must equal the 7 generation/training devices"):
        sh.make_device_groups("disaggregated", 2, 2, 2, scoring_devices=1)
    with pytest.raises(ValueError, match="scoring_devices=8"):
        sh.make_device_groups("disaggregated", 1, 1, 1, scoring_devices=8)
    with pytest.raises(ValueError, match="placement="):
        sh.make_device_groups("split", 2, 2, 2)


def test_multihost_initialize_single_process_is_noop(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for var in ("JAX_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    assert sh.multihost_initialize() is False
    assert sh.multihost_initialize(num_processes=1) is False
    assert calls == []
    assert sh.multihost_initialize("10.0.0.1:1234", num_processes=2, process_id=0) is True
    assert calls == [dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0)]
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert sh.multihost_initialize() is True and len(calls) == 2


def test_kv_cache_shards_slots_and_kv_heads():
    from oppo_jax.models.kv_cache import init_cache

    mesh = sh.make_mesh(2, 2, 2)
    cache = init_cache(TINY, 4, 16)
    assert cache.k.shape == (2, 4, 2, 16, 8)  # [L, S, K, Tc, Dh]: Tc and Dh minor
    k, v, length = sh.slot_shardings(cache, mesh)
    assert k.spec == v.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    assert k.shard_shape(cache.k.shape) == (2, 1, 1, 16, 8)
    assert length.spec == P(("data", "fsdp"))
