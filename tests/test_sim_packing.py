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


@pytest.mark.parametrize("seed", range(3))
def test_update_mirror_packs_each_microbatch_as_the_engine(seed):
    """With gradient accumulation and minibatches each microbatch packs alone and the step's
    one shape is the fullest microbatch's rows, in units of the batch shards: the simulator's
    count equals the engine's plan over the same microbatches."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(25):
        epochs, minibatches, accum = (int(x) for x in rng.integers(1, 4, 3))
        mult = int(rng.choice([1, 2, 4]))
        m = mult * int(rng.integers(1, 5))  # the engine needs microbatches of whole shards
        b, p, r = m * minibatches * accum, int(rng.choice([4, 512])), int(rng.choice([64, 1024]))
        response = np.minimum(rng.lognormal(np.log(100), 0.94, b).astype(int) + 1, r)
        prompt = rng.integers(1, p + 1, b)
        lengths = prompt + response
        groups = packing.UpdateGroups(epochs, minibatches * accum, mult)
        micro = groups.draw(b, seed=int(lengths.sum()))
        assert sorted(micro.reshape(-1, b).ravel()[:b]) == list(range(b))  # a pass: every row
        engine = update_plan(prompt, response, micro[:, None, None, :], p + r, r,
                             row_multiple=mult)  # fmt: skip
        passes = micro.shape[0] // (minibatches * accum)
        assert packing.update_tokens(lengths, p + r, groups) * passes == engine.tokens_computed
        # One microbatch per pass packs the whole batch, as the default UpdateGroups does.
        whole = update_plan(prompt, response, np.arange(b)[None, None, None], p + r, r)
        assert packing.update_tokens(lengths, p + r) == whole.tokens_computed


def test_accumulation_computes_more_than_one_packing_group():
    """A microbatch of few long-prompt sequences packs worse than the whole batch: why the
    configs' gradient accumulation counts (tokens computed, not real, go up)."""
    rng = np.random.default_rng(0)
    lengths = 512 + np.minimum(rng.lognormal(np.log(103), 0.94, 112).astype(int) + 1, 1024)
    whole = packing.update_tokens(lengths, 1536)
    split = packing.update_tokens(lengths, 1536, packing.UpdateGroups(4, 28, 1))
    assert whole >= lengths.sum() and split > 1.15 * whole
    with pytest.raises(ValueError, match="do not split into 28 microbatches"):
        packing.UpdateGroups(1, 28).draw(100)


def test_minibatch_packing_what_if_counts_whole_chunks():
    """The what-if (not built): a minibatch packed whole, run in the chunks it fills. Hand
    count: FFD puts [10, 10, 6, 6, 3, 3, 2, 2] in 16-wide rows as [10 6] [10 6] [3 3 2 2]."""
    lengths = np.array([10, 10, 6, 6, 3, 3, 2, 2])
    # 4 accumulation steps of m = 2: 1-row chunks, the 3 filled ones run
    assert packing.minibatch_update_tokens(lengths, 16, packing.UpdateGroups(1, 4, 1)) == 48
    # rows over 2 shards: 2-row chunks, 2 of them
    assert packing.minibatch_update_tokens(lengths, 16, packing.UpdateGroups(1, 4, 2)) == 64
    # never more than each microbatch packed alone at the fullest one's rows
    rng = np.random.default_rng(1)
    for _ in range(20):
        lengths = 512 + np.minimum(rng.lognormal(np.log(103), 0.94, 112).astype(int) + 1, 1024)
        groups = packing.UpdateGroups(4, 28, 1)
        what_if = packing.minibatch_update_tokens(lengths, 1536, groups)
        assert lengths.sum() <= what_if <= packing.update_tokens(lengths, 1536, groups)
