"""The online chunk-size tuner keeps the fastest candidate of each round."""

from oppo_jax.pipeline.chunk_control import ChunkSizeController


def test_fixed_chunk_size_never_changes():
    ctl = ChunkSizeController(current=16, candidates=(8, 32), every=4, tuning=False)
    for step in range(10):
        assert ctl.size_for(step) == 16
        ctl.observe(step, 16, 1.0)
    assert ctl.current == 16


def test_tuning_round_tries_each_candidate_then_keeps_the_fastest():
    ctl = ChunkSizeController(current=16, candidates=(8, 16, 32), every=5, tuning=True)
    times = {8: 3.0, 16: 2.0, 32: 1.0}
    used = []
    for step in range(10):
        size = ctl.size_for(step)
        used.append(size)
        ctl.observe(step, size, times[size] if step < 5 else {8: 1.0, 16: 5.0, 32: 4.0}[size])
    assert used[:5] == [8, 16, 32, 32, 32]  # round, then the fastest (32)
    assert used[5:8] == [8, 16, 32]  # next round; now 8 is fastest
    assert ctl.current == 8 and used[8:] == [8, 8]


def test_state_round_trip_mid_round():
    ctl = ChunkSizeController(current=16, candidates=(8, 32), every=10, tuning=True)
    ctl.observe(0, 8, 2.0)
    other = ChunkSizeController(current=4, candidates=(8, 32), every=10, tuning=True)
    other.restore(ctl.state())
    other.observe(1, 32, 1.0)
    assert other.current == 32
