"""Memory per device of the real-size configs, from the compiled kernels' own memory analysis.

For each config with a ``model.preset`` (or the ones named on the command line) this runs
``oppo_tools.memory.cli.config_memory_report``: the resident state (trained and frozen parameters,
AdamW moments, the four KV caches, the PPO batch) from shapes and the run's shardings, and the
update, the actor's admission prefill, a decode chunk and a reference-scorer chunk lowered
with abstract sharded inputs and compiled for the CPU backend on fake devices (all layers
unless ``--layers``). Nothing is allocated. XLA:CPU computes bf16 in f32, so the kernels'
temporaries are upper bounds for the bf16 configs. Run from the repository root:

    .venv/bin/python benchmarks/memory_per_device.py                         # every real config
    .venv/bin/python benchmarks/memory_per_device.py qwen2.5-7b_gh200x4 --remat full --full
    .venv/bin/python benchmarks/memory_per_device.py qwen2.5-7b_gh200x4 --set mesh.fsdp=8 --json
"""

from __future__ import annotations

import argparse
import json

import jax

from oppo_jax.config import CONFIG_DIR, devices_needed, load_config
from oppo_tools.memory.cli import config_memory_report, format_table
from oppo_tools.memory.report import KERNELS

GIB = 2**30


def _row(name: str, rep: dict) -> str:
    gib = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    k = rep["kernels"]
    cells = [name, rep["mesh"], rep["models"]["actor"]["remat"], gib(rep["resident"])]
    cells += [f"{gib(k[n]['temp'])} / {gib(k[n]['with_resident'])}" if n in k else "–"
              for n in KERNELS]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="config names or files (default: all real)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument(
        "--layers",
        type=int,
        help="lower at this depth and one more and extrapolate linearly (a fast estimate, up to "
        "14%% below a full-depth lowering of the 7B LoRA config; the default lowers all layers)",
    )
    parser.add_argument("--remat", choices=("none", "full", "dots"), help="override model remat")
    parser.add_argument("--kernels", nargs="*", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--full", action="store_true", help="every config's full tables too")
    parser.add_argument("--json", action="store_true", help="one JSON report per line")
    args = parser.parse_args()
    names = args.configs or sorted(
        p.stem for p in CONFIG_DIR.glob("*.yaml") if load_config(p).model.preset
    )
    configs = {name: load_config(name, args.overrides) for name in names}
    jax.config.update("jax_num_cpu_devices", max(map(devices_needed, configs.values())))
    if not args.json:
        print("GiB per device. Kernels: temporaries / with everything resident (CPU backend,")
        print("bf16 computed in f32: upper bounds). Resident: parameters, AdamW, KV caches, batch.")
        print()
        print("| config | mesh d×f×t | remat | resident | " + " | ".join(KERNELS) + " |")
        print("|---|---|---|---|" + "---|" * len(KERNELS))
    reports = {}
    for name, cfg in configs.items():
        reports[name] = config_memory_report(cfg, args.kernels, args.layers, args.remat)
        if args.json:
            print(json.dumps({"config": name, **reports[name]}), flush=True)
        else:
            print(_row(name, reports[name]), flush=True)
    if args.full and not args.json:
        for name, rep in reports.items():
            print(f"\n### {name}\n\n{format_table(rep)}")


if __name__ == "__main__":
    main()
