"""What the update's non-finite guard reads and returns: whether a tree is free of NaN and
Inf, and the NaN or zero stand-ins of a microbatch's gradients and metrics when its models do
not run (a non-finite batch; a packed chunk that holds no sequence)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def all_finite(tree) -> jax.Array:
    """True when every floating-point leaf of ``tree`` is free of NaN and Inf."""
    checks = [
        jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.stack(checks).all() if checks else jnp.bool_(True)


def nan_like(shapes):
    """NaN arrays of ``shapes`` (a tree of ShapeDtypeStructs)."""
    return jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shapes)


def zeros_like(shapes):
    """Zero arrays of ``shapes`` (a tree of ShapeDtypeStructs)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
