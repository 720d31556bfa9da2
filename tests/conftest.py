"""Test set-up: eight fake CPU devices (so meshes can be built) and float32 matmuls."""

import os

# Must happen before jax is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

# Parity tests compare against float32 references; keep XLA from using lower-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")
