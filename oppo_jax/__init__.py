"""oppo_jax: overlapped PPO-RLHF in JAX."""
