"""Execute every research notebook under notebooks/ and fail if any cell raises.

The kernel runs this interpreter (the project's virtualenv): a kernel spec pointing at
``sys.executable`` is written to a temporary Jupyter path, so a ``python3`` kernel installed
elsewhere on the machine cannot be picked up instead. The three notebooks share one asset
cache (``OPPO_JAX_NOTEBOOK_CACHE``), so the small demo actor and reward model are built once.
Needs nbclient, nbformat and ipykernel (the test extra).
"""

import json
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

from tests.xla_flags import COMPILE_FLAGS

pytestmark = pytest.mark.slow  # executes three notebooks in Jupyter kernels

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = (
    "01_quickstart.ipynb",
    "02_anatomy_of_a_step.ipynb",
    "03_differentiable_research.ipynb",
)
TIMEOUT_S = 300  # per notebook
KERNEL = "oppo-jax-test-venv"


@pytest.fixture(scope="module")
def notebook_env(tmp_path_factory):
    """A kernel spec for this interpreter and one asset cache shared by all notebooks."""
    root = tmp_path_factory.mktemp("notebooks")
    spec_dir = root / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = {"argv": argv, "display_name": "oppo_jax venv", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root / "jupyter"))
        # The notebooks point OPPO_JAX_CACHE at OPPO_JAX_NOTEBOOK_CACHE (never at a user's own
        # cache, whose full-size assets their small step counts would replace); both agree here.
        mp.setenv("OPPO_JAX_NOTEBOOK_CACHE", str(root / "cache"))
        mp.setenv("OPPO_JAX_CACHE", str(root / "cache"))
        # The suite's cheap-compile flags; each notebook appends its own device count.
        mp.setenv("XLA_FLAGS", COMPILE_FLAGS)
        (root / "tmp").mkdir()
        mp.setenv("TMPDIR", str(root / "tmp"))  # the notebooks' run directories land here
        yield root


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, notebook_env):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    # Committed notebooks carry no outputs (kept small and diff-friendly).
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), name
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=TIMEOUT_S,
        resources={"metadata": {"path": str(notebook_env)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError if any cell raises
    elapsed = time.perf_counter() - start
    print(f"{name}: {elapsed:.1f} s")
    assert elapsed < TIMEOUT_S, f"{name} took {elapsed:.0f} s"
