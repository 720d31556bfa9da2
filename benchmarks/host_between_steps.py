"""The host's work between two steps of the training loop: per step, the loop's period minus the
step's own window (``step_time_s``), with the run's records written on the loop's thread
(before) and by ``RunLog``'s writer thread (after), side by side in one process; and the loop
thread's own CPU time between two steps (outside ``run_step``), which a shared machine's other
processes do not inflate as they do the wall-clock period.

The loop's period is the time between two successive ``RunLog.write`` calls (one per step); what
it holds beyond ``step_time_s`` is the record's assembly, the trace, the controllers and, on the
loop's thread, metrics.jsonl, TensorBoard and the progress bar. Rounds alternate the two modes
so that a slow period of a shared machine spreads over both; steps that compiled, and the first
``--skip`` of each round, are left out.

    .venv/bin/python benchmarks/host_between_steps.py                  # grpo_demo_cpu, ~3 min
    .venv/bin/python benchmarks/host_between_steps.py --steps 80 --rounds 3 --out host.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _clocks() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread): the second does not count the time other
    processes of a shared machine hold the cores."""
    return time.perf_counter(), time.thread_time()


def _timed_log(background: bool, calls: list, inside: list[float]):
    """``RunLog`` in the given mode, noting when each ``write`` is called and how long the
    loop's thread spends in it."""
    from oppo_jax.run.log import RunLog

    class TimedLog(RunLog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, background=background)

        def write(self, record: dict) -> None:
            calls.append(_clocks())
            super().write(record)
            inside.append(time.perf_counter() - calls[-1][0])

    return TimedLog


def _timed_step(steps: list):
    """``run_step`` noting the clocks at its start and end."""
    import oppo_jax.train as train_module

    real = train_module.run_step

    def run_step(*args):
        start = _clocks()
        out = real(*args)
        steps.append((start, _clocks()))
        return out

    return run_step


def run_round(cfg, background: bool, skip: int) -> dict:
    """One run of ``cfg`` with the given writer; per-step host milliseconds."""
    import oppo_jax.train as train_module
    from oppo_jax.run.log import read_metrics

    calls, inside, steps = [], [], []
    real = train_module.RunLog, train_module.run_step
    train_module.RunLog = _timed_log(background, calls, inside)
    train_module.run_step = _timed_step(steps)
    try:
        with tempfile.TemporaryDirectory() as out:
            train_module.train(cfg, out, progress=True, warmup=True)
            records = read_metrics(f"{out}/metrics.jsonl")
    finally:
        train_module.RunLog, train_module.run_step = real
    host_ms, cpu_ms, write_ms = [], [], []
    for i in range(max(skip, 1), len(records)):
        if records[i]["compiles"] or records[i - 1]["compiles"]:
            continue
        period = calls[i][0] - calls[i - 1][0]
        host_ms.append(1e3 * (period - records[i]["step_time_s"]))
        # the loop thread's CPU between two writes, less its CPU inside step i's run_step
        (_, cpu_in), (_, cpu_out) = steps[i]
        cpu_ms.append(1e3 * ((calls[i][1] - calls[i - 1][1]) - (cpu_out - cpu_in)))
        write_ms.append(1e3 * inside[i - 1])
    step_ms = [1e3 * r["step_time_s"] for r in records[skip:]]
    return {"host_ms": host_ms, "cpu_ms": cpu_ms, "write_ms": write_ms, "step_ms": step_ms}


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"{statistics.median(xs):7.2f} {statistics.mean(xs):7.2f} {p90:7.2f}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="grpo_demo_cpu")
    p.add_argument("--set", dest="overrides", nargs="*", default=[])
    p.add_argument("--steps", type=int, default=60, help="steps per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    p.add_argument("--skip", type=int, default=5, help="first steps of a round left out")
    p.add_argument("--out", default=None, help="JSON of every measurement")
    args = p.parse_args(argv)
    from oppo_jax.cli import compilation_cache
    from oppo_jax.config import load_config

    compilation_cache()  # as `oppo-jax train`: a round's warm-up reads its programs back

    # no held-out evaluation: its decodes at step 0 and the end are not steps
    overrides = [f"train.steps={args.steps}", "train.checkpoint_every=0", "eval.split=null"]
    cfg = load_config(args.config, overrides + args.overrides)
    results = {"caller's thread": [], "writer thread": []}
    for _ in range(args.rounds):
        for background, name in ((False, "caller's thread"), (True, "writer thread")):
            results[name].append(run_round(cfg, background, args.skip))
    print(f"\n{args.config}, {args.steps} steps x {args.rounds} rounds per mode (ms per step)")
    heads = ("period - step_time_s", "loop thread's CPU", "in write()", "step_time_s")
    print(f"{'records written on':<18} " + " ".join(f"{h:>24}" for h in heads))
    print(f"{'':<18} " + " ".join(f"{'median mean p90':>24}" for _ in heads))
    for name, rounds in results.items():
        keys = ("host_ms", "cpu_ms", "write_ms", "step_ms")
        cols = [_stats([x for r in rounds for x in r[key]]) for key in keys]
        print(f"{name:<18} " + " ".join(f"{c:>24}" for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
