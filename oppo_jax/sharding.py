"""Device mesh, the one logical-axis-to-mesh rules object, sharded init and device groups for roles.

Mesh axes are ("data", "fsdp", "tensor"). Model code names logical axes only ("batch", "embed",
"heads", ...); everything that knows about the mesh goes through ``ShardingRules``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import init_params

MESH_AXES = ("data", "fsdp", "tensor")

Placement = Literal["colocated", "disaggregated"]

MeshAxes = str | tuple[str, ...] | None


def make_mesh(data: int, fsdp: int, tensor: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh of shape (data, fsdp, tensor) over ``devices``."""
    devices = list(jax.devices() if devices is None else devices)
    if data * fsdp * tensor != len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {data * fsdp * tensor} "
            f"does not match the {len(devices)} devices available"
        )
    # Device order is kept as given: tensor (the innermost axis) then lands on neighbouring
    # devices, which on one host are the best-connected ones. Auto axis types keep jit's
    # sharding propagation (not sharding-in-types), which is what the logical rules assume.
    grid = np.array(devices, dtype=object).reshape(data, fsdp, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Ordered (logical axis name, mesh axes) pairs; earlier pairs win a contested mesh axis."""

    rules: tuple[tuple[str, MeshAxes], ...] = (
        ("batch", ("data", "fsdp")),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
        ("length", None),
        ("norm", None),
    )

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """Mesh PartitionSpec for an array whose dims carry ``logical_axes`` (flax's priority)."""
        return nn.logical_to_mesh_axes(tuple(logical_axes), self.rules)

    def sharding(self, mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
        """NamedSharding on ``mesh`` for an array whose dims carry ``logical_axes``."""
        return NamedSharding(mesh, self.spec(logical_axes))

    @contextlib.contextmanager
    def context(self, mesh: Mesh) -> Iterator[Mesh]:
        """Activate ``mesh`` and these rules so ``nn.with_logical_constraint`` takes effect.

        flax 0.12 only constrains when ``jax.sharding.get_abstract_mesh()`` is non-empty, which
        ``jax.set_mesh`` provides; the legacy ``with mesh:`` does not (it leaves it empty).
        """
        with jax.set_mesh(mesh), nn.logical_axis_rules(self.rules):
            yield mesh


DEFAULT_RULES = ShardingRules()


@functools.lru_cache(maxsize=8)
def _boxed_abstract(cfg: ModelConfig) -> Any:
    """Shapes of the boxed (LogicallyPartitioned) parameters, traced once per config."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    return jax.eval_shape(lambda k: init_params(cfg, k, boxed=True), key)


def _is_boxed(x: Any) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def abstract_params(cfg: ModelConfig) -> Any:
    """ShapeDtypeStruct tree with the structure of ``init_params(cfg, key)``; nothing allocated."""
    return jax.tree.map(lambda b: b.value, _boxed_abstract(cfg), is_leaf=_is_boxed)


def _mesh_size(mesh: Mesh, axes: MeshAxes) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[n] for n in names)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """NamedSharding tree matching ``init_params(cfg, key)``; non-divisible dims are replicated."""

    def one(path, boxed: nn.LogicallyPartitioned) -> NamedSharding:
        spec = list(rules.spec(boxed.names))
        spec += [None] * (len(boxed.value.shape) - len(spec))
        for dim, (size, axes) in enumerate(zip(boxed.value.shape, spec, strict=True)):
            if size % _mesh_size(mesh, axes):
                # Replicating one awkward dim (e.g. an odd vocabulary) beats refusing to run.
                warnings.warn(
                    f"parameter {jax.tree_util.keystr(path)} dim {dim} (size {size}) is not "
                    f"divisible by mesh axis {axes!r} (size {_mesh_size(mesh, axes)}); "
                    "replicating that dim",
                    stacklevel=2,
                )
                spec[dim] = None
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(one, _boxed_abstract(cfg), is_leaf=_is_boxed)


def init_sharded_params(
    cfg: ModelConfig, key: jax.Array, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES
) -> Any:
    """``init_params(cfg, key)`` with every leaf born on its sharding (never built replicated)."""
    shardings = param_shardings(cfg, mesh, rules)
    # A module-level function with a static config lets jax's compile cache hit on repeat calls.
    init = jax.jit(init_params, static_argnums=0, out_shardings=shardings)
    return init(cfg, key)


def batch_sharding(mesh: Mesh, ndim: int, rules: ShardingRules = DEFAULT_RULES) -> NamedSharding:
    """Axis 0 sharded as "batch" (default: over data and fsdp), the other axes replicated."""
    return rules.sharding(mesh, ("batch",) + (None,) * (ndim - 1))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def per_device_bytes(abstract_tree: Any, sharding_tree: Any) -> int:
    """Bytes one device holds of ``abstract_tree`` laid out as ``sharding_tree``; no allocation."""
    leaves = jax.tree.leaves(abstract_tree)
    shardings = jax.tree.leaves(
        sharding_tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    if len(leaves) != len(shardings):
        raise ValueError(f"{len(leaves)} arrays but {len(shardings)} shardings")
    # NamedSharding gives every device an equal shard shape (padding the last when uneven), so
    # the per-device sum is the same on all devices and is also the largest.
    return sum(
        math.prod(s.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize
        for x, s in zip(leaves, shardings, strict=True)
    )


@dataclasses.dataclass(frozen=True)
class DeviceGroups:
    """Meshes for the roles: actor generation, actor/critic training, and scoring consumers."""

    generation: Mesh  # actor decode and prefill
    training: Mesh  # PPO update of actor and critic
    scoring: Mesh  # reward, reference log-probs, critic values
    placement: Placement  # "colocated" (time-sliced on all devices) or "disaggregated"

    def describe(self) -> str:
        """One line per role: its device ids and mesh shape."""
        lines = [f"placement: {self.placement}"]
        for role in ("generation", "training", "scoring"):
            mesh: Mesh = getattr(self, role)
            ids = [d.id for d in mesh.devices.flat]
            shape = " x ".join(f"{n}={s}" for n, s in mesh.shape.items())
            lines.append(f"{role}: devices {ids} ({shape})")
        return "\n".join(lines)


def make_device_groups(
    placement: str,
    data: int,
    fsdp: int,
    tensor: int,
    scoring_devices: int = 1,
    devices: Sequence[Any] | None = None,
) -> DeviceGroups:
    """Carve the role meshes from ``devices`` (DESIGN.md §5); ``scoring_devices`` is only used
    when disaggregated, where the last ones score (data-parallel) and the rest generate/train."""
    devices = list(jax.devices() if devices is None else devices)
    if placement == "colocated":
        mesh = make_mesh(data, fsdp, tensor, devices)
        return DeviceGroups(mesh, mesh, mesh, placement)
    if placement != "disaggregated":
        raise ValueError(f"placement={placement!r}: expected 'colocated' or 'disaggregated'")
    if not 0 < scoring_devices < len(devices):
        raise ValueError(
            f"scoring_devices={scoring_devices} must leave at least one of the "
            f"{len(devices)} devices for generation and training"
        )
    rest, scorers = devices[:-scoring_devices], devices[-scoring_devices:]
    if data * fsdp * tensor != len(rest):
        raise ValueError(
            f"disaggregated: data={data} x fsdp={fsdp} x tensor={tensor} = "
            f"{data * fsdp * tensor} must equal the {len(rest)} generation/training devices "
            f"({len(devices)} devices minus scoring_devices={scoring_devices})"
        )
    # Generation and training share one group: the paper's 7 + 1 split, and it keeps the
    # per-step actor weight copy on the same devices.
    main = make_mesh(data, fsdp, tensor, rest)
    return DeviceGroups(main, main, make_mesh(scoring_devices, 1, 1, scorers), placement)


def _cluster_detected() -> bool:
    """True when environment variables say this process is one of several in a job."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("OMPI_MCA_orte_hnp_uri"):
        return True
    if int(os.environ.get("SLURM_NTASKS", "1") or "1") > 1:
        return True
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def multihost_initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Start JAX's multi-controller runtime when running multi-process; returns whether it did.

    A single process (``num_processes == 1``, or None with no coordinator and no SLURM/Open MPI/
    TPU-pod/JAX_COORDINATOR_ADDRESS environment) is left alone, so laptops and one-GPU runs need no
    set-up. Otherwise this is ``jax.distributed.initialize`` as is (it auto-detects the cluster
    when the arguments are None); nothing home-made sits on top.
    """
    if jax.distributed.is_initialized():
        return False
    if num_processes == 1:
        return False
    if num_processes is None and coordinator_address is None and not _cluster_detected():
        return False
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    return True
