"""The host state's keys: one compiled call each, equal to the formula the checkpoints and
the update's shuffles were made with."""

import jax
import pytest

from oppo_jax.pipeline.host_state import update_key


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 2])
def test_the_update_key_is_fold_in_of_the_seeds_successor_and_the_step(seed):
    for step in (0, 1, 999):
        eager = jax.random.fold_in(jax.random.key(seed + 1), step)
        got = update_key(seed, step)
        assert (jax.random.key_data(got) == jax.random.key_data(eager)).all()
