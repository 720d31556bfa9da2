"""Trust in a custom attention kernel is earned on each backend: before its first use in a
process, the kernel runs once at a small shape on that backend and is compared with XLA's
attention; if it fails to compile, raises or disagrees, the run says so in one line on stderr
and every call it would have served runs on XLA instead (``models.attention``).

Lowering a Pallas kernel for a device checks shapes and types, not results, speed or the
device compiler's limits; a kernel that only ever ran in the interpreter is checked here the
first time it meets its real device. The fallback changes the implementation, never the
programs' shapes: a run's compile plan is the same either way.

Kernels: ``ragged_decode`` (``models.ragged_decode``: a decode step reading each row's own
keys) and ``segment`` (``models.segment_attention``: causal attention within packed rows).
"""

from __future__ import annotations

import concurrent.futures
import sys

import jax
import jax.numpy as jnp
import numpy as np

import oppo_jax.models.platform as platform
import oppo_jax.models.ragged_decode as ragged_decode_kernel
import oppo_jax.models.segment_attention as segment_kernel
from oppo_jax.models.query_blocks import attention as xla_attention

TOLERANCE = 2e-3  # float32 heads at the check's small shape; a wrong kernel is off by O(1)
_results: dict[tuple[str, str], bool] = {}  # (kernel, backend) -> trusted


def trusted(kernel: str, backend: str | None = None) -> bool:
    """Whether ``kernel`` ("ragged_decode" | "segment") may run on ``backend`` (default:
    JAX's): its check's result, the check run now if this process has not run it yet."""
    if platform.deviceless():  # compiled for a target absent here: checked on first use there
        return True
    backend = backend or platform.current()
    key = (kernel, backend)
    if key not in _results:
        _results[key] = _check(kernel, backend)
    return _results[key]


def checked() -> dict[str, bool]:
    """Every check this process ran: "kernel on backend" -> trusted."""
    return {f"{k} on {b}": ok for (k, b), ok in sorted(_results.items())}


def _check(kernel: str, backend: str) -> bool:
    """Run ``kernel``'s case on ``backend`` and compare it with XLA's. On a thread of its own:
    JAX's trace and mesh contexts are per thread, so a check asked for while a model is traced
    (the first call that would use the kernel) runs eagerly, outside that trace."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        error = pool.submit(_max_error, kernel).result()
    if isinstance(error, Exception):  # a compile error, a lowering limit: not for here
        _warn(kernel, backend, f"failed with {type(error).__name__}: {_first_line(error)}")
        return False
    if not error <= TOLERANCE:  # NaN included
        _warn(kernel, backend, f"differs from XLA by {error:.2e} (> {TOLERANCE})")
        return False
    return True


def _max_error(kernel: str) -> float | Exception:
    try:
        got, want = jax.jit(CASES[kernel])()  # one program, run now
        return float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    except Exception as e:  # returned, so the caller reports it in its one line
        return e


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def _warn(kernel: str, backend: str, why: str) -> None:
    print(
        f"oppo-jax: warning: the {kernel} attention kernel {why} on {backend}; "
        "its calls run on XLA's attention instead",
        file=sys.stderr,
        flush=True,
    )


def _ragged_decode_case():
    """Two rows over a cache of 32 columns, 4 query heads on 2 kv heads, lengths 5 and 32."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 1, 4, 16), jnp.float32)
    k_cache = jax.random.normal(keys[1], (1, 2, 2, 32, 16), jnp.float32)
    v_cache = jax.random.normal(keys[2], (1, 2, 2, 32, 16), jnp.float32)
    lengths = jnp.array([5, 32], jnp.int32)
    layer = jnp.int32(0)
    got = ragged_decode_kernel.ragged_decode_attention(q, k_cache, v_cache, layer, lengths, 32)
    k, v = (jnp.swapaxes(c[0], 1, 2) for c in (k_cache, v_cache))  # [S, Tc, K, Dh]
    mask = (jnp.arange(32)[None, :] < lengths[:, None])[:, None, None, :]
    return got, xla_attention(q, k, v, mask, causal=False)


def _segment_case():
    """One row of 32 tokens: segments of 10 and 15 tokens, then 7 of padding (-1)."""
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (1, 32, 4, 16), jnp.float32)
    k = jax.random.normal(keys[1], (1, 32, 2, 16), jnp.float32)
    v = jax.random.normal(keys[2], (1, 32, 2, 16), jnp.float32)
    segments = jnp.array([[0] * 10 + [1] * 15 + [-1] * 7], jnp.int32)
    got = segment_kernel.segment_attention(q, k, v, segments, block=16)
    same = segments[:, None, :, None] == segments[:, None, None, :]
    want = xla_attention(q, k, v, same, causal=True)
    real = (segments >= 0)[..., None, None]  # padding's output is read by nothing
    return jnp.where(real, got, 0.0), jnp.where(real, want, 0.0)


CASES = {"ragged_decode": _ragged_decode_case, "segment": _segment_case}
