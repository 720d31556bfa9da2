"""Test set-up: eight fake CPU devices (so meshes can be built) and float32 matmuls."""

import contextlib
import gc
import getpass
import os
import tempfile
from pathlib import Path

from tests.xla_flags import TEST_XLA_FLAGS

# Must happen before jax is imported anywhere in the test process (tests/xla_flags.py: why).
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # also lets the deviceless GPU compiler register
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu (the TPU compiler): no cloud metadata
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OPPO_JAX_COMPILATION_CACHE", "off")  # see below; the CLI reads it
# No warm-up unless a test asks for it (tests/test_warmup.py): each module's runs meet a few
# shapes, and compiling every shape a run could meet would add minutes to the suite.
os.environ.setdefault("OPPO_JAX_WARMUP", "off")
# One xdist worker holds the compiled programs of every module it ran (a run holds only its
# own), so the memory-maps stop (oppo_jax.base.host_maps) is off except where it is tested.
os.environ.setdefault("OPPO_JAX_MAPS_CHECK", "off")

import jax  # noqa: E402
import pytest  # noqa: E402

# Parity tests compare against float32 references; keep XLA from using lower-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")

# No persistent compilation cache: with it, reading the PPO update's executable back from the
# cache (a fresh jit object compiling a program an earlier test compiled) crashed the process
# inside XLA:CPU's executable deserialization (abort / segfault in
# compilation_cache.get_executable_and_time) in two full-suite runs. Every test compiles what
# it runs, in memory only, and nothing is written to the system temp directory.


@pytest.fixture(autouse=True, scope="session")
def _temp_files_under_basetemp(tmp_path_factory):
    """Point ``tempfile`` (and, through TMPDIR, every subprocess) at a directory under pytest's
    basetemp, so that a test or library writing a temporary file leaves nothing in the system
    temp directory: the basetemp goes when the session passes (``tmp_path_retention_policy``)."""
    tmp = tmp_path_factory.mktemp("tmp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp))
        mp.setattr(tempfile, "tempdir", str(tmp))
        yield tmp


def pytest_unconfigure(config):
    """After pytest removed a passing session's basetemp: remove ``pytest-of-<user>`` too when
    no other session's directory is left in it (other sessions may run at the same time)."""
    factory = getattr(config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)
    if basetemp is None or basetemp.exists() or factory._given_basetemp is not None:
        return  # a failed session keeps its directory; --basetemp is the user's own
    parent = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    if basetemp.parent != parent:
        return
    current = parent / "pytest-current"
    if current.is_symlink() and not current.exists():  # it pointed at our removed basetemp
        with contextlib.suppress(OSError):
            current.unlink()
    with contextlib.suppress(OSError):
        parent.rmdir()  # only when empty: rmdir never removes another session's files


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """Point OPPO_JAX_CACHE at a session directory where the small demo assets of
    ``tests.run_fixtures.small_demo_config`` are built once and shared by every test module."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist: one cache for all the workers
        root = root.parent  # (the build holds a lock: one worker builds, the others wait)
    cache = root / "demo_cache"
    cache.mkdir(exist_ok=True)
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
