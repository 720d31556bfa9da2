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

import oppo_jax.models.platform as platform
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
        # Stacked layer parameters (the model scans over layers): each device holds all layers.
        ("layers", None),
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


@contextlib.contextmanager
def tracing_rules(mesh: Mesh | None, rules: ShardingRules = DEFAULT_RULES) -> Iterator[None]:
    """While tracing a jitted kernel: make the model's ``nn.with_logical_constraint`` act on
    ``mesh`` (a no-op context for None). ``jax.set_mesh`` is refused inside jit; flax reads the
    abstract mesh, and explicit NamedShardings carry the concrete one. Kernel choices follow
    the mesh's platform (``models.platform``)."""
    if mesh is None:
        yield
        return
    abstract = jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
    with abstract, nn.logical_axis_rules(rules.rules), platform.tracing_for(mesh):
        yield


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


def placed_on(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
    """For ``load_hf_model(placement=...)``: given a model's config, a function that puts each
    parameter read from disk straight onto its ``param_shardings`` over ``mesh``, so loading
    never gathers a whole model on one device first."""

    def for_config(cfg: ModelConfig):
        flat = jax.tree_util.tree_flatten_with_path(param_shardings(cfg, mesh, rules))[0]
        shardings = {tuple(k.key for k in path): sh for path, sh in flat}
        return lambda path, value: jax.device_put(value, shardings[path])

    return for_config


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


# Logical axes of a KV cache [L, S, K, Tc, Dh] (see oppo_jax/models/kv_cache.py): slots over
# the batch axes, kv-heads over tensor. Every other slot-major rollout array shards its axis 0.
KV_CACHE_AXES = ("layers", "batch", "kv_heads", "length", None)


def batch_shards(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> int:
    """Devices the "batch" logical axis is split over (default: data x fsdp)."""
    return _mesh_size(mesh, rules.spec(("batch",))[0])


def padded_slot_count(num_slots: int, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> int:
    """``num_slots`` rounded up to a multiple of ``batch_shards``, so slots shard evenly.

    Example: data x fsdp = 4: 10 -> 12, 12 -> 12. The extra slots stay inactive (empty).
    """
    n = batch_shards(mesh, rules)
    return -(-num_slots // n) * n


def fitted_sharding(
    mesh: Mesh,
    shape: Sequence[int],
    logical_axes: Sequence[str | None],
    rules: ShardingRules = DEFAULT_RULES,
) -> NamedSharding:
    """``rules.sharding`` for an array of ``shape``, with every dim whose size its mesh axes do
    not divide replicated instead (e.g. 3 kv-heads on tensor=2), silently."""
    spec = list(rules.spec(logical_axes))
    spec += [None] * (len(shape) - len(spec))
    spec = [
        None if size % _mesh_size(mesh, ax) else ax for size, ax in zip(shape, spec, strict=True)
    ]
    return NamedSharding(mesh, PartitionSpec(*spec))


def _is_cache_leaf(path, x) -> bool:
    """True for the keys/values [L, S, K, Tc, Dh] of a KVCache (attributes ``k``/``v``)."""
    last = path[-1] if path else None
    return len(x.shape) == len(KV_CACHE_AXES) and getattr(last, "name", None) in ("k", "v")


def slot_shardings(tree: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> list:
    """Shardings for the leaves of slot-major rollout state (DecodeState, ScorerState, ...),
    as a list in ``jax.tree.leaves(tree)`` order (a flax dataclass cannot hold shardings).

    KV cache keys/values follow ``KV_CACHE_AXES``; every other array of rank >= 1 is split
    along its first (slot) axis as "batch"; scalars are replicated. Leaves may be arrays or
    ShapeDtypeStructs. A slot count that the batch axes do not divide stays replicated.
    """

    def one(path, x):
        if _is_cache_leaf(path, x):
            return fitted_sharding(mesh, x.shape, KV_CACHE_AXES, rules)
        if len(x.shape) == 0:
            return NamedSharding(mesh, PartitionSpec())
        return fitted_sharding(mesh, x.shape, ("batch",), rules)

    return [one(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def constrain_slots(tree: Any, mesh: Mesh | None, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """Inside jit: lay slot-major rollout state out as ``slot_shardings``; identity for None."""
    if mesh is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    laid_out = jax.lax.with_sharding_constraint(leaves, slot_shardings(tree, mesh, rules))
    return jax.tree.unflatten(treedef, laid_out)


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


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value else None


def _cluster_detected() -> bool:
    """True when environment variables say this process is one of several in a job."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("OMPI_MCA_orte_hnp_uri"):
        return True
    if (_env_int("JAX_NUM_PROCESSES") or 1) > 1 or (_env_int("SLURM_NTASKS") or 1) > 1:
        return True
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def multihost_initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    force: bool = False,
) -> bool:
    """Start JAX's multi-controller runtime when running multi-process; returns whether it did.

    Call it before any JAX computation. Arguments left None are read from ``JAX_NUM_PROCESSES``
    and ``JAX_PROCESS_ID`` (jax itself reads ``JAX_COORDINATOR_ADDRESS``), else auto-detected by
    ``jax.distributed.initialize`` (SLURM, Open MPI, Cloud TPU pods, GKE). A single process
    (``num_processes == 1``, or no coordinator and no SLURM/Open MPI/TPU-pod/JAX_* cluster
    variables) is left alone unless ``force`` (the config's ``mesh.multihost``), so laptops and
    one-host runs need no set-up. Nothing home-made sits on top of ``jax.distributed``.
    """
    if jax.distributed.is_initialized():
        return False
    if num_processes is None:
        num_processes = _env_int("JAX_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("JAX_PROCESS_ID")
    if num_processes == 1:
        return False
    unset = num_processes is None and coordinator_address is None
    if unset and not force and not _cluster_detected():
        return False
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    return True


def to_host(tree):
    """The global values of ``tree``'s arrays as NumPy, on every process.

    A plain read where this process holds the whole value (one process, or a replicated
    array); an all-gather where the array is sharded over devices of other processes
    (multi-host runs shard the rollout's slots), which every process must then call alike.
    """
    from jax.experimental import multihost_utils

    def local(x) -> bool:
        return not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated

    leaves, treedef = jax.tree.flatten(tree)
    # One device_get of every local leaf: their copies start together (the decode loop reads
    # a chunk's flag and counts this way, once per chunk).
    read = iter(jax.device_get([x for x in leaves if local(x)]))
    out = []
    for x in leaves:
        if local(x):
            out.append(np.asarray(next(read)))
        else:
            out.append(np.asarray(multihost_utils.process_allgather(x, tiled=True)))
    return jax.tree.unflatten(treedef, out)
