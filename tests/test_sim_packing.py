"""The simulator's copies of the engine's shape rules (oppo_jax.sim.packing) against the
engine's own planners on random ragged batches: the packed update's plan (oppo_jax.ppo.packing),
the packed sync scoring's plan (oppo_jax.scoring.packed) and a streamed chunk's packing
(oppo_jax.scoring.packed_chunks). The simulator stays JAX-free,
so it cannot call them; this keeps the copies honest."""

import numpy as np
import pytest

from oppo_jax.ppo.packing import bucket_up
from oppo_jax.ppo.packing import plan_packing as update_plan
from oppo_jax.scoring.packed import plan_packing as score_plan
from oppo_jax.scoring.packed_chunks import chunk_shape
from oppo_jax.sim import packing


@pytest.mark.parametrize("seed", range(4))
def test_mirrors_count_what_the_engine_plans(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        b, p = int(rng.integers(1, 48)), int(rng.choice([4, 16, 512]))
        r = int(rng.choice([32, 512, 1024]))
        median = int(rng.integers(2, 300))
        response = np.minimum(rng.lognormal(np.log(median), 0.94, b).astype(int) + 1, r)
        prompt = rng.integers(1, p + 1, b)
        one_group = np.arange(b)[None, None, None, :]  # one epoch, minibatch, microbatch
        want = update_plan(prompt, response, one_group, p + r, r).tokens_computed
        assert packing.update_tokens(prompt + response, p + r) == want
        want = score_plan(prompt + response, p + r).computed_tokens
        assert packing.score_tokens(prompt + response, p + r) == want
        n = int(rng.integers(1, 4 * (p + r)))
        assert packing.bucket_up(n, 16) == bucket_up(n, 16)
        slots, c = int(rng.integers(1, 40)), int(rng.choice([1, 3, 8, 32]))
        counts = rng.integers(0, c + 1, slots) * (rng.random(slots) < rng.random())
        shape = chunk_shape(counts, c)
        want = slots * c if shape is None else shape[1]
        assert packing.chunk_tokens(int(counts.sum()), slots, c) == want
