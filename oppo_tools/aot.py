"""A run config's registry of programs compiled ahead of time for a target, from the config
alone: the models are the ``model.preset``'s architectures, the parameters and state are
abstract (shapes, dtypes, shardings on the target's devices), and nothing is allocated or
run. The programs are the run's own kernels (``pipeline.kernels``), walked as a step walks
them (``pipeline.program_walk``).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax

from oppo_jax.config import Config, ConfigError, devices_needed
from oppo_jax.models import lora
from oppo_jax.parallel.sharding import abstract_params, make_device_groups, param_shardings
from oppo_jax.parallel.targets import Target
from oppo_jax.pipeline.compile_plan import plan_programs, run_shapes
from oppo_jax.pipeline.kernels import build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.program_walk import AbstractRun, registry_build, walk_programs
from oppo_jax.pipeline.registry import Registry, compile_program
from oppo_jax.pipeline.schedule import Schedule
from oppo_jax.ppo.update import train_state_shardings
from oppo_jax.run.specs import rollout_spec, update_spec
from oppo_jax.run.trained_params import abstract_train_state
from oppo_tools.abstract_checks import preset_models
from oppo_tools.memory.abstract import abstract_tree

# Where a shipped config's name says which hardware it is for, the target it compiles for
# by default (its mesh then picks the topology): "gh200" before "h200", which it contains.
HARDWARE_IN_NAMES = (("tpu-v5p", "tpu-v5p"), ("gh200", "gh200"), ("h200", "h200"), ("h100", "h100"))


def default_target(cfg: Config, config_name: str | None) -> str:
    """``mesh.target`` if the config sets it, else the hardware its file name names
    (qwen2.5-7b_gh200x1_lora -> gh200), else this host."""
    if cfg.mesh.target:
        return cfg.mesh.target
    name = (config_name or "").lower()
    return next((t for hw, t in HARDWARE_IN_NAMES if hw in name), "host")


def target_placement(cfg: Config, target: Target) -> Placement:
    """The config's device groups on ``target``'s devices."""
    m = cfg.mesh
    devices = target.devices(devices_needed(cfg))
    groups = make_device_groups(
        cfg.pipeline.placement, m.data, m.fsdp, m.tensor, m.scoring_devices, devices
    )
    return Placement(groups)


def abstract_run(cfg: Config, target: Target, schedule: Schedule) -> AbstractRun:
    """The config's kernels on ``target`` with abstract parameters and train state."""
    if cfg.model.preset is None:
        raise ConfigError(
            "model.preset is not set: compiling for a target needs an architecture "
            "(e.g. --set model.preset=qwen2.5-7b)"
        )
    actor, critic = preset_models(cfg)
    reward = critic.replace(lora_rank=0)
    place = target_placement(cfg, target)
    mesh, scoring = place.groups.training, place.scoring_mesh
    spec = update_spec(cfg, actor, critic)
    rollout = rollout_spec(cfg, (1,), 0, place)
    reward_model = reward if cfg.reward.model_weight else None
    kernels = dataclasses.replace(
        build_kernels(spec, rollout, reward_model=reward_model),
        compact_slots=cfg.pipeline.compact_slots,
        compact_min_slots=cfg.pipeline.compact_min_slots,
    )
    state = abstract_tree(
        abstract_train_state(spec, cfg.optim.master_dtype), train_state_shardings(spec, mesh)
    )
    frozen = state.frozen or {}

    def on(cfg_, mesh_):
        return abstract_tree(abstract_params(cfg_), param_shardings(cfg_, mesh_))

    params = {"actor": lora.combine(state.actor_params, frozen.get("actor"))}
    params["reference"] = on(actor.replace(lora_rank=0), scoring)
    params["reward"] = on(reward, scoring)
    if spec.critic is not None:
        critic_params = lora.combine(state.critic_params, frozen.get("critic"))
        if place.disaggregated:
            critic_params = jax.tree.map(
                lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                critic_params,
                param_shardings(spec.critic, scoring),
            )
        params["critic"] = critic_params
    shapes = run_shapes(cfg, schedule, target.platform, head_dim=actor.head_dim)
    return AbstractRun(kernels, place, shapes, params, state)


def build_registry(cfg: Config, target: Target, schedule: Schedule, progress: bool = True):
    """Every program of ``cfg``'s compile plan under ``schedule``, compiled for ``target``."""
    run = abstract_run(cfg, target, schedule)
    registry = Registry(target.name, target.compiler)
    planned = sum(f.programs for f in plan_programs(run.shapes))
    start = time.perf_counter()

    def compile_one(family, shape, role, fn, args):
        if progress:
            done = len(registry.programs)
            print(
                f"  compiling {done + 1}/{planned}: {family} {shape} ({role}) for {target.name}"
                f", {time.perf_counter() - start:.0f} s so far",
                file=sys.stderr,
                flush=True,
            )
        return compile_program(family, shape, role, fn, args, target.compile_options)

    walk_programs(run, registry_build(registry, compile_one))
    return registry, run


def peak_bytes(registry: Registry, resident: int) -> tuple[int, str]:
    """(the peak per device: everything resident plus the worst program's new outputs and
    temporaries, an upper bound; that program's family)."""
    worst = registry.worst()
    if worst is None:
        return resident, ""
    m = worst.memory
    return resident + m.temp + m.output - m.alias, worst.family
