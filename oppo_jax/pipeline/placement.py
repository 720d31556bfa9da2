"""Where each role runs, and the once-per-step copies between device groups."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from oppo_jax.models.model_config import ModelConfig
from oppo_jax.sharding import DeviceGroups, make_mesh, padded_slot_count, param_shardings

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
        return jax.device_put(params, param_shardings(model, self.scoring_mesh))

    def critic_for_scoring(self, model: ModelConfig, params):
        """This step's critic weights where the scorers run: as they are when colocated (the
        train state's layout); copied onto ``scoring_mesh`` and sharded like the frozen
        scorers when disaggregated, so no scoring device holds a whole copy."""
        return self.scoring_params(model, params) if self.disaggregated else params

    def to_scoring(self, tree):
        """Copy arrays to the scoring group (replicated there); a no-op when colocated."""
        if not self.disaggregated:
            return tree
        return jax.device_put(tree, NamedSharding(self.scoring_mesh, PartitionSpec()))

    def to_generation(self, tree):
        """Copy arrays back to the generation/training group; a no-op when colocated."""
        if not self.disaggregated:
            return tree
        return jax.device_put(tree, NamedSharding(self.groups.generation, PartitionSpec()))
