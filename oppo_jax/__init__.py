"""oppo_jax: overlapped PPO-RLHF (OPPO) in JAX/Flax."""

from oppo_jax.models.api import HFModel, load_hf_model
from oppo_jax.models.hf_export import export_hf

__all__ = ["HFModel", "export_hf", "load_hf_model"]
__version__ = "0.1.0"
