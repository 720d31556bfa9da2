"""Where a run's programs are compiled for: this host, or a TPU slice or GPU nodes it does not
have, described to their real compilers ahead of time (``jax.experimental.topologies``).

Names: ``host``; ``tpu-v5p[:AxBxC]`` (likewise ``tpu-v6e``, ``tpu-v5e``, ``tpu-v4`` with their
chip grids); ``h100[:SxHxG]``, ``h200[...]``, ``gh200[...]`` (slices x hosts x GPUs per host).
Without a topology a target takes the smallest one holding the devices a run asks for.

The TPU compiler runs with libtpu installed (``pip install -e '.[tpu-aot]'``); the GPU compiler
with the CUDA plugin and ptxas (``'.[gpu-aot]'``), from a GPU target description: OpenXLA's
H100 and H200 specs and a GH200 one derived from the H100's (same die; HBM size and
bandwidth changed, approximate), in ``gpu_targets/``. Neither needs the device: the programs
are compiled, never run. The CUDA plugin registers only if JAX starts with
``JAX_PLATFORMS=cpu`` (or ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``) on a host without a driver;
``oppo-jax`` sets it for its compile verbs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import os
import pathlib
import re

import jax

GIB = 1 << 30
_GPU_SPECS = pathlib.Path(__file__).with_name("gpu_targets")
# HBM per device: GPUs from their target description (device_memory_size); TPU chips as the
# TPU compiler reports them when a program exceeds them (v5p: "available HBM (95.74G)") or,
# where no such report was seen here, the chip's published size.
_TPU_HBM = {"v5p": int(95.74 * GIB), "v6e": 32 * GIB, "v5e": 16 * GIB, "v4": 32 * GIB}
_TPU_GRIDS = {  # chip grids of the slices a TPU target picks from, smallest first
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"),
    "v6e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
}
_GPU_FILES = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "gh200": "gh200_96gb.txtpb"}
_GPUS_PER_HOST = {"h100": 8, "h200": 8, "gh200": 1}  # an HGX node's 8, a GH200 node's 1
_NAME = re.compile(r"^(host|cpu|tpu-(v5p|v6e|v5e|v4)|h100|h200|gh200)(?::(\d+(?:x\d+)+))?$")
TARGET_NAMES = ("host", "tpu-v5p", "tpu-v6e", "tpu-v5e", "tpu-v4", "h100", "h200", "gh200")


class TargetError(ValueError):
    """A target name this module cannot describe, or a compiler that is not installed."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: ``platform`` "cpu" | "tpu" | "gpu", and its topology if given."""

    name: str  # as written, e.g. "tpu-v5p:2x2x1"
    platform: str
    kind: str  # "host", a TPU generation ("v5p") or a GPU ("gh200")
    topology: str | None = None  # chip grid (TPU) or slices x hosts x GPUs (GPU); None: fitted

    @classmethod
    def parse(cls, name: str) -> Target:
        match = _NAME.match(name.strip().lower())
        if match is None:
            raise TargetError(
                f"unknown compile target {name!r}; expected one of {', '.join(TARGET_NAMES)}, "
                "optionally with a topology (tpu-v5p:2x2x2, h100:1x2x8)"
            )
        base, generation, topology = match.groups()
        if base in ("host", "cpu"):
            return cls(name, jax.default_backend(), "host", None)
        if generation is not None:
            return cls(name, "tpu", generation, topology)
        return cls(name, "gpu", base, topology)

    @property
    def deviceless(self) -> bool:
        return self.kind != "host"

    @property
    def hbm_bytes(self) -> int | None:
        """Memory per device (None for the host, whose limit is not one number)."""
        if self.platform == "tpu":
            return _TPU_HBM[self.kind]
        if self.platform == "gpu" and self.kind in _GPU_FILES:
            spec = _gpu_spec(self.kind)
            return int(re.search(r"device_memory_size: (\d+)", spec).group(1))
        return None

    @property
    def compiler(self) -> str:
        """The compiler and its version, e.g. "XLA:TPU (libtpu 0.0.42.1, jaxlib 0.10.2)"."""
        jaxlib = f"jaxlib {_version('jaxlib')}"
        if self.platform == "tpu":
            return f"XLA:TPU (libtpu {_version('libtpu')}, {jaxlib})"
        if self.platform == "gpu" and self.deviceless:
            plugin = _version("jax-cuda12-plugin")
            return f"XLA:GPU sm_90a (jax-cuda12-plugin {plugin}, {jaxlib})"
        return f"XLA:{self.platform.upper()} ({jaxlib})"

    @property
    def compile_options(self) -> dict:
        """XLA options every program of this target compiles with: a deviceless GPU compile
        cannot size CUB's sort scratch, so sorts (top-k/top-p over the vocabulary) use XLA's."""
        if self.platform == "gpu" and self.deviceless:
            return {"xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED"}
        return {}

    def devices(self, count: int) -> list:
        """``count`` devices of this target: the host's, or the first of its topology."""
        if not self.deviceless:
            devices = jax.devices()
            if len(devices) < count:
                raise TargetError(
                    f"the run needs {count} devices and this host has {len(devices)} (on a CPU: "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={count})"
                )
            return devices[:count]
        topology = self.topology or self._fitted(count)
        devices = list(_topology(self.platform, self.kind, topology).devices)
        if len(devices) < count:
            raise TargetError(f"{self.kind}:{topology} has {len(devices)} devices, not {count}")
        return devices[:count]

    def _fitted(self, count: int) -> str:
        if self.platform == "gpu":
            per_host = _GPUS_PER_HOST[self.kind]
            if count <= per_host:
                return f"1x1x{count}"
            return f"1x{math.ceil(count / per_host)}x{per_host}"
        for grid in _TPU_GRIDS[self.kind]:
            if math.prod(map(int, grid.split("x"))) >= count:
                return grid
        raise TargetError(f"no {self.kind} slice here holds {count} chips")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def _gpu_spec(kind: str) -> str:
    return (_GPU_SPECS / _GPU_FILES[kind]).read_text()


@functools.cache
def _topology(platform: str, kind: str, topology: str):
    """The compile-only devices of a topology (one description per process and name)."""
    from jax.experimental import topologies

    try:
        if platform == "tpu":
            # Compile-only: no chip is opened, so any number of processes may load libtpu
            # (its lockfile would otherwise hold it to one process at a time).
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            kwargs = {}
            if math.prod(map(int, topology.split("x"))) == 1:  # one chip needs its host bounds
                kwargs["chips_per_host_bounds"] = (1, 1, 1)
            return topologies.get_topology_desc(
                topology_name=f"{kind}:{topology}", platform="tpu", **kwargs
            )
        return topologies.get_topology_desc(
            platform="cuda", topology=topology, target_config=_gpu_spec(kind)
        )
    except Exception as err:
        extra = "tpu-aot" if platform == "tpu" else "gpu-aot"
        hint = (
            "; the CUDA plugin registers only when JAX starts with JAX_PLATFORMS=cpu "
            "(or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) on a host without a driver"
            if platform == "gpu"
            else "; one process at a time holds libtpu"
        )
        raise TargetError(
            f"cannot describe {kind}:{topology} to the {platform.upper()} compiler ({err}); "
            f"install it with pip install -e '.[{extra}]'{hint}"
        ) from err
