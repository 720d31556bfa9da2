"""Test set-up: eight fake CPU devices (so meshes can be built) and float32 matmuls."""

import gc
import os

# Must happen before jax is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

# Parity tests compare against float32 references; keep XLA from using lower-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")

# No persistent compilation cache: with it, reading the PPO update's executable back from the
# cache (a fresh jit object compiling a program an earlier test compiled) crashed the process
# inside XLA:CPU's executable deserialization (abort / segfault in
# compilation_cache.get_executable_and_time) in two full-suite runs. Every test compiles what
# it runs, in memory only, and nothing is written to the system temp directory.


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """Point OPPO_JAX_CACHE at a session directory where the small demo assets of
    ``tests.run_fixtures.small_demo_config`` are built once and shared by every test module."""
    cache = tmp_path_factory.mktemp("demo_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPPO_JAX_CACHE", str(cache))
        yield cache


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module. One process runs the whole suite;
    without this its compiled executables pile up, and late in the suite XLA:CPU crashed while
    compiling the PPO update (abort, then segfault, in three clean-clone runs)."""
    yield
    jax.clear_caches()
    gc.collect()
