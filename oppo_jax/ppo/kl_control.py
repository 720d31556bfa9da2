"""KL coefficient controllers: fixed, and adaptive (Ziegler et al. 2019, as in TRL)."""

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Both controllers set `__no_type_check__` so jaxtyping skips checking their __init__ only:
# pytree transforms (tree.map to shardings or shapes) rebuild them with non-array leaves.
# Their methods are still checked.


@flax.struct.dataclass
class FixedKLController:
    """Constant KL coefficient β; `update` returns the controller unchanged."""

    __no_type_check__ = True
    value: jax.Array  # β, float32 scalar

    def update(
        self, current_kl: float | Float[Array, ""], n_steps: int | Int[Array, ""]
    ) -> "FixedKLController":
        """Return self: a fixed coefficient ignores the measured KL."""
        del current_kl, n_steps
        return self


@flax.struct.dataclass
class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards `target`.

    e = clip(KL / target − 1, −0.2, 0.2)
    β ← β · (1 + e · n_steps / horizon)
    """

    __no_type_check__ = True
    value: jax.Array  # β, float32 scalar
    target: float = flax.struct.field(pytree_node=False)  # target KL per sequence, nats
    horizon: float = flax.struct.field(pytree_node=False)  # samples over which β adapts fully

    def update(
        self, current_kl: float | Float[Array, ""], n_steps: int | Int[Array, ""]
    ) -> "AdaptiveKLController":
        """Return the controller with β scaled by 1 + clip(KL/target − 1, ±0.2) · n/horizon."""
        error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / self.target - 1.0, -0.2, 0.2)
        mult = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / self.horizon
        return self.replace(value=self.value * mult)


def make_kl_controller(
    kl_coef: float,
    adaptive: bool = False,
    target_kl: float | None = None,
    horizon: int | float = 10000,
) -> FixedKLController | AdaptiveKLController:
    """Build a fixed controller, or an adaptive one starting at `kl_coef` (needs `target_kl`)."""
    value = jnp.asarray(kl_coef, jnp.float32)
    if not adaptive:
        return FixedKLController(value=value)
    if target_kl is None or target_kl <= 0:
        raise ValueError(f"adaptive KL control needs target_kl > 0, got {target_kl!r}")
    if horizon <= 0:
        raise ValueError(f"adaptive KL control needs horizon > 0, got {horizon!r}")
    return AdaptiveKLController(value=value, target=float(target_kl), horizon=float(horizon))
