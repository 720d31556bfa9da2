"""``oppo-jax compile-plan``: a run's compiled programs by family, from its config alone
(``oppo_jax.pipeline.compile_plan``, what the warm-up compiles), with a projected compile
time from seconds per program measured on XLA:CPU.
"""

from __future__ import annotations

import dataclasses
import json

from oppo_jax.config import load_config
from oppo_jax.pipeline.compile_plan import Family, plan_programs, run_shapes
from oppo_jax.pipeline.schedule import Schedule


def total_programs(families: list[Family]) -> int:
    return sum(f.programs for f in families)


@dataclasses.dataclass(frozen=True)
class CompileSeconds:
    """Seconds to trace and compile one program of each family, as measured somewhere."""

    measured: str  # the backend, models and depth, and where the numbers come from
    seconds: dict  # family -> seconds per program


# The CPU demo's models (2 layers), its warm-up's compilations by family (warmup.json).
DEMO_CPU = CompileSeconds(
    "XLA:CPU, the demo's 2-layer models, warmup.json of configs/demo_cpu.yaml (2026-12-06)",
    {
        "admission prefill": 0.41,
        "decode start": 0.07,
        "replay": 0.53,
        "decode": 0.85,
        "streamed scoring": 0.50,
        "sync scoring": 0.37,
        "experience": 0.39,
        "update": 3.0,
    },
)
# Qwen2.5-7B widths, 28 scanned layers, bf16: oppo-jax memory's kernels compiled for XLA:CPU
# on abstract inputs (qwen2.5-7b_gh200x1_lora, 2026-12-06); its admission kernel is the
# prefill and the decode start in one, and the experience was not measured: both are counted
# at the admission's seconds. A GPU's or a TPU's compiler takes other times.
QWEN_7B_CPU = CompileSeconds(
    "XLA:CPU, Qwen2.5-7B widths, 28 scanned layers, abstract inputs, oppo-jax memory's "
    "kernels of qwen2.5-7b_gh200x1_lora (2026-12-06)",
    {
        "admission prefill": 1.6,
        "decode start": 1.6,
        "replay": 1.5,
        "decode": 2.1,
        "streamed scoring": 2.0,
        "sync scoring": 2.0,
        "experience": 1.6,
        "update": 5.9,
    },
)


def compile_seconds(cfg) -> CompileSeconds:
    """The measured seconds a projection of ``cfg`` uses: the 7B's for a Qwen2.5 preset (its
    layers are scanned, so depth hardly matters; the 3B is counted at the 7B's), else the
    demo's."""
    return QWEN_7B_CPU if (cfg.model.preset or "").startswith("qwen2.5") else DEMO_CPU


def plan_report(cfg, mode: str | None = None, backend: str | None = None) -> dict:
    """``oppo-jax compile-plan``'s report: the programs by family and their total."""
    if backend is None:
        import jax  # only to ask where the kernels would run

        backend = jax.default_backend()
    schedule = Schedule.named(mode or cfg.pipeline.mode)
    families = plan_programs(run_shapes(cfg, schedule, backend))
    measured = compile_seconds(cfg)
    projected = sum(f.programs * measured.seconds[f.name] for f in families)
    return {
        "mode": schedule.name,
        "backend": backend,
        "programs": total_programs(families),
        "projected_compile_s": round(projected, 1),
        "seconds_measured_on": measured.measured,
        "families": [
            {
                "name": f.name,
                "programs": f.programs,
                "shapes": [list(x) if isinstance(x, tuple) else x for x in f.shapes],
            }
            for f in families
        ],
    }


def main(args) -> int:
    """Print ``oppo-jax compile-plan``'s report (``--json``: as JSON)."""
    report = plan_report(load_config(args.config, args.overrides), args.mode, args.backend)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['programs']} programs ({report['mode']}, backend {report['backend']}):")
    for f in report["families"]:
        print(f"  {f['name']:<18} {f['programs']:>4}  shapes {f['shapes']}")
    projected, measured = report["projected_compile_s"], report["seconds_measured_on"]
    print(f"projected compile time: {projected:.0f} s, from seconds per program measured on")
    print(f"  {measured}")
    return 0
