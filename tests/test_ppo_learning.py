"""PPO learns: a tiny random policy raises a fixed rule reward (a reward function, scored on
the host as a run scores ``reward.functions``) within a few dozen steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import PPOConfig
from oppo_jax.parallel.sharding import make_device_groups
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.kernels import build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.step import StepEngine, run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo.update import init_train_state
from oppo_jax.rewards.functions import RewardFunction
from oppo_jax.rewards.runner import RewardFunctions
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from tests.ppo_fixtures import ListPrompts, make_spec, step_plan, tiny_params

GOOD = (2, 12)  # token ids in [2, 12) are "good": ~16% of a uniform policy's tokens
R = 8


class _IdText:
    """A tokenizer for the random model: ids as words (the reward functions read text)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 1))


def fraction_good(prompt: str, response: str, record: dict) -> float:
    """Reward: the fraction of response tokens in the good range (0..1)."""
    ids = [int(w) for w in response.split()]
    return sum(GOOD[0] <= i < GOOD[1] for i in ids) / max(len(ids), 1)


def _rewards() -> RewardFunctions:
    """``fraction_good`` as the run's only reward (``reward.functions``, host-side)."""
    functions = [RewardFunction("tests.test_ppo_learning:fraction_good", fraction_good, 1.0)]
    return RewardFunctions(functions, 0.0, _IdText(), lambda _: {}, (1,), R)


@pytest.mark.slow
def test_ppo_raises_a_fixed_reward():
    spec = make_spec(PPOConfig(ppo_epochs=2, num_minibatches=2, kl_coef=0.01), lr=3e-3,
                     temperature=1.0)  # fmt: skip
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompt_width=4, max_response_len=R,
                          eos_ids=(1,))  # fmt: skip
    kernels = build_kernels(spec, rollout)  # no reward model: the reward function scores
    placement = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    timeline = Timeline()
    actor, critic = tiny_params(seed=4)
    ref = jax.tree.map(jnp.copy, actor)
    state = init_train_state(spec, actor, critic)
    rng = np.random.default_rng(0)
    rewards, history = _rewards(), []
    for step in range(30):
        pairs = [(step * 16 + i, rng.integers(12, 64, 4)) for i in range(16)]
        keys = jax.random.split(jax.random.key(step), 2)
        engine = StepEngine(kernels, placement, ref, None, keys[0], 2, rewards=rewards)
        plan = step_plan(step, 16, chunk_size=4, kl_coef=0.01, key=keys[1])
        state, _, result = run_step(
            engine, SCHEDULES["intra"], plan, state, CarryBuffer(), ListPrompts(pairs), timeline
        )
        history.append(float(result.metrics["reward"]))
    first, last = np.mean(history[:5]), np.mean(history[-5:])
    assert first < 0.3, history
    print(f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.25, history
