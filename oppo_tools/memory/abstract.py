"""Abstract inputs of the memory report: ShapeDtypeStruct trees carrying the run's shardings,
one kernel's bytes from XLA's memory analysis, and what a step holds beside it. Nothing is
allocated."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from oppo_jax.models.kv_cache import init_cache
from oppo_jax.models.model_config import ModelConfig, preset
from oppo_jax.parallel.sharding import abstract_params, param_shardings, slot_shardings
from oppo_jax.pipeline.program_walk import shape_checks_off
from oppo_jax.pipeline.registry import ProgramMemory
from oppo_jax.ppo.batch import PPOBatch
from oppo_jax.ppo.update import batch_shardings
from oppo_jax.rollout.refill import PromptStore

# The resident entry of a refilling run's prompt stores, among the KV caches
PROMPT_STORES = "actor prompt stores"


@dataclasses.dataclass(frozen=True)
class KernelMemory(ProgramMemory):
    """One device's bytes of a compiled kernel (``registry.ProgramMemory``: arguments,
    outputs, aliased, temporaries, host), extrapolated in depth where asked."""

    def extrapolate(self, one_more: KernelMemory, extra_layers: int) -> KernelMemory:
        """Linear in depth, from ``self`` and ``one_more`` (the same kernel one layer deeper)."""
        names = [f.name for f in dataclasses.fields(self)]
        return KernelMemory(
            **{
                n: getattr(self, n) + extra_layers * (getattr(one_more, n) - getattr(self, n))
                for n in names
            }
        )


def abstract_tree(tree, shardings):
    """``tree``'s leaves as ShapeDtypeStructs carrying ``shardings`` (a list in leaf order, or
    a tree of shardings matching ``tree``)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not isinstance(shardings, list):
        shardings = jax.tree.leaves(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
    out = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip(leaves, shardings, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def on_slots(tree, mesh):
    """``tree`` (abstract) laid out like the rollout state: slots over data x fsdp."""
    return abstract_tree(tree, slot_shardings(tree, mesh))


def abstract_model_params(cfg: ModelConfig, mesh):
    return abstract_tree(abstract_params(cfg), param_shardings(cfg, mesh))


def sds(shape, dtype, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def shaped(cls, *fields, **static):
    """``cls(*arrays, **static)`` with a ShapeDtypeStruct per (shape, dtype) of ``fields``."""
    return cls(*(jax.ShapeDtypeStruct(s, d) for s, d in fields), **static)


def abstract_ppo_batch(rows: int, prompt: int, response: int, mesh) -> PPOBatch:
    """A PPOBatch of ShapeDtypeStructs for ``rows`` sequences, sharded as the update takes it."""
    shapes = {f.name: ((rows, response), jnp.float32) for f in dataclasses.fields(PPOBatch)}
    shapes.update(
        tokens=((rows, prompt + response), jnp.int32),
        prompt_len=((rows,), jnp.int32),
        mask=((rows, response), jnp.bool_),
        scores=((rows,), jnp.float32),
    )
    sh = batch_shardings(mesh)
    return PPOBatch(**{n: sds(*s, getattr(sh, n)) for n, s in shapes.items()})


def model_config(model: ModelConfig | str, head: str) -> ModelConfig:
    """``model`` itself, or the preset it names with ``head``."""
    return preset(model, head=head) if isinstance(model, str) else model


def abstract_prompt_store(cfg: ModelConfig, rows: int, width: int) -> PromptStore:
    """A refilling run's prompt store of ``rows`` prompts in caches of ``width`` columns
    (``rollout.refill.prefill_store``), abstract."""

    def store():
        logits = jnp.zeros((rows, cfg.head_out), jnp.float32)
        return PromptStore(init_cache(cfg, rows, width), logits, jnp.zeros((rows,), jnp.int32))

    with shape_checks_off():  # the dataclass's checks take no ShapeDtypeStruct
        return jax.eval_shape(store)


def live_during(kernel: str, resident: int, caches: dict, kept_fraction: float) -> int:
    """Bytes a step holds on a device while ``kernel`` runs, in ``pipeline.step``'s order.

    The actor's admission runs before any of this step's KV caches exists (it returns the
    actor's, counted as its output) and the update after the step has dropped all four; both
    see only the frozen scorers' kept rows of carried sequences (at most Δ_max·G of the slots:
    ``kept_fraction`` of the reference's and reward model's caches). The actor's replay of
    carried prefixes runs on its admitted cache (donated in and out) beside those kept rows.
    Decode and scorer chunks run with every cache resident (a cache per model the run has).
    A refilling run (its ``PROMPT_STORES`` among the caches) keeps its rows in flight and a
    store of waiting prompts through the update (``pipeline.refill_step``): the actor's cache
    and the stores stay.
    """
    if kernel not in ("update", "admission", "replay"):
        return resident
    kept = kept_fraction * (caches.get("reference", 0) + caches.get("reward", 0))
    own = caches["actor"] if kernel == "replay" else 0
    if PROMPT_STORES in caches:
        own = caches["actor"] + caches[PROMPT_STORES]
    return resident - sum(caches.values()) + int(kept) + own


def warmup_peak(state: dict, kernels: dict) -> dict:
    """The warm-up's peak per device: its throwaway step runs the step's kernels on the train
    state itself, the trained part parked in host memory meanwhile (one process: the step's
    own peak), or on a device copy of what the update replaces (several processes: trained
    parameters and device optimizer states on top; ``pipeline.warmup._throwaway_step``)."""
    copy = state["actor_params"] + state["critic_params"] + state["optimizer"]
    worst = lambda field: max((k[field] for k in kernels.values()), default=0)  # noqa: E731
    return {
        "trained_copy": copy,
        "with_resident": worst("with_resident"),
        "with_live": worst("with_live"),
        "with_resident_multiprocess": worst("with_resident") + copy,
    }


def update_shape(packed) -> dict:
    """The packed update's (Rp, W, N) and chunks per minibatch K (None, 0: the padded one)."""
    shape, chunks = packed or (None, 0)
    return {"packed_update": shape, "packed_update_chunks": chunks}


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


def bytes_by_memory(tree, shardings) -> tuple[int, int]:
    """(device bytes, host bytes) per device of ``tree`` laid out as ``shardings``."""
    leaves = jax.tree.leaves(tree)
    shs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    host = [(x, sh) for x, sh in zip(leaves, shs, strict=True) if sh.memory_kind == "pinned_host"]
    on_host = per_device_bytes([x for x, _ in host], [sh for _, sh in host]) if host else 0
    return per_device_bytes(leaves, shs) - on_host, on_host


def describe_model(cfg) -> dict:
    """What the report prints of a model: size, depth, head, dtypes, LoRA rank, remat."""
    return {
        "params": cfg.num_params(),
        "layers": cfg.num_layers,
        "head": cfg.head,
        "param_dtype": cfg.param_dtype,
        "lora_rank": cfg.lora_rank,
        "dtype": cfg.dtype,
        "remat": cfg.remat,
    }
