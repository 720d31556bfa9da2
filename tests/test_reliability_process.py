"""Reliability across real processes: the same seed and config give bit-identical metrics in
two fresh processes (sync and oppo), and SIGTERM sent to a running `oppo-jax train` saves a
checkpoint, exits with EXIT_PREEMPTED, and a resumed run equals one never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from oppo_jax.base.errors import EXIT_PREEMPTED
from oppo_jax.run.preemption import resume_command
from tests.run_fixtures import OPPO_WITH_CARRYING, metric_values, small_demo_args

pytestmark = pytest.mark.slow  # fresh `oppo-jax train` processes, 10 steps each

STEPS = 10
TIMEOUT_S = 600


def _command(out, *extra, resume=False):
    args = small_demo_args(f"train.steps={STEPS}", "train.checkpoint_every=0", *extra)
    cmd = [sys.executable, "-m", "oppo_jax.cli", "train", "--out", str(out), "--quiet"]
    return cmd + [f"--set={a}" for a in args] + (["--resume"] if resume else [])


def _env(demo_cache):
    # The children share the session's demo assets and a compilation cache of their own.
    env = dict(os.environ, OPPO_JAX_CACHE=str(demo_cache))
    env["JAX_COMPILATION_CACHE_DIR"] = str(demo_cache / "xla_cache_children")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _run(demo_cache, out, *extra, resume=False):
    done = subprocess.run(
        _command(out, *extra, resume=resume), env=_env(demo_cache), capture_output=True,
        text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return metric_values(out / "metrics.jsonl")


@pytest.mark.parametrize("schedule", [(), OPPO_WITH_CARRYING], ids=["sync", "oppo-carrying"])
def test_two_fresh_processes_give_identical_metrics(demo_cache, tmp_path, schedule):
    first = _run(demo_cache, tmp_path / "a", *schedule)
    second = _run(demo_cache, tmp_path / "b", *schedule)
    assert len(first) == STEPS
    assert first == second


def test_sigterm_checkpoints_exits_75_and_resume_equals_uninterrupted(demo_cache, tmp_path):
    reference = _run(demo_cache, tmp_path / "reference", *OPPO_WITH_CARRYING)
    out = tmp_path / "preempted"
    child = subprocess.Popen(
        _command(out, *OPPO_WITH_CARRYING), env=_env(demo_cache), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    try:
        # Mid-run: after two steps are recorded (each later step takes ~0.5 s here).
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert child.poll() is None, child.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the child never reached step 2"
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == EXIT_PREEMPTED, stderr[-4000:]
    assert "SIGTERM received" in stderr
    args = small_demo_args(f"train.steps={STEPS}", "train.checkpoint_every=0", *OPPO_WITH_CARRYING)
    program = [sys.executable, "-m", "oppo_jax.cli"]  # as _command started it
    assert resume_command(None, args, str(out), ["--quiet"], program) in stderr  # the exact command
    assert "Traceback" not in stderr
    stopped_at = len(metric_values(metrics))
    assert 2 <= stopped_at < STEPS
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [stopped_at]  # checkpoint_every=0: the signal made the only checkpoint
    assert _run(demo_cache, out, *OPPO_WITH_CARRYING, resume=True) == reference


def test_a_resumed_run_reads_its_programs_back_instead_of_compiling(demo_cache, tmp_path):
    """With the persistent compilation cache (on by default, every program kept), a resumed
    run and a second run of the config compile at most a quarter of the first run's programs
    (here none: they read all of them back) and reproduce its metrics."""
    env = dict(os.environ, OPPO_JAX_CACHE=str(demo_cache), OPPO_JAX_WARMUP="on")
    env |= {"OPPO_JAX_COMPILATION_CACHE": "on", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "x")}
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)  # the CLI's own default

    def run(out, steps, *flags):
        args = small_demo_args(f"train.steps={steps}", "train.checkpoint_every=2")
        cmd = [sys.executable, "-m", "oppo_jax.cli", "train", "--out", str(out), "--quiet"]
        cmd += [f"--set={a}" for a in (*args, *OPPO_WITH_CARRYING)] + list(flags)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads((out / "warmup.json").read_text())

    first = run(tmp_path / "a", 2)
    resumed = run(tmp_path / "a", 4, "--resume")
    second = run(tmp_path / "b", 4)
    assert first["warmup_compiles"] > 0
    for later in (resumed, second):
        assert later["warmup_compiles"] <= first["warmup_compiles"] // 4
        assert later["warmup_cache_reads"] >= first["warmup_compiles"]
    assert metric_values(tmp_path / "a" / "metrics.jsonl") == metric_values(
        tmp_path / "b" / "metrics.jsonl"
    )
