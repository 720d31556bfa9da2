"""Optimizer state in host memory (optim.offload): the same update as with it on the device.

jax 0.10's CPU backend has the host memory kinds (each CPU device lists ``pinned_host`` and
``unpinned_host`` memories, and ``device_put`` to a memory space works inside jit), so the whole
path runs here: the moments rest in ``pinned_host`` between updates and are streamed in and out
by the jitted update. On CPU both memories are the same RAM, so what this checks is the
placement and the numerics, not the bytes saved on an accelerator.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import load_config
from oppo_jax.parallel import offload
from oppo_jax.parallel.sharding import make_mesh
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.update import make_sharded_init
from oppo_jax.run.specs import update_spec
from tests.ppo_fixtures import ACTOR, CRITIC, make_spec, random_batch, tiny_params


def test_cpu_backend_has_pinned_host_memory():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert offload.host_memory_supported() == ("pinned_host" in kinds)
    assert offload.host_memory_supported(), f"this backend's memories: {kinds}"


def _run(spec, mesh, steps: int = 3):
    actor, critic = tiny_params(seed=2)
    batch = random_batch(spec, actor, critic, seed=4)
    update = make_update(spec, mesh)  # the run's update
    state = make_sharded_init(spec, mesh)(actor, critic)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.actor_opt)}
    for i in range(steps):
        state, metrics = update(state, batch, jax.random.key(i), jnp.float32(0.05))
    assert float(metrics["skipped_steps"]) == 0
    return state, kinds


@pytest.mark.parametrize("fsdp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_offloaded_moments_give_the_same_update(fsdp):
    if not offload.host_memory_supported():
        pytest.skip("this backend has no pinned_host memory")
    mesh = make_mesh(1, fsdp, 1, jax.devices()[:fsdp])
    plain = make_spec(lr=1e-3)
    off = dataclasses.replace(
        plain,
        actor_tx=offload.offloaded(plain.actor_tx),
        critic_tx=offload.offloaded(plain.critic_tx),
    )
    want, kinds_plain = _run(plain, mesh)
    got, kinds_off = _run(off, mesh)
    assert kinds_plain == {"device"} and kinds_off == {"pinned_host"}
    # Still resting on the host after the updates, parameters on the device.
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got.critic_opt)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got.actor_params)} == {"device"}
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), want.actor_params,
                                         tiny_params(seed=2)[0]))  # fmt: skip
    assert max(float(x) for x in moved) > 1e-4  # the updates did something


def test_config_key_wraps_the_optimizers():
    cfg = load_config(None, ["optim.offload=true"])
    spec = update_spec(cfg, ACTOR, CRITIC)
    assert isinstance(spec.actor_tx, offload.Offloaded)
    assert isinstance(spec.critic_tx, offload.Offloaded)
    assert not isinstance(
        update_spec(load_config(None, []), ACTOR, CRITIC).actor_tx, offload.Offloaded
    )
