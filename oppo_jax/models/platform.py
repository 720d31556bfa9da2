"""The platform a kernel is traced for: that of the mesh it is traced under, else JAX's
default backend. Kernel choices (the attention kernel, a Pallas kernel's lowering) ask here,
so a program compiled ahead of time for a TPU or a GPU this host does not have
(``parallel.targets``) holds that target's kernels, not the host's.

A mesh of compile-only devices (a deviceless target) is ``deviceless``: nothing can run on
it, so a custom kernel's self-check (``models.kernel_check``) waits for its first use on a
real device.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

# (platform, deviceless) of the mesh being traced under; None outside ``tracing_for``
_TRACED: contextvars.ContextVar[tuple[str, bool] | None] = contextvars.ContextVar(
    "oppo_jax_traced_platform", default=None
)


def _runnable(device) -> bool:
    """Whether ``device`` belongs to a client of this process (not a compile-only topology)."""
    try:
        return device in jax.devices(device.platform)
    except RuntimeError:  # no backend of that platform here: a deviceless target's device
        return False


@contextlib.contextmanager
def tracing_for(mesh) -> Iterator[None]:
    """While tracing a kernel over ``mesh`` (a ``jax.sharding.Mesh``): its devices' platform
    is ``current()``."""
    device = mesh.devices.flat[0]
    token = _TRACED.set((device.platform, not _runnable(device)))
    try:
        yield
    finally:
        _TRACED.reset(token)


def current() -> str:
    """ "cpu", "gpu" or "tpu": the traced mesh's platform, else JAX's default backend."""
    traced = _TRACED.get()
    return jax.default_backend() if traced is None else traced[0]


def deviceless() -> bool:
    """Whether the kernel being traced compiles for devices this process cannot run on."""
    traced = _TRACED.get()
    return traced is not None and traced[1]
