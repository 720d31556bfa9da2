"""Test set-up: eight fake CPU devices (so meshes can be built) and float32 matmuls."""

import os
import shutil
import tempfile

# Must happen before jax is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

# Parity tests compare against float32 references; keep XLA from using lower-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")

# Many tests compile the same kernels (each run builds its own jit objects): share the
# compiled executables through JAX's persistent cache. JAX reads the directory once, at the
# first compile (which can come before any fixture), so it is made here and removed when the
# session ends: nothing is left in the system temp directory.
_CACHE = tempfile.mkdtemp(prefix="oppo_jax_test_xla_cache_")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """Point OPPO_JAX_CACHE at a session directory where the small demo assets of
    ``tests.run_fixtures.small_demo_config`` are built once and shared by every test module."""
    cache = tmp_path_factory.mktemp("demo_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPPO_JAX_CACHE", str(cache))
        yield cache
