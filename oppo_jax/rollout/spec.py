"""Static settings of a rollout: shapes, sampling and the meshes its state is sharded over."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from oppo_jax.rollout.lengths import LengthSpec
from oppo_jax.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Static shape and sampling settings of the rollout (hashable: a static jit argument)."""

    sampling: SamplingConfig
    prompt_width: int  # P, prompts are right-padded to this many tokens (one compiled shape)
    max_response_len: int  # R, response capacity in tokens
    eos_ids: tuple[int, ...]  # token ids that end a response
    pad_id: int = 0  # padding token id
    mesh: Mesh | None = None  # generation mesh: decode state sharded along slots (None: as is)
    scoring_mesh: Mesh | None = None  # scorers' mesh, likewise (the same one when colocated)
    # synthetic response lengths (rollout.length_sampler lognormal; a benchmarking device);
    # None: the policy decides when to stop
    lengths: LengthSpec | None = None
    group_size: int = 1  # G, samples per prompt (the batch's groups: G contiguous rows)
