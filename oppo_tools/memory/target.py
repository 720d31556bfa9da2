"""Which compiler the memory report lowers its kernels for: XLA:CPU on fake devices, or the TPU
compiler on a deviceless TPU v5p topology (ahead-of-time, on any host with ``libtpu``).

XLA:CPU computes bfloat16 arithmetic in float32: it converts a bf16 model's stacked weights
and KV caches to float32 copies (hoisted out of the layer loop, so all layers at once), and
those copies dominate a bf16 kernel's temporaries; its numbers are upper bounds. The TPU
compiler keeps bf16 native, so the same program compiled for a v5p topology gives the bytes a
bf16 accelerator holds. ``jax.experimental.topologies`` describes the chips without any being
present; the program is compiled, never run.
"""

from __future__ import annotations

import math

import jax

from oppo_jax.parallel.sharding import make_mesh

TARGETS = ("cpu", "tpu-v5p")
CPU_NOTE = (
    "lowered for the CPU backend on fake devices: XLA:CPU computes bf16 in f32, so kernel "
    "temporaries of a bf16 model are upper bounds; state bytes keep their dtypes"
)
TPU_NOTE = (
    "compiled ahead of time for TPU v5p (deviceless topology, libtpu): bf16 stays bf16, so "
    "kernel temporaries are what a v5p chip holds; a GPU's compiler fuses and schedules "
    "differently"
)
# Smallest v5p slice holding n chips: (topology name, chips); one host holds 2x2x1.
_V5P_TOPOLOGIES = (("v5p:2x2x1", 4), ("v5p:2x2x2", 8), ("v5p:2x2x4", 16))


def target_note(target: str) -> str:
    """What the kernels' numbers mean when lowered for ``target``."""
    return CPU_NOTE if target == "cpu" else TPU_NOTE


def target_devices(target: str, count: int) -> list:
    """``count`` devices to lower for on ``target`` (one of ``TARGETS``)."""
    if target == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < count:
            raise RuntimeError(
                f"the memory report lowers on {count} CPU devices but this process has "
                f"{len(devices)}: call jax.config.update('jax_num_cpu_devices', {count}) (or "
                f"set XLA_FLAGS=--xla_force_host_platform_device_count={count}) before JAX "
                "starts"
            )
        return devices[:count]
    if target != "tpu-v5p":
        raise ValueError(f"unknown memory target {target!r}; expected one of {TARGETS}")
    return _v5p_devices(count)


def _v5p_devices(count: int) -> list:
    """The first ``count`` chips of the smallest v5p topology that has them (compile only)."""
    from jax.experimental import topologies  # needs libtpu only when this target is asked for

    for name, chips in _V5P_TOPOLOGIES:
        if chips >= count:
            try:
                topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
            except Exception as err:  # no libtpu (or another process holds its lock)
                raise RuntimeError(
                    f"--target tpu-v5p could not describe a v5p topology ({err}); it compiles "
                    "with libtpu: pip install --target DIR 'libtpu==0.0.42.*' (the version "
                    "jax[tpu] pins) and put DIR on PYTHONPATH; one process at a time"
                ) from err
            return list(topology.devices)[:count]
    raise ValueError(f"no v5p topology here holds {count} chips")


def target_meshes(mesh_shape, scoring_shape, target: str = "cpu"):
    """(training/generation mesh, scoring mesh) on ``target``'s devices (fake CPU ones, or a
    deviceless TPU topology); the scoring mesh is the same one when ``scoring_shape`` is None
    (colocated), else on the devices after it."""
    n, extra = math.prod(mesh_shape), math.prod(scoring_shape or (0,))
    devices = target_devices(target, n + extra)
    mesh = make_mesh(*mesh_shape, devices[:n])
    return mesh, mesh if scoring_shape is None else make_mesh(
        *scoring_shape, devices[n : n + extra]
    )
