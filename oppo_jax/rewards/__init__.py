"""Reward functions: Python callables scoring decoded responses on the host, weighted beside
(or instead of) the reward model (``reward.*`` config keys)."""

from oppo_jax.rewards.functions import RewardFunction, RewardFunctionError, call, resolve
from oppo_jax.rewards.runner import RewardFunctions, StepRewards

__all__ = [
    "RewardFunction",
    "RewardFunctionError",
    "RewardFunctions",
    "StepRewards",
    "call",
    "resolve",
]
