"""The host state's keys: equal to the formula the checkpoints and the update's shuffles were
made with, one compiled call per block of ``KEY_BLOCK`` steps."""

import jax
import numpy as np
import pytest

from oppo_jax.config import Config
from oppo_jax.data.prompts import PromptIterator
from oppo_jax.pipeline.host_state import KEY_BLOCK, HostState, update_key, update_keys
from oppo_jax.pipeline.schedule import Schedule


def _formula(seed: int, step: int) -> jax.Array:
    return jax.random.key_data(jax.random.fold_in(jax.random.key(seed + 1), step))


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 2])
def test_the_update_key_is_fold_in_of_the_seeds_successor_and_the_step(seed):
    for step in (0, 1, 999):
        assert (jax.random.key_data(update_key(seed, step)) == _formula(seed, step)).all()
    keys = update_keys(seed, 3)
    assert len(keys) == KEY_BLOCK
    for i in (0, 1, KEY_BLOCK - 1):
        assert (jax.random.key_data(keys[i]) == _formula(seed, 3 + i)).all()


def test_plan_takes_each_steps_key_from_its_block():
    cfg = Config()
    prompts = PromptIterator([np.arange(3)], seed=0)
    host = HostState.fresh(cfg, Schedule.named("sync"), prompts)
    # within a block, past its end, and back (a resume at an earlier step)
    for step in (0, 1, KEY_BLOCK - 1, KEY_BLOCK, 2 * KEY_BLOCK + 5, 7):
        host.step = step
        got = jax.random.key_data(host.plan(cfg).update_key)
        assert (got == _formula(cfg.seed, step)).all(), step
