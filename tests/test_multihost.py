"""Multi-host runs: JAX's multi-controller runtime across processes on this one machine.

Two processes with two fake CPU devices each (gloo CPU collectives, jax's default) join one
runtime through the same environment variables a cluster sets (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID), and their results are compared with one process that
holds all the devices:

- ``test_two_processes_update_equals_one_process``: two sharded PPO updates of a tiny actor and
  critic on a (data=1, fsdp=2, tensor=2) mesh whose fsdp axis spans the two processes (so
  parameters, gradients and optimizer moments are split across processes and every step
  all-gathers and reduce-scatters through gloo). Each process gives only the batch rows its
  devices hold (``jax.make_array_from_process_local_data``). Final parameters of both models
  and the update metrics, gathered with ``process_allgather``, must equal the one-process run
  on the same 4-device mesh bit for bit, on both processes.
- ``test_two_processes_train_equals_one_process``: the real command, ``oppo-jax train``, on
  two processes with one device each (mesh fsdp=2) for two OPPO steps of the small demo with
  carried sequences: rollout, streamed scoring, carrying, update and a shared orbax
  checkpoint. Every metric except wall-clock times must equal a one-process run on two
  devices, and process 1 (which writes under ``processes/1/``) must have computed the same.

Not covered: real networks (everything is localhost), GPUs and TPUs, cluster auto-detection
itself (SLURM / TPU metadata; only its hand-over to ``jax.distributed.initialize`` is tested),
the disaggregated placement across processes, resuming a multi-process run, and speed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import oppo_jax.parallel.sharding as sh
from tests.run_fixtures import OPPO_WITH_CARRYING, metric_values, small_demo_args, small_demo_config
from tests.xla_flags import COMPILE_FLAGS

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300  # per group of processes; a hung collective ends here, not in CI's limit
# Variables that would make a process think it belongs to some other job.
_CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                 "TPU_WORKER_HOSTNAMES", "OMPI_MCA_orte_hnp_uri")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int, process: tuple[int, int, int] | None = None, **extra: str) -> dict:
    """Environment of one child: ``devices`` fake CPU devices; ``process`` = (id, count, port)."""
    env = {k: v for k, v in os.environ.items()
           if k not in _CLUSTER_VARS and not k.startswith("SLURM_")}  # fmt: skip
    env.update(
        # The suite's compile flags (tests/xla_flags.py); every process uses the same.
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}",
        JAX_PLATFORMS="cpu",
        TOKENIZERS_PARALLELISM="false",
        **extra,
    )
    if process is not None:
        pid, count, port = process
        env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(count),
                   JAX_PROCESS_ID=str(pid))  # fmt: skip
    return env


def _run_all(jobs: dict[str, tuple[list[str], dict]], logs: Path) -> None:
    """Run every (argv, env) job at once; fail with every job's output if any fails or hangs."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, (argv, env) in jobs.items():
        out = (logs / f"{name}.log").open("wb")
        procs[name] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=out)
    deadline = time.monotonic() + TIMEOUT_S
    failed = None
    while failed is None and any(p.poll() is None for p in procs.values()):
        failed = next((n for n, p in procs.items() if p.poll() not in (None, 0)), None)
        if time.monotonic() > deadline:
            failed = f"timeout after {TIMEOUT_S}s"
        time.sleep(0.2)
    failed = failed or next((n for n, p in procs.items() if p.returncode != 0), None)
    for p in procs.values():  # a partner of a failed process waits on it forever
        if p.poll() is None:
            p.kill()
            p.wait()
    if failed is not None:
        report = "\n".join(
            f"----- {n} (exit {p.returncode}) -----\n{(logs / f'{n}.log').read_text()[-6000:]}"
            for n, p in procs.items()
        )
        pytest.fail(f"multi-process run failed ({failed}):\n{report}", pytrace=False)


def _max_abs_diff(a: np.lib.npyio.NpzFile, b: np.lib.npyio.NpzFile, prefix: str) -> float:
    keys = sorted(k for k in a.files if k.startswith(prefix))
    assert keys and keys == sorted(k for k in b.files if k.startswith(prefix))
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in keys)


@pytest.mark.slow  # two JAX processes joined through a coordinator
def test_two_processes_update_equals_one_process(tmp_path):
    worker = [sys.executable, "-m", "tests.multihost_worker"]
    mesh = ["1", "2", "2"]  # data, fsdp, tensor
    port = _free_port()
    jobs = {"one_process": ([*worker, str(tmp_path / "one.npz"), *mesh], _env(4))}
    for i in range(2):
        argv = [*worker, str(tmp_path / f"two_{i}.npz"), *mesh]
        jobs[f"process_{i}"] = (argv, _env(2, (i, 2, port)))
    _run_all(jobs, tmp_path / "logs")
    one = np.load(tmp_path / "one.npz")
    facts = json.loads(str(one["facts"]))
    assert (facts["process_count"], facts["global_devices"]) == (1, 4)
    moved = max(
        float(np.max(np.abs(one[k] - one[k.replace("final", "init", 1)])))
        for k in one.files
        if k.startswith("final['actor']") or k.startswith("final['critic']")
    )
    assert moved > 1e-3  # the two updates changed the parameters
    for i in range(2):
        two = np.load(tmp_path / f"two_{i}.npz")
        facts = json.loads(str(two["facts"]))
        assert facts["process_index"] == i and facts["process_count"] == 2
        assert (facts["local_devices"], facts["global_devices"]) == (2, 4)
        assert facts["fsdp_processes"] == [0, 1]  # parameters really are split over processes
        assert facts["batch_rows_here"] == [4 * i, 4 * i + 4, 1]  # each holds half the rows
        assert _max_abs_diff(two, one, "init") == 0.0
        # Same programs and the same reduction order: bitwise equal (the bound is ≤ 1e-6).
        assert _max_abs_diff(two, one, "final") <= 1e-6


@pytest.fixture(scope="module")
def small_demo_assets(demo_cache):
    """The small demo's actor and reward model, built before the processes share them."""
    from oppo_jax.data.demo_task import DemoTaskSpec
    from oppo_jax.demo.assets import ensure_demo_assets

    cfg = small_demo_config()
    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    # The same call as a run's own (oppo_jax.run.setup), so the runs find the assets cached.
    ensure_demo_assets(demo_cache / "demo", spec, cfg.train.sft_steps, cfg.train.rm_steps,
                       progress=False)  # fmt: skip
    return demo_cache


@pytest.mark.slow  # two JAX processes joined through a coordinator
def test_two_processes_train_equals_one_process(small_demo_assets, tmp_path):
    # No slot compaction: a multi-process run never compacts (slot_map.compacts), and the
    # ledger of a compacting one-process run would count fewer decode tokens.
    overrides = small_demo_args(*OPPO_WITH_CARRYING, "pipeline.adaptive_overcommit=false",
                                "train.steps=2", "mesh.fsdp=2",
                                "pipeline.compact_slots=false")  # fmt: skip
    cli = [sys.executable, "-m", "oppo_jax.cli", "train", "--quiet"]
    cli += [f"--set={item}" for item in overrides]
    cache = {"OPPO_JAX_CACHE": str(small_demo_assets)}
    port = _free_port()
    jobs = {"one_process": ([*cli, "--out", str(tmp_path / "one")], _env(2, **cache))}
    for i in range(2):  # one shared run directory, as on a cluster's shared file system
        argv = [*cli, "--out", str(tmp_path / "two")]
        jobs[f"process_{i}"] = (argv, _env(1, (i, 2, port), **cache))
    _run_all(jobs, tmp_path / "logs")
    one = metric_values(tmp_path / "one" / "metrics.jsonl")
    two = metric_values(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in one] == [0, 1]
    assert one[0]["carried"] > 0  # sequences cross the step boundary on both runs
    assert two == one
    assert metric_values(tmp_path / "two" / "processes" / "1" / "metrics.jsonl") == one
    assert (tmp_path / "two" / "checkpoints" / "2" / "commit_success.txt").is_file()


def test_multihost_initialize_reads_the_environment(monkeypatch):
    calls = []
    monkeypatch.setattr(sh.jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(sh.jax.distributed, "is_initialized", lambda: False)
    for var in (*_CLUSTER_VARS, "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert sh.multihost_initialize() is False and calls == []
    # mesh.multihost=true: let jax auto-detect the cluster (TPU metadata, SLURM, ...).
    assert sh.multihost_initialize(force=True) is True
    assert calls.pop() == dict(coordinator_address=None, num_processes=None, process_id=None)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert sh.multihost_initialize(force=True) is False and calls == []
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert sh.multihost_initialize() is True
    assert calls.pop() == dict(coordinator_address=None, num_processes=4, process_id=3)


def test_train_command_joins_the_runtime_first(monkeypatch, tmp_path):
    import oppo_jax.cli as cli

    seen = []
    monkeypatch.setattr(sh, "multihost_initialize", lambda **kw: seen.append(kw))

    def fake_train(cfg, out, resume, progress, warmup=True):
        seen.append("train")
        return {}

    monkeypatch.setattr("oppo_jax.train.train", fake_train)
    args = ["train", "--out", str(tmp_path), "--set", "mesh.multihost=true", "--quiet"]
    assert cli.main(args) == 0
    assert seen == [{"force": True}, "train"]
