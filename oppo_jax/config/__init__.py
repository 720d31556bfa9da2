"""Run configuration: the schema (``schema``), loading and ``--set`` overrides (``load``),
checks (``validate``) and the key reference (``docs``). No jax here: a config is loaded and
checked before anything compiles."""

from oppo_jax.base.errors import ConfigError
from oppo_jax.config.docs import config_keys_doc
from oppo_jax.config.load import CONFIG_DIR, DEFAULT_CONFIG, load_config, to_dict, to_yaml
from oppo_jax.config.schema import (
    STABLE_KEYS,
    Config,
    DataConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    PPOConfig,
    RolloutConfig,
    TrainConfig,
)
from oppo_jax.config.validate import devices_needed, validate, validate_mesh

__all__ = [
    "CONFIG_DIR", "DEFAULT_CONFIG", "STABLE_KEYS", "Config", "ConfigError", "DataConfig",
    "MeshConfig", "ModelConfig", "OptimConfig", "PipelineConfig", "PPOConfig", "RolloutConfig",
    "TrainConfig", "config_keys_doc", "devices_needed", "load_config", "to_dict", "to_yaml",
    "validate", "validate_mesh",
]  # fmt: skip
