"""LoRA: low-rank adapters on a frozen base, and the trained / frozen split of a parameter tree.

A LoRA-targeted projection computes ``y = x W + b + (alpha / r) (x A) B`` with the base
``kernel`` W [D F] (and ``bias``) frozen and ``lora_a`` A [D r], ``lora_b`` B [r F] trained.
The adapter sits beside the kernel inside the scanned block, so its parameters are stacked on
the "layers" axis like the rest and no merged copy of W is ever built.

One copy of a base serves several models: the adapter is used only when its parameters are in
the tree (``has_variable``), so the same base without the adapter *is* the reference policy (or
the reward model, for a critic started from it). ``split`` cuts a tree into what the optimizer
trains (adapters, and a score head: the critic's value head) and the frozen base; ``combine``
joins them back where parameters are passed to the model (a dict union, no arrays copied).

Dimension letters: D input width, F output width, r adapter rank, L layers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ADAPTER_KEYS = ("lora_a", "lora_b")
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraDense(nn.Module):
    """A Dense layer (same ``kernel``/``bias`` names, so Hugging Face import/export are
    unchanged) plus a rank-r adapter when the tree holds one (or at init)."""

    features: int
    axes: tuple  # logical axes of the kernel, e.g. ("embed", "heads")
    use_bias: bool
    rank: int
    alpha: float
    dtype: Any
    param_dtype: Any
    kernel_init: Any

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(self.kernel_init, self.axes),
            (d, self.features),
            self.param_dtype,
        )
        x = x.astype(self.dtype)
        y = jnp.dot(x, kernel.astype(self.dtype))
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axes[1:]),
                (self.features,),
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        if self.is_initializing() or self.has_variable("params", "lora_a"):
            y = y + self._adapter(x, d)
        return y

    def _adapter(self, x, d: int):
        """(alpha / r) (x A) B; B starts at zero, so a fresh adapter leaves the base unchanged."""
        a = self.param(
            "lora_a",
            nn.with_logical_partitioning(nn.initializers.he_uniform(), (self.axes[0], None)),
            (d, self.rank),
            self.param_dtype,
        )
        b = self.param(
            "lora_b",
            nn.with_logical_partitioning(nn.initializers.zeros, (None, self.axes[1])),
            (self.rank, self.features),
            self.param_dtype,
        )
        low = jnp.dot(x, a.astype(self.dtype))
        return jnp.dot(low, b.astype(self.dtype)) * jnp.asarray(self.alpha / self.rank, self.dtype)


def _is_trained(path: tuple[str, ...], head: str | None) -> bool:
    return path[-1] in ADAPTER_KEYS or path[0] == head


def split(params: dict, cfg) -> tuple[dict, dict | None]:
    """(trained, frozen) parts of a parameter tree (or of a tree of shardings / shapes).

    Without LoRA (``cfg.lora_rank == 0``) everything is trained and frozen is None. With it,
    trained holds the adapters and, for a score-head model (the critic), its head (an LM with
    ``cfg.lora_train_head``: its untied ``lm_head``); frozen holds the rest. Example:
    {"layers": {..."q_proj": {"kernel", "lora_a", "lora_b"}}, "score": ...}
    -> trained {"layers": {..."q_proj": {"lora_a", "lora_b"}}, "score": ...}, frozen
    {"layers": {..."q_proj": {"kernel"}}}.
    """
    if not cfg.lora_rank:
        return params, None
    head = "score" if cfg.head == "score" else None
    if cfg.head == "lm" and cfg.lora_train_head:
        head = "lm_head"  # absent from a tied model's tree: its head is the embedding, frozen

    def walk(tree, path):
        trained, frozen = {}, {}
        for key, value in tree.items():
            sub = (*path, key)
            if isinstance(value, dict):
                t, f = walk(value, sub)
                if t:
                    trained[key] = t
                if f:
                    frozen[key] = f
            elif _is_trained(sub, head):
                trained[key] = value
            else:
                frozen[key] = value
        return trained, frozen

    return walk(params, ())


def combine(trained: dict, frozen: dict | None) -> dict:
    """The model's parameter tree: ``frozen`` with ``trained`` laid over it (a dict union; no
    array is copied). ``frozen`` None (no LoRA) gives ``trained`` itself."""
    if frozen is None:
        return trained
    out = dict(frozen)
    for key, value in trained.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = combine(value, out[key])
        else:
            out[key] = value
    return out


def merged(params: dict, cfg) -> dict:
    """Each adapted kernel replaced by W + (alpha / r) A B (float32) and the adapters dropped:
    dense weights of the same model (for export and tests). Layer-stacked adapters merge per
    layer (A [L D r], B [L r F] -> [L D F])."""
    scale = cfg.lora_alpha / max(cfg.lora_rank, 1)

    def walk(tree):
        if "lora_a" in tree and "kernel" in tree:
            a = jnp.asarray(tree["lora_a"], jnp.float32)
            b = jnp.asarray(tree["lora_b"], jnp.float32)
            w = jnp.asarray(tree["kernel"], jnp.float32) + scale * jnp.matmul(a, b)
            rest = {k: v for k, v in tree.items() if k not in ADAPTER_KEYS}
            return {**rest, "kernel": w}
        return {k: walk(v) if isinstance(v, dict) else v for k, v in tree.items()}

    return walk(params)


def over_frozen(losses: dict, frozen: dict | None) -> dict:
    """``losses`` ({model: loss function of its trained parameters, ...}) with each model's
    frozen base laid under those parameters; unchanged without LoRA. Only the trained tree is
    differentiated."""
    if frozen is None:
        return losses

    def under(fn, model):
        return lambda params, *args: fn(combine(params, frozen.get(model)), *args)

    return {model: under(fn, model) for model, fn in losses.items()}
