"""The simulator's token counts (oppo_tools.sim.packing, built on the engine's shape rules in
oppo_jax.base.shapes) against the engine's own planners on random ragged batches: the packed
update's plan (oppo_jax.ppo.packing), the packed sync scoring's plan (oppo_jax.scoring.packed),
a streamed chunk's packing (oppo_jax.scoring.stream) and the replay of carried prefixes
(oppo_jax.scoring.carried)."""

import numpy as np
import pytest

from oppo_jax.base.shapes import row_bucket
from oppo_jax.ppo.packing import microbatch_rows
from oppo_jax.ppo.packing import plan_packing as update_plan
from oppo_jax.scoring.carried import REPLAY_CHUNK, plan_replay
from oppo_jax.scoring.packed import plan_packing as score_plan
from oppo_jax.scoring.stream import plan_chunk
from oppo_tools.sim import packing


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
        want = update_plan(prompt, response, one_group, (p + r, r)).tokens_computed
        assert packing.update_tokens(prompt + response, p + r) == want
        want = sum(plan.computed_tokens for plan in score_plan(prompt + response, p + r))
        assert packing.score_tokens(prompt + response, p + r) == want
        slots, c = int(rng.integers(1, 40)), int(rng.choice([1, 3, 8, 32]))
        counts = rng.integers(0, c + 1, slots) * (rng.random(slots) < rng.random())
        want = sum(plan["token_row"].size for plan in plan_chunk(counts, c))
        assert packing.chunk_tokens(counts, c) == want


@pytest.mark.parametrize("seed", range(3))
def test_replay_mirror_counts_the_engines_plan(seed):
    assert packing.REPLAY_CHUNK == REPLAY_CHUNK
    rng = np.random.default_rng(seed)
    for _ in range(60):
        slots, r, p = int(rng.integers(1, 130)), int(rng.choice([64, 1024, 4096])), 8
        carried = int(rng.integers(0, slots + 1))
        prefix = np.zeros(slots, int)
        prefix[:carried] = rng.integers(0, r + 1, carried)  # FIFO order: any lengths
        context = np.zeros((slots, p + r), np.int32)
        plan = plan_replay(context, np.full(slots, p), prefix, (p, r))
        assert packing.replay_tokens(prefix, slots) == sum(c.tokens.size for c in plan)
        assert packing.row_bucket(carried, slots) == row_bucket(carried, slots)
    # The split admission before the replay (recorded benches): the rows bucket covers every
    # carried prefix, and the width the longest one's power of two.
    assert [packing.prefix_bucket(n, 64) for n in (0, 5, 16, 17, 40, 64)] == [0, 16, 16, 32, 64, 64]
    assert packing.prefix_bucket(30, 24) == 24
    assert packing.split_rows([3, 0, 5, 0, 0], 8) == 4 and packing.split_rows([0, 0], 8) == 0


@pytest.mark.parametrize("seed", range(3))
def test_update_mirror_counts_the_engines_chunks(seed):
    """With minibatches and gradient accumulation each minibatch packs whole and is dealt to
    its A chunks of one height for the step, in units of the batch shards, and only chunks
    holding sequences run: the simulator's count equals the engine's plan over the same
    minibatches."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(25):
        epochs, minibatches, accum = (int(x) for x in rng.integers(1, 4, 3))
        mult, k = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2]))  # shards, width factor
        m = mult * int(rng.integers(1, 5))  # the engine needs microbatches of whole shards
        b, p, r = m * minibatches * accum, int(rng.choice([4, 512])), int(rng.choice([64, 1024]))
        response = np.minimum(rng.lognormal(np.log(100), 0.94, b).astype(int) + 1, r)
        prompt = rng.integers(1, p + 1, b)
        lengths = prompt + response
        perms = np.stack([rng.permutation(b) for _ in range(epochs)])
        micro = microbatch_rows(perms, minibatches, accum)
        engine = update_plan(prompt, response, micro, (p + r, r), row_multiple=mult, width_factor=k)
        minis = micro.reshape(epochs * minibatches, accum * m)
        groups = packing.UpdateGroups(epochs, minibatches * accum, mult, minibatches, k)
        assert packing.minibatch_slots(lengths, p + r, minis, groups) == engine.tokens_computed
        # One minibatch per pass: every pass packs the whole batch alike, as update_tokens says.
        groups = packing.UpdateGroups(epochs, accum, mult, width_factor=k)
        one = update_plan(prompt, response, microbatch_rows(perms, 1, accum), (p + r, r),
                          row_multiple=mult, width_factor=k)  # fmt: skip
        assert packing.update_tokens(lengths, p + r, groups) * epochs == one.tokens_computed


def test_chunks_count_whole_chunks_that_hold_sequences():
    """Hand count: FFD puts [10, 10, 6, 6, 3, 3, 2, 2] in 16-wide rows as [10 6] [10 6]
    [3 3 2 2]; a config's accumulation then costs about what one packing group does."""
    lengths = np.array([10, 10, 6, 6, 3, 3, 2, 2])
    # 4 accumulation steps of m = 2: 1-row chunks, the 3 filled ones run
    assert packing.update_tokens(lengths, 16, packing.UpdateGroups(1, 4, 1)) == 48
    # rows over 2 shards: 2-row chunks, 2 of them
    assert packing.update_tokens(lengths, 16, packing.UpdateGroups(1, 4, 2)) == 64
    rng = np.random.default_rng(0)
    for _ in range(20):  # the 7B GH200 config's batch: B 112, P 512, 28 steps of 4
        lengths = 512 + np.minimum(rng.lognormal(np.log(103), 0.94, 112).astype(int) + 1, 1024)
        chunked = packing.update_tokens(lengths, 1536, packing.UpdateGroups(4, 28, 1))
        whole = packing.update_tokens(lengths, 1536)
        assert lengths.sum() <= chunked <= whole + 3 * 1536  # under one 3-row chunk more
    with pytest.raises(ValueError, match="do not split into 28 microbatches"):
        packing.UpdateGroups(1, 28).draw(100)
