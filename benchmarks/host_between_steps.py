"""The host's work between two steps of the training loop: per step, the loop's period minus the
step's own window (``step_time_s``), and the loop thread's own CPU time outside ``run_step``,
which a shared machine's other processes do not inflate as they do the wall-clock period. With
``--by-function``, both split by the functions the loop calls between two ``run_step`` calls.

The loop's period is the time between two successive ``RunLog.write`` calls (one per step).
Rounds alternate two modes in one process, so that a slow period of a shared machine spreads
over both: records built and written by ``RunLog``'s writer thread (the run's default), and on
the loop's thread (``RunLog(background=False)``). Steps that compiled, and the first ``--skip``
of each round, are left out. Another checkout's code is measured by running this file there
(``git worktree``), alternating the two by rounds.

    .venv/bin/python benchmarks/host_between_steps.py                  # grpo_demo_cpu, ~2 min
    .venv/bin/python benchmarks/host_between_steps.py --by-function --out host.json
    cd /tmp/wt && PYTHONPATH=. /work/main/.venv/bin/python benchmarks/host_between_steps.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# What the loop calls between two ``run_step`` calls (--by-function), by (module, attribute).
FUNCTIONS = (
    ("oppo_jax.pipeline.host_state", "HostState.plan"),
    ("oppo_jax.pipeline.host_state", "HostState.observe"),
    ("oppo_jax.train", "step_record"),
    ("oppo_jax.pipeline.warmup", "CompileCounter.take"),
    ("oppo_jax.pipeline.timeline", "TraceWriter.add_step"),
    ("oppo_jax.pipeline.carry", "CarryBuffer.extend"),
    ("oppo_jax.run.log", "RunLog.write"),
    ("oppo_jax.run.log", "RunLog._emit"),  # on the writer thread, or in write()
)


def _clocks() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread): the second does not count the time other
    processes of a shared machine hold the cores."""
    return time.perf_counter(), time.thread_time()


class Probe:
    """The clocks at each ``RunLog.write`` and around each ``run_step`` (its window's end too:
    ``Timeline.end_step``), and with ``by_function`` each function of ``FUNCTIONS`` per step,
    on the loop's thread and on others."""

    def __init__(self, by_function: bool):
        self.writes, self.steps, self.window_ends = [], [], []
        self.loop = threading.get_ident()
        # (function, on the loop's thread) -> period -> [wall, cpu]
        self.spent = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
        self._undo = []
        self._patch("oppo_jax.run.log", "RunLog.write", self._at_write)
        self._patch("oppo_jax.train", "run_step", self._around_step)
        self._patch("oppo_jax.pipeline.timeline", "Timeline.end_step", self._at_window_end)
        for module, name in FUNCTIONS if by_function else ():
            self._patch(module, name, self._timed(name))

    def _patch(self, module: str, name: str, wrapper) -> None:
        owner = importlib.import_module(module)
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        real = getattr(owner, attr)
        setattr(owner, attr, wrapper(real))
        self._undo.append((owner, attr, real))

    def undo(self) -> None:
        for owner, attr, real in reversed(self._undo):
            setattr(owner, attr, real)

    def _at_write(self, real):
        def write(log, record):
            self.writes.append(_clocks())
            return real(log, record)

        return write

    def _around_step(self, real):
        def run_step(*args):
            start = _clocks()
            out = real(*args)
            self.steps.append((start, _clocks()))
            return out

        return run_step

    def _at_window_end(self, real):
        def end_step(timeline):
            out = real(timeline)
            self.window_ends.append(_clocks())
            return out

        return end_step

    def _timed(self, name: str):
        def wrapper(real):
            def timed(*args, **kwargs):
                start = _clocks()
                try:
                    return real(*args, **kwargs)
                finally:
                    end = _clocks()
                    on_loop = threading.get_ident() == self.loop
                    # the period it ended in: i, between the clocks of writes i-1 and i
                    spent = self.spent[name, on_loop][len(self.writes)]
                    spent[0] += end[0] - start[0]
                    spent[1] += end[1] - start[1]

            return timed

        return wrapper


def run_round(cfg, background: bool, skip: int, by_function: bool) -> dict:
    """One run of ``cfg`` with the given writer; per-step milliseconds."""
    import oppo_jax.run.log as log_module
    import oppo_jax.train as train_module
    from oppo_jax.run.log import read_metrics

    probe, real_log = Probe(by_function), log_module.RunLog

    class Log(real_log):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, background=background)

    train_module.RunLog = Log
    try:
        with tempfile.TemporaryDirectory() as out:
            train_module.train(cfg, out, progress=True, warmup=True)
            records = read_metrics(f"{out}/metrics.jsonl")
    finally:
        train_module.RunLog = real_log
        probe.undo()
    return _per_step(probe, records, skip)


def _per_step(probe: Probe, records: list[dict], skip: int) -> dict:
    """Each counted step's milliseconds: ``host_ms`` (period - step_time_s), ``cpu_ms`` (the
    loop thread's CPU between two writes, outside ``run_step``), ``period_ms``, ``step_ms``,
    ``outside_ms`` (``run_step``'s wall time after its window), and by function."""
    out = defaultdict(list)
    for i in range(max(skip, 1), len(records)):
        if records[i]["compiles"] or records[i - 1]["compiles"]:
            continue
        (w0, c0), (w1, c1) = probe.writes[i - 1], probe.writes[i]
        (_, cpu_in), (end_wall, cpu_out) = probe.steps[i]
        out["period_ms"].append(1e3 * (w1 - w0))
        out["step_ms"].append(1e3 * records[i]["step_time_s"])
        out["host_ms"].append(1e3 * (w1 - w0 - records[i]["step_time_s"]))
        out["cpu_ms"].append(1e3 * ((c1 - c0) - (cpu_out - cpu_in)))
        out["outside_ms"].append(1e3 * (end_wall - probe.window_ends[i][0]))
        for (name, on_loop), by_gap in probe.spent.items():  # the calls ended in this period
            wall, cpu = by_gap.get(i, (0.0, 0.0))
            where = "loop" if on_loop else "other threads"
            out[f"{name} ({where}) wall_ms"].append(1e3 * wall)
            out[f"{name} ({where}) cpu_ms"].append(1e3 * cpu)
    return dict(out)


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"{statistics.median(xs):7.2f} {statistics.mean(xs):7.2f} {p90:7.2f}"


def _report(args, results: dict) -> None:
    import oppo_jax

    where = os.path.dirname(os.path.dirname(oppo_jax.__file__))
    print(f"\n{args.config}, {args.steps} steps x {args.rounds} rounds per mode (ms per step)")
    print(f"code: {where}; load average {os.getloadavg()[0]:.1f}")
    heads = {
        "host_ms": "period - step_time_s",
        "cpu_ms": "loop thread's CPU",
        "period_ms": "period",
        "step_ms": "step_time_s",
        "outside_ms": "run_step after window",
    }
    print(f"{'records built on':<18} " + " ".join(f"{h:>24}" for h in heads.values()))
    print(f"{'':<18} " + " ".join(f"{'median mean p90':>24}" for _ in heads))
    for name, rounds in results.items():
        cols = [_stats([x for r in rounds for x in r[key]]) for key in heads]
        print(f"{name:<18} " + " ".join(f"{c:>24}" for c in cols))
    for name, rounds in results.items():
        keys = sorted(k for k in rounds[0] if k.endswith(("wall_ms", "cpu_ms")) and "(" in k)
        if keys:
            print(f"\nby function, records built on the {name} (median mean p90)")
        for key in keys:
            print(f"  {key:<62} {_stats([x for r in rounds for x in r[key]])}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="grpo_demo_cpu")
    p.add_argument("--set", dest="overrides", nargs="*", default=[])
    p.add_argument("--steps", type=int, default=60, help="steps per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    p.add_argument("--skip", type=int, default=5, help="first steps of a round left out")
    p.add_argument("--modes", default="writer,loop", help="writer, loop or both, in this order")
    p.add_argument("--by-function", action="store_true", help="time FUNCTIONS too")
    p.add_argument("--out", default=None, help="JSON of every measurement")
    args = p.parse_args(argv)
    from oppo_jax.cli import compilation_cache
    from oppo_jax.config import load_config

    compilation_cache()  # as `oppo-jax train`: a round's warm-up reads its programs back

    # no held-out evaluation: its decodes at step 0 and the end are not steps
    overrides = [f"train.steps={args.steps}", "train.checkpoint_every=0", "eval.split=null"]
    cfg = load_config(args.config, overrides + args.overrides)
    modes = {"writer": (True, "writer thread"), "loop": (False, "loop's thread")}
    chosen = [modes[m] for m in args.modes.split(",")]
    results = {name: [] for _, name in chosen}
    for _ in range(args.rounds):
        for background, name in chosen:
            results[name].append(run_round(cfg, background, args.skip, args.by_function))
    _report(args, results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load": os.getloadavg(), "results": results}, f)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
