"""The adaptive Δ controller follows the paper's rule, against hand-computed sequences."""

from oppo_jax.pipeline.overcommit import OvercommitController


def test_fixed_delta_never_moves():
    ctl = OvercommitController(delta=4, adaptive=False)
    for r in (0.0, 1.0, 2.0, 3.0, 4.0):
        ctl.observe(r)
    assert ctl.delta == 4 and ctl.slots_needed == 4


def test_rising_reward_raises_delta_then_falling_lowers_it():
    ctl = OvercommitController(delta=4, minimum=0, maximum=8, window=2, adaptive=True)
    assert ctl.slots_needed == 8
    ctl.observe(0.0)
    ctl.observe(0.1)
    assert ctl.delta == 4  # fewer than w + 1 rewards: no trend yet
    ctl.observe(0.3)  # s = (0.3 - 0.0) / 2 > 0 -> Δ += max(1, 4 // 4) = 1
    assert ctl.delta == 5
    ctl.observe(0.5)  # s = (0.5 - 0.1) / 2 > 0 -> Δ += 1
    ctl.observe(0.6)
    ctl.observe(0.7)
    ctl.observe(0.8)  # Δ: 6, 7, 8, then capped at Δ_max = 8 (step would be 2)
    assert ctl.delta == 8
    ctl.observe(0.8)  # s = (0.8 - 0.7) / 2 > 0: stays at the cap
    ctl.observe(0.8)  # s = 0: not rising -> Δ -= 8 // 4 = 2
    assert ctl.delta == 6
    for _ in range(10):
        ctl.observe(0.0)
    assert ctl.delta == 0  # converged: overcommitment switches itself off


def test_state_round_trip():
    ctl = OvercommitController(delta=3, window=3, adaptive=True)
    for r in (0.1, 0.2):
        ctl.observe(r)
    other = OvercommitController(delta=0, window=3, adaptive=True)
    other.restore(ctl.state())
    for r in (0.3, 0.4):
        ctl.observe(r)
        other.observe(r)
    assert other.state() == ctl.state() and ctl.delta == 4
