"""The memory maps a process may hold, and a clear error before compiling past them.

XLA:CPU loads every compiled program through LLVM's JIT, which maps each kernel's code, read-
only data and data separately: tens of maps for a tiny program, hundreds for a transformer
step (BENCHMARKS.md, "Headline: four schedules on a long-tail workload"). Linux caps a
process's maps at ``vm.max_map_count`` (65,530 by default), and a run that compiles past it
does not fail cleanly: LLVM prints ``Cannot allocate memory`` and the process segfaults, with
memory to spare. The warm-up checks the count after each shape it compiles and stops with
``HostLimitError`` (naming the limit and the fix) while there is still room to exit cleanly.

Nothing here applies where ``/proc`` is absent (macOS) or on backends whose programs live on
the device; there the functions report ``None`` and check nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from oppo_jax.base.errors import HostLimitError

MAPS_LIMIT = Path("/proc/sys/vm/max_map_count")
OWN_MAPS = Path("/proc/self/maps")
STOP_FRACTION = 0.95  # stop here: the next programs' maps must still fit, and an exit needs a few
CHECK_ENV = "OPPO_JAX_MAPS_CHECK"  # off: never stop (the test suite's long-lived workers hold
# every module's programs at once, which no run does; tests/test_host_maps.py turns it on)


def map_usage() -> tuple[int, int] | None:
    """(maps this process holds, the kernel's limit), or None where Linux's /proc is absent."""
    try:
        limit = int(MAPS_LIMIT.read_text())
        used = OWN_MAPS.read_bytes().count(b"\n")
    except (OSError, ValueError):
        return None
    return used, limit


def check_map_room(what: str, usage: tuple[int, int] | None = None) -> None:
    """Raise ``HostLimitError`` once the process holds ``STOP_FRACTION`` of its maps limit.

    ``what`` names the work that was compiling (for the message); ``usage`` defaults to this
    process's own ``map_usage()``."""
    if os.environ.get(CHECK_ENV, "on").strip().lower() == "off":
        return
    usage = map_usage() if usage is None else usage
    if usage is None:
        return
    used, limit = usage
    if used < STOP_FRACTION * limit:
        return
    raise HostLimitError(
        f"this process holds {used:,} memory maps of the kernel's limit vm.max_map_count = "
        f"{limit:,} after compiling {what}: XLA:CPU maps every compiled program's code "
        "separately, and past the limit LLVM fails ('Cannot allocate memory') and the process "
        "crashes. Raise the limit (sudo sysctl -w vm.max_map_count=262144) or compile fewer "
        "shapes (fewer pipeline.chunk_candidates, pipeline.compact_slots=false)"
    )
