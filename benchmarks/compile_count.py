"""How many XLA compilations a run triggers and how long they take, and how compile time of the
7B-shaped update grows with depth.

Two measurements, each in this process:

1. ``--demo-steps N``: the CPU demo (``configs/demo_cpu.yaml``, optionally ``--set``) for N steps
   through ``oppo_jax.train.train``; every backend compilation is counted through
   ``jax.monitoring`` (event ``/jax/core/compile/backend_compile_duration``).
2. ``--layers 2,4``: the PPO update of ``configs/qwen2.5-7b_gh200x4.yaml`` (Qwen2.5-7B widths,
   the config's mesh on fake CPU devices, abstract arrays: nothing allocated) lowered and
   compiled with that many layers; unrolled layers compile in time proportional to depth,
   scanned layers in about constant time.

    python benchmarks/compile_count.py --demo-steps 5 --layers 2,4 --out compiles.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts backend compilations and their seconds from the moment it is created."""

    def __init__(self):
        import jax.monitoring

        self.count, self.seconds = 0, 0.0

        def listen(event, duration, **_):
            if event == COMPILE_EVENT:
                self.count += 1
                self.seconds += duration

        jax.monitoring.register_event_duration_secs_listener(listen)

    def since(self, mark: tuple[int, float]) -> dict:
        return {"compiles": self.count - mark[0], "compile_s": round(self.seconds - mark[1], 2)}

    def mark(self) -> tuple[int, float]:
        return self.count, self.seconds


def demo_run(counter: CompileCounter, steps: int, overrides: list[str]) -> dict:
    from oppo_jax.config import load_config
    from oppo_jax.train import train

    cfg = load_config(None, [f"train.steps={steps}", "train.checkpoint_every=0", *overrides])
    mark, t0 = counter.mark(), time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        summary = train(cfg, out, progress=False)
    wall = round(time.perf_counter() - t0, 2)
    mean_step = float(summary["mean_step_time_s"])
    return {"steps": steps, "wall_s": wall, "mean_step_time_s": mean_step, **counter.since(mark)}


def update_compile(counter: CompileCounter, layers: int) -> dict:
    from oppo_jax.config import load_config
    from oppo_tools.abstract_checks import abstract_update_check, preset_models

    cfg = load_config("qwen2.5-7b_gh200x4")
    actor, critic = (m.replace(num_layers=layers) for m in preset_models(cfg))
    mark, t0 = counter.mark(), time.perf_counter()
    lowered = abstract_update_check(cfg, actor, critic)["lowered"]
    t1 = time.perf_counter()
    lowered.compile()
    return {
        "layers": layers,
        "lower_s": round(t1 - t0, 2),
        "lower_and_compile_s": round(time.perf_counter() - t0, 2),
        "hlo_chars": len(lowered.as_text()),
        **counter.since(mark),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-steps", type=int, default=5, help="demo steps (0: skip)")
    parser.add_argument("--layers", default="2,4", help="7B update depths to compile ('': skip)")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[])
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    counter = CompileCounter()
    result: dict = {"demo": None, "update_7b": []}
    if args.demo_steps:
        result["demo"] = demo_run(counter, args.demo_steps, args.overrides)
        print("demo:", result["demo"], flush=True)
    for layers in [int(x) for x in args.layers.split(",") if x.strip()]:
        result["update_7b"].append(update_compile(counter, layers))
        print("7B update:", result["update_7b"][-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
