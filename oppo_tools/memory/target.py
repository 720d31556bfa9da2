"""Which compiler the memory report lowers its kernels for (``oppo_jax.parallel.targets``):
XLA:CPU on fake devices ("cpu", the host), or a TPU's or GPU's own compiler on a deviceless
topology (ahead of time, on any host with the target's compiler installed).

XLA:CPU computes bfloat16 arithmetic in float32: it converts a bf16 model's stacked weights
and KV caches to float32 copies (hoisted out of the layer loop, so all layers at once), and
those copies dominate a bf16 kernel's temporaries; its numbers are upper bounds, a fallback
for hosts without the target's compiler. A TPU's or GPU's compiler keeps bf16 native, so the
same program compiled for its topology gives the bytes the device holds; the program is
compiled, never run.
"""

from __future__ import annotations

import math

from oppo_jax.parallel.sharding import make_mesh
from oppo_jax.parallel.targets import TARGET_NAMES, Target, TargetError

TARGETS = ("cpu", *TARGET_NAMES)
CPU_NOTE = (
    "CPU upper bound: lowered for the CPU backend on fake devices (XLA:CPU computes bf16 in "
    "f32, so kernel temporaries of a bf16 model are upper bounds; state bytes keep their "
    "dtypes)"
)


def target_note(target: str) -> str:
    """What the kernels' numbers mean when lowered for ``target``."""
    described = Target.parse(target)
    if not described.deviceless and described.platform == "cpu":
        return CPU_NOTE
    return (
        f"compiled ahead of time by {described.compiler} for {target} (deviceless topology): "
        "bf16 stays bf16, so kernel temporaries are what the device holds"
    )


def target_devices(target: str, count: int) -> list:
    """``count`` devices to lower for on ``target`` (one of ``TARGETS``, with a topology or
    not: ``parallel.targets``)."""
    try:
        return Target.parse(target).devices(count)
    except TargetError as err:
        raise ValueError(f"memory target {target!r}: {err}") from err


def target_meshes(mesh_shape, scoring_shape, target: str = "cpu"):
    """(training/generation mesh, scoring mesh) on ``target``'s devices (fake CPU ones, or a
    deviceless topology); the scoring mesh is the same one when ``scoring_shape`` is None
    (colocated), else on the devices after it."""
    n, extra = math.prod(mesh_shape), math.prod(scoring_shape or (0,))
    devices = target_devices(target, n + extra)
    mesh = make_mesh(*mesh_shape, devices[:n])
    return mesh, mesh if scoring_shape is None else make_mesh(
        *scoring_shape, devices[n : n + extra]
    )
