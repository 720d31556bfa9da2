"""PPO learns: a tiny random policy raises a fixed programmatic reward within a few dozen steps."""

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
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from oppo_jax.rollout.layout import response_mask, response_tokens
from tests.ppo_fixtures import ListPrompts, make_spec, step_plan, tiny_params

GOOD = (2, 12)  # token ids in [2, 12) are "good": ~16% of a uniform policy's tokens
R = 8


def fraction_good(tokens, prompt_len, seq_len):
    """Reward: the fraction of response tokens in the good range (0..1)."""
    resp = response_tokens(tokens, prompt_len, R)
    mask = response_mask(seq_len - prompt_len, R)
    good = (resp >= GOOD[0]) & (resp < GOOD[1]) & mask
    return jnp.sum(good, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)


@pytest.mark.slow
def test_ppo_raises_a_fixed_reward():
    spec = make_spec(PPOConfig(ppo_epochs=2, num_minibatches=2, kl_coef=0.01), lr=3e-3,
                     temperature=1.0)  # fmt: skip
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompt_width=4, max_response_len=R,
                          eos_ids=(1,))  # fmt: skip
    kernels = build_kernels(spec, rollout, reward_fn=fraction_good)
    placement = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    timeline = Timeline()
    actor, critic = tiny_params(seed=4)
    ref = jax.tree.map(jnp.copy, actor)
    state = init_train_state(spec, actor, critic)
    rng = np.random.default_rng(0)
    rewards = []
    for step in range(30):
        pairs = [(step * 16 + i, rng.integers(12, 64, 4)) for i in range(16)]
        keys = jax.random.split(jax.random.key(step), 2)
        engine = StepEngine(kernels, placement, ref, None, keys[0], max_deferrals=2)
        plan = step_plan(step, 16, chunk_size=4, kl_coef=0.01, key=keys[1])
        state, _, result = run_step(
            engine, SCHEDULES["intra"], plan, state, CarryBuffer(), ListPrompts(pairs), timeline
        )
        rewards.append(float(result.metrics["reward"]))
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert first < 0.3, rewards
    print(f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.25, rewards
