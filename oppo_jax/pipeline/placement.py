"""Where each role runs, and the once-per-step copies between device groups."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.sharding import DeviceGroups

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

    def to_scoring(self, tree):
        """Copy arrays to the scoring group (replicated there); a no-op when colocated."""
        if not self.disaggregated:
            return tree
        return jax.device_put(tree, NamedSharding(self.groups.scoring, PartitionSpec()))

    def to_generation(self, tree):
        """Copy arrays back to the generation/training group; a no-op when colocated."""
        if not self.disaggregated:
            return tree
        return jax.device_put(tree, NamedSharding(self.groups.generation, PartitionSpec()))
