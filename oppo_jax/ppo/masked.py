"""Masked reductions over padded [B, T] token arrays, computed in float32."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

# A mask may be bool, int or float; any nonzero entry marks a valid token.
# A Python float or a traced float32 scalar (e.g. a KL coefficient held in a pytree).
Scalar = float | Float[Array, ""]


def as_bool_mask(mask: Shaped[Array, "*dims"]) -> Shaped[Array, "*dims"]:
    """Return `mask != 0` as a bool array."""
    return mask if mask.dtype == jnp.bool_ else mask != 0


def masked_sum(
    x: Float[Array, "*dims"], mask: Shaped[Array, "*dims"], axis: int | None = None
) -> Float[Array, "..."]:
    """Sum of `x` over valid entries: Σ_i m_i x_i (invalid entries are ignored, even NaN)."""
    return jnp.sum(jnp.where(as_bool_mask(mask), x.astype(jnp.float32), 0.0), axis=axis)


def masked_mean(
    x: Float[Array, "*dims"], mask: Shaped[Array, "*dims"], axis: int | None = None
) -> Float[Array, "..."]:
    """Mean of `x` over valid entries: Σ m x / Σ m; 0 where there is no valid entry.

    TRL divides by the raw count (NaN for an empty mask); we return 0 instead so that an
    all-padding row or minibatch cannot poison a loss.
    """
    count = jnp.sum(as_bool_mask(mask), axis=axis, dtype=jnp.float32)
    return masked_sum(x, mask, axis) / jnp.maximum(count, 1.0)


def masked_var(
    x: Float[Array, "*dims"], mask: Shaped[Array, "*dims"], unbiased: bool = True
) -> Float[Array, ""]:
    """Variance of the valid entries: mean((x - mean)^2) · n / (n - 1) when `unbiased`.

    With n ≤ 1 valid entries the Bessel factor is skipped (TRL raises instead), so the
    result is 0 rather than NaN.
    """
    x = x.astype(jnp.float32)
    centered = x - masked_mean(x, mask)
    var = masked_mean(jnp.square(centered), mask)
    if unbiased:
        n = jnp.sum(as_bool_mask(mask), dtype=jnp.float32)
        var = var * jnp.where(n > 1.0, n / jnp.maximum(n - 1.0, 1.0), 1.0)
    return var


def masked_whiten(
    x: Float[Array, "*dims"], mask: Shaped[Array, "*dims"], shift_mean: bool = True
) -> Float[Array, "*dims"]:
    """Whiten over valid entries: (x - μ) · rsqrt(σ² + 1e-8), plus μ back if not `shift_mean`.

    μ and σ² (unbiased) are taken over all valid entries together, as TRL does. The result
    is 0 wherever `mask` is 0.
    """
    x = x.astype(jnp.float32)
    mean = masked_mean(x, mask)
    whitened = (x - mean) * jax.lax.rsqrt(masked_var(x, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(as_bool_mask(mask), whitened, 0.0)


def last_valid_index(mask: Shaped[Array, "B T"]) -> Int[Array, " B"]:
    """Index of the last valid token in each row; 0 for a row with no valid token.

    Example:
        mask = [[1, 1, 0],
                [1, 1, 1],
                [0, 0, 0]]
        last_valid_index(mask) == [1, 2, 0]

    The empty row's 0 is indistinguishable from "only token 0 is valid"; callers that care
    must check `mask.any(-1)`. Works for any mask, not only right-padded ones.
    """
    positions = jnp.arange(mask.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(as_bool_mask(mask), positions, 0), axis=-1)
