"""One process of the multi-host PPO-update check in tests/test_multihost.py.

Run as ``python -m tests.multihost_worker OUT.npz DATA FSDP TENSOR`` from the repository root.
The runtime is joined exactly as ``oppo-jax train`` joins it: ``multihost_initialize()`` reads
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, and with none of them set this
is an ordinary single process. Then, on a (data, fsdp, tensor) mesh over all global devices:
tiny actor and critic parameters are placed on their shardings from host copies, two
deterministic PPO batches are built as global arrays from the rows each process holds, and
two sharded PPO updates run. The final parameters and metrics, gathered to every process,
go to ``OUT.npz`` (plain arrays, no pickle) with the initial parameters and a few facts
about the runtime.
"""

from __future__ import annotations

import functools
import json
import sys

import jax

from oppo_jax.parallel.sharding import make_mesh, multihost_initialize

multihost_initialize()  # before any JAX computation, as in the command line

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from oppo_jax.config import PPOConfig  # noqa: E402
from oppo_jax.ppo.update import (  # noqa: E402
    batch_shardings,
    make_sharded_init,
    train_state_shardings,
)
from tests.padded_update import make_sharded_update  # noqa: E402
from tests.ppo_fixtures import make_spec, random_batch, tiny_params  # noqa: E402

# Same numerics as the test process (tests/conftest.py).
jax.config.update("jax_default_matmul_precision", "highest")

PPO = PPOConfig(ppo_epochs=2, num_minibatches=2, grad_accum_steps=2, entropy_coef=0.01)
ROWS = 8  # B; each microbatch (2 rows) still splits over data x fsdp <= 2 shards
STEPS = 2


def _local_rows(sharding, shape) -> slice:
    """The contiguous rows of a row-sharded global array that this process's devices hold."""
    rows = [idx[0] for idx in sharding.addressable_devices_indices_map(shape).values()]
    start, stop = min(r.start or 0 for r in rows), max(r.stop or shape[0] for r in rows)
    return slice(start, stop)


def global_batch(host_batch, mesh):
    """A global PPOBatch from the host rows this process owns (as a data loader would give)."""

    def one(x, sharding):
        x = np.asarray(x)
        local = x[_local_rows(sharding, x.shape)]
        return jax.make_array_from_process_local_data(sharding, local, x.shape)

    return jax.tree.map(one, host_batch, batch_shardings(mesh))


def global_params(host_tree, shardings):
    """Place a host tree, identical on every process, onto ``shardings`` (one shard each)."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
        host_tree,
        shardings,
    )


def _flat(prefix: str, tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {prefix + jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def main(out: str, data: int, fsdp: int, tensor: int) -> None:
    mesh = make_mesh(data, fsdp, tensor)  # all global devices, in jax.devices() order
    spec = make_spec(PPO)
    # Host copies, computed the same way on every process (seeded, one local device; jitted
    # whole, as op-by-op dispatch would compile every small op).
    actor, critic = jax.device_get(jax.jit(tiny_params, static_argnums=0)(0))
    rows = jax.jit(functools.partial(random_batch, spec, rows=STEPS * ROWS))(actor, critic)
    host_batches = [
        jax.tree.map(lambda x, i=i: np.asarray(x[i * ROWS : (i + 1) * ROWS]), rows)
        for i in range(STEPS)
    ]
    state_sh = train_state_shardings(spec, mesh)
    state = make_sharded_init(spec, mesh)(
        global_params(actor, state_sh.actor_params), global_params(critic, state_sh.critic_params)
    )
    update, _ = make_sharded_update(spec, mesh)
    metrics = []
    for step, host_batch in enumerate(host_batches):
        key = jax.random.fold_in(jax.random.key(3), step)
        state, m = update(state, global_batch(host_batch, mesh), key, jnp.float32(0.05))
        metrics.append(m)
    final = {"actor": state.actor_params, "critic": state.critic_params, "metrics": metrics}
    gathered = multihost_utils.process_allgather(final, tiled=True)
    facts = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(),
        # Process of each device along the fsdp axis: shows whether that axis spans processes.
        "fsdp_processes": [int(d.process_index) for d in mesh.devices[0, :, 0]],
        "batch_rows_here": _local_rows(batch_shardings(mesh).tokens, (ROWS, 1)).indices(ROWS),
    }
    arrays = {**_flat("final", gathered), **_flat("init", {"actor": actor, "critic": critic})}
    np.savez(out, facts=np.array(json.dumps(facts)), **arrays)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
