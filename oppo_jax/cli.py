"""The oppo-jax command: train, bench, export, compile-plan, sim, memory, sft, rm."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from oppo_jax.base.help_text import plain

EXIT_INTERRUPTED = 130  # a Ctrl-C the run could not handle (the shell's 128 + SIGINT)
# JAX's persistent compilation cache: auto or on (every backend, every program kept), off
COMPILATION_CACHE_ENV = "OPPO_JAX_COMPILATION_CACHE"


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="YAML file or a name in configs/ (default: the CPU demo)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override config keys, e.g. --set rollout.batch_size=32 seed=1 (also repeatable; "
        "give CONFIG before --set)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oppo-jax",
        description=plain(__doc__),
        epilog="Each command's options: oppo-jax COMMAND --help",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run PPO-RLHF (with no CONFIG: the embedded CPU demo)")
    _config_args(train)
    train.add_argument(
        "--out",
        default=None,
        help="run directory, new or empty unless --resume or --overwrite "
        "(default: runs/<config>-YYYYmmdd-HHMMSS)",
    )
    again = train.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its latest checkpoint (same config but train.*)",
    )
    again.add_argument(
        "--overwrite", action="store_true", help="delete the run in --out first, then start anew"
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the warm-up that compiles every shape before step 0 (it briefly holds a "
        "second copy of the train state); steps then compile shapes when they first meet them",
    )
    _bench_parser(
        sub.add_parser("bench", help="sync, intra, inter and oppo side by side, one process")
    )
    export = sub.add_parser("export", help="a run's actor in Hugging Face format")
    export.add_argument("run", help="run directory (holds config.yaml and checkpoints/)")
    export.add_argument("--out", required=True, help="new or empty directory to write")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    _export_flags(export)
    _plan_parser(sub.add_parser("compile-plan", help="a run's programs, compiled for a target"))
    sub.add_parser("sim", add_help=False, help="predict step times of the four schedules")
    sub.add_parser(
        "memory", add_help=False, help="bytes per device of a config's state and kernels"
    )
    for name, what in (("sft", "the demo actor (supervised)"), ("rm", "the demo reward model")):
        p = sub.add_parser(name, help=f"build {what} into the cache (or --out)")
        _config_args(p)
        p.add_argument("--out", default=None, help="directory to write the model to")
    return parser


def _export_flags(export) -> None:
    export.add_argument("--critic", action="store_true", help="also write the critic")
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out, replacing an earlier export's files (never into a "
        "run directory)",
    )


def _plan_parser(plan) -> None:
    _config_args(plan)
    plan.add_argument("--mode", default=None, help="schedule (default: pipeline.mode)")
    plan.add_argument(
        "--target",
        help="compile for: host, tpu-v5p[:2x2x1], tpu-v6e, h100[:1x1x8], h200, gh200[:1x4x1] "
        "(default: mesh.target, else the hardware the config's name names, else this host)",
    )
    plan.add_argument(
        "--plan-only", action="store_true", help="list the plan's programs without compiling"
    )
    plan.add_argument("--json", action="store_true", help="print the report as JSON")


def _demo_build(args, which: str) -> int:
    from oppo_jax.config import load_config
    from oppo_jax.data.demo_task import DemoTaskSpec
    from oppo_jax.demo.common import summary_lines
    from oppo_jax.demo.reward_model import train_reward_model
    from oppo_jax.demo.sft import train_sft
    from oppo_jax.run.setup import cache_dir

    cfg = load_config(args.config, args.overrides)
    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    out = args.out or str(cache_dir() / "demo-manual" / ("actor" if which == "sft" else "reward"))
    if which == "sft":
        steps, what = cfg.train.sft_steps, "SFT actor"
        stats = train_sft(spec, out, steps, seed=cfg.seed)
    else:
        steps, what = cfg.train.rm_steps, "Reward model"
        stats = train_reward_model(spec, out, steps, seed=cfg.seed)
    print("\n".join(summary_lines(what, out, steps, stats)))
    return 0


def _ensure_cpu_devices(cfg) -> None:
    """On a CPU, fake as many devices as the config's placement needs (before jax loads),
    split evenly over ``JAX_NUM_PROCESSES`` processes when several run on one machine."""
    from oppo_jax.config import devices_needed

    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    processes = max(int(os.environ.get("JAX_NUM_PROCESSES", "").strip() or 1), 1)
    if flag not in flags and "jax" not in sys.modules:
        count = -(-devices_needed(cfg) // processes)
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={count}".strip()


def _start_runtime(cfg) -> None:
    """Fake CPU devices, then join the multi-host runtime if this is one process of a job.

    ``jax.distributed.initialize`` must run before any JAX computation: it is driven by
    ``mesh.multihost`` or by the environment (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID, SLURM, Open MPI, TPU pods); a single process is left alone.
    """
    _ensure_cpu_devices(cfg)
    from oppo_jax.parallel.sharding import multihost_initialize

    multihost_initialize(force=cfg.mesh.multihost)


class _NoTorchNotice(logging.Filter):
    """Drops transformers' "PyTorch was not found" notice: oppo_jax reads weights without
    torch, so the notice said nothing about a run, on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def quiet_torch_notice() -> None:
    """Install ``_NoTorchNotice`` on transformers' logger (before transformers is imported:
    it logs the notice at import)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchNotice) for f in logger.filters):
        logger.addFilter(_NoTorchNotice())


def compilation_cache() -> str | None:
    """Turn on JAX's persistent compilation cache as ``$OPPO_JAX_COMPILATION_CACHE`` says:
    ``auto`` or ``on`` (default), ``off``; in ``$JAX_COMPILATION_CACHE_DIR``, else
    ``<cache>/xla`` (``OPPO_JAX_CACHE``, by default ~/.cache/oppo_jax). Every program is kept
    (JAX's default keeps only those that took a second, and most of a CPU run's take less), so
    a resume, a rerun or a notebook restart reads its programs back instead of compiling them.
    Returns the directory, or None when off."""
    import jax

    from oppo_jax.base.errors import InputError
    from oppo_jax.run.setup import cache_dir

    setting = os.environ.get(COMPILATION_CACHE_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "on", "off"):
        raise InputError(f"{COMPILATION_CACHE_ENV}={setting!r}: use auto, on or off")
    if setting == "off":
        return None
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def _default_out(args, cfg) -> str:
    """runs/<config name>-YYYYmmdd-HHMMSS: a new directory for every run."""
    from oppo_jax.base.errors import InputError

    if args.resume:
        raise InputError("--resume needs --out, the run directory to continue")
    if cfg.mesh.multihost or int(os.environ.get("JAX_NUM_PROCESSES", "").strip() or 1) > 1:
        raise InputError("a multi-process run needs --out (every process must name the same one)")
    name = "demo" if args.config is None else Path(args.config).stem
    return f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _train(args) -> int:
    from oppo_jax.config import load_config

    cfg = load_config(args.config, args.overrides)  # validated before anything compiles
    from oppo_jax.run.log import check_run_dir, clear_run_dir

    args.out = args.out or _default_out(args, cfg)
    check_run_dir(args.out, cfg, args.resume, args.overwrite)  # before any process writes
    _start_runtime(cfg)
    import jax

    from oppo_jax.base.errors import Interrupted, Preempted
    from oppo_jax.run.preemption import resume_command
    from oppo_jax.train import summary_lines, train

    if args.overwrite and jax.process_index() == 0:  # one process clears the shared directory
        clear_run_dir(args.out)
    cache = compilation_cache()
    if cache and not args.quiet:
        print(f"Compilation cache: {cache} ({COMPILATION_CACHE_ENV}=off turns it off)")
    warmup = None if args.warmup else False  # None: on unless OPPO_JAX_WARMUP=off
    flags = (("--quiet", args.quiet), ("--no-warmup", not args.warmup))
    options = [flag for flag, given in flags if given]
    try:
        summary = train(cfg, args.out, args.resume, not args.quiet, warmup=warmup)
    except Preempted as stop:  # say how to continue: the same config, overrides and --out
        command = resume_command(args.config, args.overrides, args.out, options)
        raise stop.with_command(command) from None
    except Interrupted as stop:  # before step 0: the command that starts it (or resumes it)
        command = resume_command(args.config, args.overrides, args.out, options, None, args.resume)
        raise stop.with_command(command) from None
    print(f"\nRun directory: {args.out}")
    print("\n".join(summary_lines(summary)))
    return 0


def _bench_parser(bench) -> None:
    """``oppo-jax bench``'s options."""
    _config_args(bench)
    bench.add_argument(
        "--out", default="runs/bench", help="output directory (default: %(default)s)"
    )
    bench.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per schedule (default: the config's train.steps)",
    )
    bench.add_argument(
        "--seeds", type=int, default=1, help="seeds per schedule (default: %(default)s)"
    )
    bench.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="unmeasured first steps per schedule (default: %(default)s)",
    )
    bench.add_argument("--target-gold", type=float, default=None,
                       help="gold score for time-to-target (default: 70%% of the way to the "
                       "worst schedule's final gold)")  # fmt: skip
    bench.add_argument(
        "--schedules",
        default="sync,intra,inter,oppo",
        help="comma-separated schedules to run, sync among them (default: %(default)s)",
    )
    bench.add_argument(
        "--no-precompile",
        dest="precompile",
        action="store_false",
        help="compile shapes when first met, not in a warm-up up front (default: up front)",
    )


def _bench(args) -> int:
    from oppo_jax.config import load_config

    cfg = load_config(args.config, args.overrides)
    _ensure_cpu_devices(cfg)
    from oppo_tools.bench import BenchCounts, bench_summary_lines, run_bench

    steps = cfg.train.steps if args.steps is None else args.steps  # 0 is refused, not "default"
    schedules = [name.strip() for name in args.schedules.split(",") if name.strip()]
    counts = BenchCounts(steps, args.seeds, args.warmup)
    result = run_bench(
        cfg, args.out, counts, args.target_gold, precompile=args.precompile, schedules=schedules
    )
    print(f"\nWrote {args.out}/bench.json")
    print("\n".join(bench_summary_lines(result)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``oppo-jax`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_torch_notice()
    if argv[:1] == ["sim"]:  # its own parser; numpy only, never imports JAX
        from oppo_tools.sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv[:1] in (["memory"], ["compile-plan"]):  # before JAX starts: the deviceless GPU
        # compiler's plugin registers on a host without a driver only with this set, and
        # libtpu skips the cloud metadata query (parallel.targets)
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if argv[:1] == ["memory"]:  # its own parser; sets the CPU device count before JAX starts
        from oppo_tools.memory.cli import main as memory_main

        return _reporting_errors(lambda: memory_main(argv[1:]))
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return _reporting_errors(lambda: _command(args))


def _command(args) -> int:
    if args.command == "train":
        return _train(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "compile-plan":
        return _compile_plan(args)
    if args.command == "export":
        from oppo_jax.export import export_run

        print(f"wrote {export_run(args.run, args.out, args.step, args.critic, args.overwrite)}")
        return 0
    return _demo_build(args, args.command)


def _compile_plan(args) -> int:
    from oppo_tools.compile_report import main as report_main

    return report_main(args)


def _reporting_errors(command) -> int:
    """Run ``command``; user errors, non-finite stops, preemption (a stop before step 0
    included) and a host limit become one line on stderr and their exit codes (2, 3, 75, 4)
    instead of a traceback; so does a Ctrl-C outside a run's own handling (130)."""
    from oppo_jax.base.errors import (
        EXIT_BAD_INPUT,
        EXIT_HOST_LIMIT,
        EXIT_NONFINITE,
        EXIT_PREEMPTED,
        HostLimitError,
        InputError,
        Interrupted,
        NonFiniteError,
        Preempted,
    )  # fmt: skip

    try:
        return command()
    except InputError as e:  # ConfigError, PromptError, CheckpointError (model directories)
        print(f"oppo-jax: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NonFiniteError as e:
        print(f"oppo-jax: stopped: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except (Preempted, Interrupted) as e:
        print(f"oppo-jax: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt as e:  # a second Ctrl-C, or one before a run installs its handler
        print(f"oppo-jax: interrupted{f': {e}' if str(e) else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except HostLimitError as e:  # raised before step 0 (the warm-up): nothing to lose
        print(f"oppo-jax: stopped: {e}", file=sys.stderr)
        return EXIT_HOST_LIMIT


if __name__ == "__main__":
    sys.exit(main())
