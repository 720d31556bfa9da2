"""PPO math: rewards, advantages, losses and KL control as pure jnp functions."""

from oppo_jax.ppo.advantages import apply_missing_eos_penalty as apply_missing_eos_penalty
from oppo_jax.ppo.advantages import gae as gae
from oppo_jax.ppo.advantages import kl_estimate as kl_estimate
from oppo_jax.ppo.advantages import penalized_rewards as penalized_rewards
from oppo_jax.ppo.kl_control import AdaptiveKLController as AdaptiveKLController
from oppo_jax.ppo.kl_control import FixedKLController as FixedKLController
from oppo_jax.ppo.kl_control import make_kl_controller as make_kl_controller
from oppo_jax.ppo.losses import entropy_from_logits as entropy_from_logits
from oppo_jax.ppo.losses import policy_loss as policy_loss
from oppo_jax.ppo.losses import value_loss as value_loss
from oppo_jax.ppo.masked import masked_mean as masked_mean
from oppo_jax.ppo.masked import masked_whiten as masked_whiten
