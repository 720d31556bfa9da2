"""benchmarks/gpu_bench.sh: its --smoke run on the CPU goes through the GPU config's code path
(random Qwen2-layout models, random prompts, long-tail lengths, all four schedules), and
without a GPU the real run refuses with a clear message."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_flags import COMPILE_FLAGS

pytestmark = pytest.mark.slow  # a fresh process that compiles and runs all four schedules

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.sh"


def _run(*args, env_extra=None):
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    env["XLA_FLAGS"] = COMPILE_FLAGS  # the run adds the device count its config needs
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=1200
    )


def test_smoke_run_writes_bench_json_and_a_summary_line(tmp_path):
    out = tmp_path / "smoke"
    cache = {"OPPO_JAX_CACHE": str(tmp_path / "c")}
    done = _run("--smoke", "--out", str(out), "--compact", "on", env_extra=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert set(result["schedules"]) == {"sync", "intra", "inter", "oppo"}
    cfg = result["workload"]["config"]
    assert cfg["model"]["actor_path"] == "random" and cfg["model"]["preset"] == "tiny"
    assert cfg["rollout"]["length_sampler"] == "lognormal"
    assert cfg["pipeline"]["compact_slots"] is True  # --compact on reached the config
    lengths = [r["response_len_max"] for r in result["schedules"]["sync"]["records"]]
    assert max(lengths) <= 64
    line = (out / "summary.txt").read_text().strip()
    assert line.startswith("gpu_bench: ") and "oppo measured/ideal" in line
    assert line in done.stdout
    assert not (tmp_path / "c").exists()  # nothing built, nothing downloaded
    # The ragged decode kernel was checked first (the interpreter's tiny shapes here).
    check = json.loads((out / "ragged_check.json").read_text())
    assert check["smoke"] and all(w["max_abs_error"] < 1e-5 for w in check["widths"].values())
    assert max(check["segment"].values()) < 1e-5  # the segment attention's errors, checked too
    assert "ragged check FAILED" not in line


def test_a_failed_ragged_check_measures_with_the_older_kernels_and_says_so(tmp_path):
    """auto falls back to the kernels before the ragged one (cuDNN on a GPU; XLA under --smoke,
    the CPU having no cuDNN); an explicit ragged stops (exit 4)."""
    failing = tmp_path / "fail.py"
    failing.write_text("import sys; print('kernel broke', file=sys.stderr); sys.exit(1)\n")
    env = {"RAGGED_CHECK": str(failing)}
    out = tmp_path / "smoke"
    fewer = ("--schedules", "sync,oppo")  # the fallback is the test, not the four schedules
    done = _run(
        "--smoke", "--out", str(out), "--steps", "1", "--warmup", "0", *fewer, env_extra=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "measuring with model.attention=xla instead" in done.stderr
    assert (
        json.loads((out / "bench.json").read_text())["workload"]["config"]["model"]["attention"]
        == "xla"
    )
    assert (out / "summary.txt").read_text().strip().endswith("ragged check FAILED: attention xla")
    stopped = _run(
        "--smoke", "--out", str(tmp_path / "x"), "--attention", "ragged", *fewer, env_extra=env
    )
    assert stopped.returncode == 4 and "failed its check" in stopped.stderr


def test_without_a_gpu_the_real_run_says_so():
    done = _run("--out", "unused", env_extra={"JAX_PLATFORMS": "cpu"})
    assert done.returncode == 3
    assert "jax sees no GPU" in done.stderr


def test_a_bad_compact_value_is_named():
    done = _run("--smoke", "--compact", "maybe")
    assert done.returncode == 2
    assert "--compact takes on, off or auto, not maybe" in done.stderr
