"""oppo_jax: overlapped PPO-RLHF (OPPO) in JAX/Flax.

The public API is imported lazily so that ``oppo_jax.config`` can validate a configuration
without importing JAX (bad input fails before any compilation or device start-up).
"""

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "HFModel": "oppo_jax.models.api",
    "load_hf_model": "oppo_jax.models.api",
    "export_hf": "oppo_jax.models.hf_export",
    "load_config": "oppo_jax.config",
    "Config": "oppo_jax.config",
    "prepare_run": "oppo_jax.run.setup",  # a run's context and initial train state, no compiles
    "plot_gantt": "oppo_jax.run.plots",  # a step's timeline, one row per device group
}
_SUBMODULES = ("config", "data", "models", "parallel", "ppo", "rollout")

__all__ = sorted(_PUBLIC) + list(_SUBMODULES)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"oppo_jax.{name}")
    raise AttributeError(f"module 'oppo_jax' has no attribute {name!r}")
