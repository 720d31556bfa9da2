"""The demo task's trained models: SFT actor and Bradley–Terry reward model, cached on disk."""

from oppo_jax.demo.assets import (
    DEFAULT_RM_STEPS,
    DEFAULT_SFT_STEPS,
    ensure_demo_assets,
    response_length_stats,
    sample_responses,
)
from oppo_jax.demo.common import demo_model_config
from oppo_jax.demo.reward_model import train_reward_model
from oppo_jax.demo.sft import train_sft

__all__ = [
    "DEFAULT_RM_STEPS",
    "DEFAULT_SFT_STEPS",
    "demo_model_config",
    "ensure_demo_assets",
    "response_length_stats",
    "sample_responses",
    "train_reward_model",
    "train_sft",
]
