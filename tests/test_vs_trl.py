"""Smoke test of benchmarks/vs_trl.py: TRL and both oppo-jax schedules, end to end, tiny."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_fixtures import DEMO_TEST_STEPS
from tests.xla_flags import COMPILE_FLAGS

pytestmark = pytest.mark.slow  # a TRL PPO run next to ours, in a subprocess

# Looked up, not imported: importing trl (torch, transformers, datasets, accelerate) at collection
# would cost every test worker seconds even when the slow tier is deselected.
if importlib.util.find_spec("trl") is None:
    pytest.skip("trl is not installed: pip install -e '.[peers]'", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_trl.py"


@pytest.mark.timeout(600)
def test_vs_trl_smoke(demo_cache, tmp_path):
    """Two steps per run, on the test suite's small demo assets (shared by `demo_cache`)."""
    out = tmp_path / "vs_trl.json"
    env = {
        **os.environ,
        # The workers run on one host device, as the demo does, and share compiled kernels.
        "XLA_FLAGS": COMPILE_FLAGS,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    overrides = [*DEMO_TEST_STEPS, "rollout.max_response_len=32"]
    cmd = [sys.executable, str(SCRIPT), "--steps", "2", "--warmup", "0", "--threads", "1"]
    cmd += [x for o in overrides for x in ("--set", o)] + ["--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())

    runs = report["runs"]
    expected = {"trl_t1_gc", "trl_t1_nogc", "oppo_jax_sync", "oppo_jax_oppo"}
    assert set(runs) == expected
    for name, run in runs.items():
        assert len(run["step_time_s"]) == 2, name
        assert all(t > 0 for t in run["step_time_s"]), name
        assert len(run["gold"]) == 2 and all(-1.0 <= g <= 1.0 for g in run["gold"]), name
    # The gc variant really collected, the other really skipped it.
    assert sum(runs["trl_t1_gc"]["gc_time_s"]) > 0
    assert sum(runs["trl_t1_nogc"]["gc_time_s"]) == 0
    # TRL's captured responses respect the configured length (32 here).
    assert all(1 <= n <= 32 for n in runs["trl_t1_gc"]["response_len_max"])
    hp = report["settings"]["trl_hparams"]  # mapped from configs/demo_cpu.yaml
    assert (hp["batch_size"], hp["kl_coef"], hp["actor_lr"], hp["critic_lr"]) == (
        16,
        0.1,
        1.5e-4,
        1e-3,
    )
    assert (hp["num_ppo_epochs"], hp["warmup_updates"], hp["response_length"]) == (4, 10, 32)

    summary = report["summary"]
    assert set(summary["lanes"]) == expected
    for name, lane in summary["lanes"].items():
        assert lane["step_time_median_s"] > 0 and -1.0 <= lane["gold_final"] <= 1.0, name
    assert set(summary["speedup_vs_trl"]) == {"trl_t1_gc", "trl_t1_nogc"}
    for ratios in summary["speedup_vs_trl"].values():
        step = ratios["step_time"]
        assert step["speedup"] > 0 and step["oppo_jax"] in ("oppo_jax_sync", "oppo_jax_oppo")
    assert "per-step median" in proc.stdout
