"""Where each role runs, and the once-per-step copies between device groups."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel.sharding import DeviceGroups, make_mesh, padded_slot_count, param_shardings

GENERATION, SCORING = "generation", "scoring"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Generation/training on one mesh, the scorers on the same (colocated) or another."""

    groups: DeviceGroups

    @property
    def disaggregated(self) -> bool:
        return self.groups.placement == "disaggregated"

    @property
    def scoring_group(self) -> str:
        """Timeline name of the group the scorers run on."""
        return SCORING if self.disaggregated else GENERATION

    @functools.cached_property
    def scoring_mesh(self) -> Mesh:
        """The mesh the scorers' parameters and state are sharded over.

        Colocated: the training mesh. Disaggregated: the scoring devices as one fsdp axis
        (1 x n x 1), so the frozen models are split n ways and the slots too (the "batch"
        rule covers data and fsdp); the same devices as ``groups.scoring``.
        """
        if not self.disaggregated:
            return self.groups.training
        devices = list(self.groups.scoring.devices.flat)
        return make_mesh(1, len(devices), 1, devices)

    def num_slots(self, needed: int) -> int:
        """Slots to allocate for ``needed`` sequences: rounded up to a multiple of the
        generation mesh's data x fsdp, so the rollout state shards evenly along the slots.
        The extra slots stay empty (inactive); they never sample and are never selected."""
        return padded_slot_count(needed, self.groups.generation)

    def scoring_params(self, model: ModelConfig, params):
        """A frozen scorer's parameters (reference, reward) sharded over ``scoring_mesh`` like
        the train state (``param_shardings``), instead of a whole copy per device."""
        return move(params, param_shardings(model, self.scoring_mesh))

    def critic_for_scoring(self, model: ModelConfig, params):
        """This step's critic weights where the scorers run: as they are when colocated (the
        train state's layout); copied onto ``scoring_mesh`` and sharded like the frozen
        scorers when disaggregated, so no scoring device holds a whole copy."""
        return self.scoring_params(model, params) if self.disaggregated else params

    def to_scoring(self, tree):
        """Copy arrays to the scoring group (replicated there); a no-op when colocated."""
        if not self.disaggregated:
            return tree
        return move(tree, NamedSharding(self.scoring_mesh, PartitionSpec()))

    def to_generation(self, tree):
        """Copy arrays back to the generation/training group; a no-op when colocated."""
        if not self.disaggregated:
            return tree
        return move(tree, NamedSharding(self.groups.generation, PartitionSpec()))


def move(tree, target):
    """``jax.device_put(tree, target)`` (one sharding, or a tree of them) that copies device to
    device between device groups.

    ``device_put`` copies shard by shard only when each target shard exists whole in some
    buffer of the source; otherwise (e.g. slots split over the generation devices, replicated
    on the scoring device) it assembles the value in host memory first. So each array is first
    laid out on its own devices as the target's shards (``_staging``, an on-device reshard),
    then copied.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(target, Sharding):
        targets = [target] * len(leaves)
    else:  # typed flax structs cannot hold shardings as leaves: pair them up flat
        targets = jax.tree.leaves(target, is_leaf=lambda t: isinstance(t, Sharding))
    moved = [jax.device_put(_staged(x, t), t) for x, t in zip(leaves, targets, strict=True)]
    return jax.tree.unflatten(treedef, moved)


def _staged(x, target: NamedSharding):
    source = getattr(x, "sharding", None)
    if source is None or source.num_devices == 1 or source.device_set == target.device_set:
        return x  # host data, one device (sliced on device), or a reshard jit does itself
    staging = _staging(tuple(source._device_assignment), target)
    return x if staging is None else _reshard(staging)(x)


def _staging(devices: tuple, target: NamedSharding) -> NamedSharding | None:
    """A layout over ``devices`` whose shards are exactly the target's shards, replicated over
    the remaining devices; None when the device counts do not allow one."""
    n, m = target.mesh.size, len(devices)
    if m % n:
        return (
            NamedSharding(Mesh(np.array(devices), ("all",)), PartitionSpec())
            if (target.is_fully_replicated)
            else None
        )
    grid = np.array(devices, dtype=object).reshape(*target.mesh.devices.shape, m // n)
    return NamedSharding(Mesh(grid, (*target.mesh.axis_names, "replica")), target.spec)


@functools.cache
def _reshard(sharding: NamedSharding):
    """An on-device identity that lays its input out as ``sharding`` (same devices)."""
    return jax.jit(lambda x: x, out_shardings=sharding)
