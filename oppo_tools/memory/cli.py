"""``oppo-jax memory CONFIG``: the per-device memory report of a run config, as tables or JSON.

The report itself (state bytes from shapes and shardings, kernel bytes from XLA's memory
analysis) is ``oppo_tools.memory.report``; this module maps a config onto it and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import jax

from oppo_jax.base.help_text import plain
from oppo_jax.config import ConfigError
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_tools.memory.report import (
    KERNELS,
    Lowering,
    ReportModels,
    ReportSettings,
    RunShapes,
    memory_report,
)
from oppo_tools.memory.target import TARGETS


def config_memory_report(
    cfg,
    kernels: Sequence[str] = KERNELS,
    layers: int | None = None,
    remat: str | None = None,
    target: str = "cpu",
    schedule=None,
) -> dict:
    """``memory_report`` of a run config with ``model.preset`` set: its mesh, placement and
    ``model.remat`` (unless ``remat``), its scorers (``compile_plan.scorer_roles``: no critic
    when critic-free, no reference at β = 0, no reward model with reward functions alone), B,
    P, R, slots B + Δ_max·G (B when the schedule does not carry; G samples per prompt change
    no sequence's bytes, only how many slots Δ groups hold), the largest chunk size it may
    use, and the widest replay of carried prefixes."""
    # Higher layers, imported here only: the report itself needs no pipeline.
    from oppo_jax.base.shapes import refill_store_rows
    from oppo_jax.pipeline.compile_plan import scorer_roles
    from oppo_jax.pipeline.schedule import Schedule
    from oppo_jax.scoring.carried import row_bucket
    from oppo_tools.abstract_checks import preset_models

    if cfg.model.preset is None:
        raise ConfigError(
            "model.preset is not set: the memory report needs an architecture "
            "(e.g. --set model.preset=qwen2.5-7b)"
        )
    actor, critic = preset_models(cfg)
    lo = cfg.model
    adapters = {"lora_rank": lo.lora_rank, "lora_alpha": lo.lora_alpha,
                "lora_targets": tuple(lo.lora_targets)}  # fmt: skip
    actor, critic = actor.replace(**adapters), critic.replace(**adapters)
    r, p, m = cfg.rollout, cfg.pipeline, cfg.mesh
    delta = p.overcommit_max if p.adaptive_overcommit else p.overcommit
    schedule = schedule or Schedule.named(p.mode)
    carried = (delta if schedule.carry else 0) * r.group_size  # Δ counts groups
    chunk = max([p.chunk_size, *(p.chunk_candidates if p.chunk_tuning else [])])
    slots = r.batch_size + carried
    refills = schedule.carry and r.refill_every > 0
    shapes = RunShapes(
        r.batch_size,
        r.max_prompt_len,
        r.max_response_len,
        slots,
        chunk,
        replay_rows=row_bucket(carried, slots),
        # the prompt stores of a refilling run (rollout.refill_every on a carrying schedule)
        refill_store_rows=refill_store_rows(slots, r.group_size) if refills else 0,
    )
    scoring = (1, m.scoring_devices, 1) if p.placement == "disaggregated" else None
    settings = ReportSettings(
        (m.data, m.fsdp, m.tensor),
        scoring,
        cfg.ppo,
        cfg.optim,
        SamplingConfig(r.temperature, r.top_k, r.top_p, r.greedy),
    )
    lowering = Lowering(tuple(kernels), layers, remat or cfg.model.remat, target)
    models = ReportModels(actor, critic, roles=scorer_roles(cfg))
    report = memory_report(models, shapes, settings, lowering)
    return {"preset": cfg.model.preset, **report}


FROZEN_ROWS = (
    ("reference parameters (frozen; the LoRA actor's base)", "reference_params"),
    ("reward parameters (frozen; the LoRA critic's base)", "reward_params"),
)


def format_table(report: dict) -> str:
    """Markdown tables of a ``memory_report`` per device: resident bytes, then the kernels."""
    unit, scale = ("GiB", 2**30) if report["resident"] >= 2**30 else ("MiB", 2**20)
    fmt = lambda n: f"{n / scale:.2f}"  # noqa: E731
    b, roles = report["bytes"], report.get("roles", ["reference", "critic", "reward"])
    critic = "critic" in roles
    trained = "actor + critic" if critic else "actor; critic-free"
    rows = [
        ("actor parameters (trained)", b["actor_params"]),
        *([("critic parameters (trained)", b["critic_params"])] if critic else []),
        ("LoRA bases on the training devices (frozen)", b["frozen_params"]),
        (f"AdamW moments on the device ({trained})", b["optimizer"]),
        # absent models (β = 0 without LoRA, reward functions only) get no row
        *[(name, b[key]) for name, key in FROZEN_ROWS if b[key]],
        *((f"KV cache: {role}", n) for role, n in b["kv_caches"].items()),
        ("PPO batch", b["ppo_batch"]),
        ("resident on the device", report["resident"]),
        ("AdamW moments in host memory (optim.offload)", b["host"]["optimizer"]),
    ]
    lines = [
        f"{unit} per device, mesh {report['mesh']} (scorers {report['scoring_mesh']}); "
        f"{report['note']}.",
        f"scorers: {', '.join(roles) or 'none (reward functions only)'}.",
        "",
        f"| state | {unit} |",
        "|---|---|",
        *(f"| {name} | {fmt(n)} |" for name, n in rows),
        "",
        "| kernel | arguments | outputs | aliased | temporaries | peak | with resident "
        "| with live |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, k in report["kernels"].items():
        fields = ("argument", "output", "alias", "temp", "peak", "with_resident", "with_live")
        cells = (k[f] for f in fields)
        lines.append(f"| {name} | " + " | ".join(map(fmt, cells)) + " |")
    packed = report["shapes"].get("packed_update")
    chunks = report["shapes"].get("packed_update_chunks")
    update = (
        f"the update: packed, at its one shape {packed[0]} rows x {packed[1]} columns, "
        f"{packed[2]} response slots, {chunks} chunks per minibatch"
    )
    warm = report.get("warmup")
    lines += [
        "",
        update + ".",
        f"the warm-up: the step's kernels on the train state, its trained part parked in host "
        f"memory ({fmt(warm['trained_copy'])} {unit}): at most {fmt(warm['with_resident'])} "
        f"{unit} with resident, {fmt(warm['with_live'])} with live, a step's peak (several "
        f"processes copy it on the device instead: {fmt(warm['with_resident_multiprocess'])}).",
        "with resident: a kernel's temporaries and new outputs on top of everything resident "
        "(an upper bound); with live: on top of what the step holds while it runs (the "
        "admission before, the update after the KV caches but the frozen scorers' kept rows).",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``oppo-jax memory CONFIG [--set K=V ...] [--json]``: print the report of one config.

    Call it before JAX has started (it then fakes the CPU devices the config's mesh needs).
    """
    from oppo_jax.config import devices_needed, load_config

    parser = argparse.ArgumentParser(
        prog="oppo-jax memory", description=plain(__doc__.splitlines()[0])
    )
    parser.add_argument("config", help="config name or YAML file (needs model.preset)")
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override config keys (give CONFIG first)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--layers",
        type=int,
        help="lower at this depth and one more and extrapolate linearly (a fast estimate, up to "
        "14%% below a full-depth lowering of the 7B LoRA config; the default lowers all layers)",
    )
    parser.add_argument("--remat", choices=("none", "full", "dots"), help="override model remat")
    parser.add_argument("--kernels", nargs="*", choices=KERNELS, default=list(KERNELS))
    parser.add_argument(
        "--target",
        help=f"compile for one of {', '.join(TARGETS)} (a topology may follow: tpu-v5p:2x2x2); "
        "default: the config's own (mesh.target, else the hardware its name names), else cpu "
        "(XLA:CPU on fake devices: bf16 computed in f32, upper bounds)",
    )
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    try:  # only possible before JAX has started its backends; target_meshes says so otherwise
        jax.config.update("jax_num_cpu_devices", devices_needed(cfg))
    except RuntimeError:
        pass
    target = args.target or _own_target(cfg, args.config)
    report = config_memory_report(cfg, args.kernels, args.layers, args.remat, target)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


def _own_target(cfg, name: str) -> str:
    """The config's own target (``aot.default_target``) when its compiler is installed here;
    else "cpu", whose upper bounds are labelled as such, with one line on stderr saying why."""
    from oppo_jax.parallel.targets import Target, TargetError
    from oppo_tools.aot import default_target

    own = default_target(cfg, name)
    described = Target.parse(own)
    if not described.deviceless:
        return "cpu"
    try:
        described.devices(1)
    except TargetError as err:
        print(f"oppo-jax memory: CPU upper bounds instead of {own}: {err}", file=sys.stderr)
        return "cpu"
    return own


if __name__ == "__main__":
    raise SystemExit(main())
