"""Optimizer state in host memory (``optim.offload``): AdamW moments rest in ``pinned_host``
memory and are streamed to the device for each optimizer update, then back.

On a GH200 the Grace memory (480 GB) sits behind NVLink-C2C, so the moments (two float32
copies of the trained weights) leave the HBM to the rollout's KV caches and the update's
activations. The transfers are XLA's own (``jax.device_put`` to a memory space inside the
jitted update), so the update computes exactly what it computes without offloading.

What rests on the host: the optimizer state only. The master weights stay on the device: the
forward and backward passes read them (streaming them per layer is not done here).
"""

from __future__ import annotations

import jax
import optax

HOST = "pinned_host"


class Offloaded(optax.GradientTransformation):
    """A GradientTransformation whose state rests in host memory (its ``update`` streams the
    state in and the new state out; ``init`` is the inner one)."""

    __slots__ = ()


def offloaded(tx: optax.GradientTransformation) -> Offloaded:
    """``tx`` with its state streamed to the device for each update and back to the host."""

    def update(updates, state, params=None):
        # Back to where each leaf rested: the host in a run. A deviceless GPU compile drops
        # host memory from a program's arguments (its compile-only devices have none), so
        # there the state rests, and stays, on the device (parallel.targets).
        rests = jax.tree.map(lambda x: jax.typeof(x).memory_space, state)
        on_device = jax.device_put(state, jax.memory.Space.Device)
        updates, new_state = tx.update(updates, on_device, params)
        return updates, jax.tree.map(jax.device_put, new_state, rests)

    return Offloaded(tx.init, update)


def resting_shardings(tx, opt_shardings):
    """The optimizer state's shardings where it rests: host memory for an ``Offloaded`` ``tx``,
    as given otherwise."""
    if not isinstance(tx, Offloaded):
        return opt_shardings
    return jax.tree.map(
        lambda sh: sh.with_memory_kind(HOST),
        opt_shardings,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )


def host_memory_supported(device=None) -> bool:
    """Whether ``device`` (default: the first) has a ``pinned_host`` memory to offload to."""
    device = jax.devices()[0] if device is None else device
    return any(m.kind == HOST for m in device.addressable_memories())
