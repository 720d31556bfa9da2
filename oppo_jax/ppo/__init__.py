"""PPO math: rewards, advantages, losses and KL control as pure jnp functions (imported lazily:
the step loads only the modules it uses)."""

import importlib

_NAMES = {
    **dict.fromkeys(
        ("apply_missing_eos_penalty", "gae", "kl_estimate", "penalized_rewards"), "estimators"
    ),  # fmt: skip
    **dict.fromkeys(
        ("AdaptiveKLController", "FixedKLController", "make_kl_controller"), "kl_control"
    ),  # fmt: skip
    **dict.fromkeys(("entropy_from_logits", "policy_loss", "value_loss"), "losses"),
    **dict.fromkeys(("masked_mean", "masked_whiten"), "masked"),
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"oppo_jax.ppo.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'oppo_jax.ppo' has no attribute {name!r}")
