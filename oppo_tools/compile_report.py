"""``oppo-jax compile-plan``: a run's programs, from its config alone. By default every
program of the compile plan compiled for the config's target (``oppo_tools.aot``: the
registry, by the target's own compiler, deviceless for a TPU or GPU) with its seconds, bytes
and costs; with ``--plan-only`` the plan's families (``oppo_jax.pipeline.compile_plan``) and a
projected compile time from seconds per program measured on XLA:CPU, without compiling.
"""

from __future__ import annotations

import dataclasses
import json
import sys

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
        # a refilling run's (not measured apart): the start and the placement at the decode
        # start's seconds, a prompt store at the admission prefill's
        "refill start": 0.07,
        "refill prompts": 0.41,
        "refill place": 0.07,
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
        "refill start": 1.6,  # a refilling run's, counted as the DEMO_CPU's are
        "refill prompts": 1.6,
        "refill place": 1.6,
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


def registry_report(cfg, config_name: str | None, mode: str | None, target: str | None) -> dict:
    """``oppo-jax compile-plan``'s report of a registry: every planned program compiled for
    ``target`` (default: the config's own, ``aot.default_target``), with its compile seconds,
    per-device bytes and compiler-counted costs, and the run's peak per device against the
    target's HBM."""
    from oppo_jax.parallel.targets import Target
    from oppo_tools.aot import build_registry, default_target, peak_bytes
    from oppo_tools.memory.cli import config_memory_report

    described = Target.parse(target or default_target(cfg, config_name))
    schedule = Schedule.named(mode or cfg.pipeline.mode)
    registry, run = build_registry(cfg, described, schedule)
    planned = {f.name: f.programs for f in plan_programs(run.shapes)}
    built = {f: len(ps) for f, ps in registry.by_family().items()}
    if built != planned:  # a bug: the walk must compile exactly the plan's programs
        raise RuntimeError(f"registry drifted from the compile plan: {planned} planned, {built}")
    state = config_memory_report(cfg, kernels=(), target=described.name, schedule=schedule)
    peak, worst = peak_bytes(registry, state["resident"])
    hbm = described.hbm_bytes
    return {
        "target": described.name,
        "compiler": registry.compiler,
        "mode": schedule.name,
        "programs": [p.row() for p in registry.programs],
        "families": {
            f: {"programs": len(ps), "compile_s": round(sum(p.compile_s for p in ps), 1)}
            for f, ps in registry.by_family().items()
        },  # fmt: skip
        "compile_s": round(registry.compile_s, 1),
        "resident_bytes_per_device": state["resident"],
        "peak_bytes_per_device": peak,
        "peak_program": worst,
        "hbm_bytes_per_device": hbm,
        "fits": None if hbm is None else peak <= hbm,
        "note": "peak: everything resident plus the worst program's new outputs and "
        "temporaries (an upper bound); costs per device, loop trip counts multiplied in",
    }


def format_registry(report: dict) -> str:
    """The registry report as text: one line per program, then the run's totals."""
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = [
        f"{len(report['programs'])} programs ({report['mode']}) compiled for "
        f"{report['target']} by {report['compiler']} in {report['compile_s']:.1f} s:",
    ]
    for p in report["programs"]:
        lines.append(
            f"  {p['family']:<18} {str(tuple(p['shape'])):<22} {p['role']:<9} "
            f"{p['compile_s']:>7.1f} s  temp {gib(p['temp_bytes']):>11}  "
            f"{p['flops'] / 1e12:>9.3f} TFLOP"
        )
    hbm = report["hbm_bytes_per_device"]
    verdict = (
        ""
        if hbm is None
        else (f" of {gib(hbm)} HBM: " + ("fits" if report["fits"] else "DOES NOT FIT"))
    )
    lines.append(
        f"peak per device {gib(report['peak_bytes_per_device'])} (resident "
        f"{gib(report['resident_bytes_per_device'])} + {report['peak_program']}){verdict}"
    )
    return "\n".join(lines)


def main(args) -> int:
    """Print ``oppo-jax compile-plan``'s report (``--json``: as JSON): the registry compiled
    for the target, or with ``--plan-only`` the plan's families without compiling."""
    from oppo_jax.parallel.targets import Target
    from oppo_tools.aot import default_target

    cfg = load_config(args.config, args.overrides)
    if not args.plan_only and cfg.model.preset is None:  # no architecture without weights
        print(
            "oppo-jax compile-plan: model.preset is not set, so the programs are listed, not "
            "compiled (set model.preset to the checkpoint's architecture to compile them)",
            file=sys.stderr,
        )
    elif not args.plan_only:
        report = registry_report(cfg, args.config, args.mode, args.target)
        print(json.dumps(report, indent=1) if args.json else format_registry(report))
        return 0
    backend = Target.parse(args.target or default_target(cfg, args.config)).platform
    report = plan_report(cfg, args.mode, backend)
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
