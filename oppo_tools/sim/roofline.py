"""Roofline projections: a CostModel from datasheet numbers, a model's shape and what it trains.

Decode is memory-bound until the batch reaches the ridge: a step reads every weight once
(bytes / HBM bandwidth) and each slot reads its KV cache; past the ridge it is compute-bound.
Prefills and the update run at ``mfu`` of peak: 2·params FLOPs per token forward, 3× that
forward + backward, per PPO epoch and per trained model (the critic has the actor's size, as in
every config here; a critic-free run of the GRPO family trains the actor alone); each optimizer
step also moves parameters, gradients and two Adam moments through HBM. With LoRA
(``lora_rank`` > 0) the frozen base needs no weight gradient: 2× the forward per token (forward
+ the activations' backward), and the optimizer and the parameter copy move only the adapters
(taken as free). The update's attention is priced per query-key pair its kernel computes (4 ·
layers · heads · head_dim FLOPs forward, the same backward factor): every key of a row for
XLA's attention, the causal blocks for splash on a TPU, each sequence's own causal pairs for
the token-proportional engine; at the matmul rate, so XLA's unfused attention (scores through
HBM) costs more than this says. Not modelled: attention FLOPs of prefill and scoring (a few
percent at contexts of ~1k tokens, more at 8k+), memory limits, host delays (0) and contention
(ρ = 1).
Every cost model from here is labelled PROJECTION.
"""

from __future__ import annotations

import dataclasses

from oppo_tools.sim.model import CostModel


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-chip peak numbers (public datasheet values, rounded)."""

    name: str
    hbm_bandwidth_bytes_s: float
    peak_flops: float  # dense bf16
    link_bytes_s: float  # chip-to-chip, one direction (parameter copies)
    backend: str = "gpu"  # JAX's backend name: which kernels the engine picks (engines.built_for)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder: parameters and KV-cache bytes per token."""

    name: str
    params: float
    kv_bytes_per_token: float  # 2 (K, V) × layers × kv_heads × head_dim × 2 bytes (bf16)
    bytes_per_param: float = 2.0  # bf16
    attention_width: float = 0.0  # layers × query heads × head_dim: a query-key pair's FLOPs / 4

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What a run trains, as a step's cost sees it (a config's ``ppo`` and models)."""

    ppo_epochs: int = 4  # passes over each batch (TRL's default)
    num_minibatches: int = 1  # optimizer updates per epoch
    # models the update trains: actor + critic (PPO's GAE), or the actor alone (critic-free)
    trained: tuple[str, ...] = ("actor", "critic")
    reward_model: bool = True  # a reward model scores; False: a rule-based reward
    lora_rank: int = 0  # LoRA adapters on frozen bases (model.lora_rank); 0: full parameters
    reference: bool = True  # the reference scores (a KL term, β > 0); False: β = 0, none

    @property
    def scorers(self) -> tuple[str, ...]:
        """Prefill-only consumers of the actor's tokens (``compile_plan.scorer_roles``'s
        rule): the reference when β > 0, the critic when trained, the reward model if any."""
        present = (self.reference, "critic" in self.trained, self.reward_model)
        roles = ("reference", "critic", "reward")
        return tuple(r for r, on in zip(roles, present, strict=True) if on)

    @property
    def n_scorers(self) -> int:
        return len(self.scorers)

    def describe(self) -> str:
        lora = f" (LoRA rank {self.lora_rank})" if self.lora_rank else ""
        scorers = ", ".join(self.scorers) or "none"
        return (
            f"{self.ppo_epochs} PPO epoch(s) × {self.num_minibatches} minibatch(es), "
            f"trained: {' + '.join(self.trained)}{lora}, scorers: {scorers}"
        )


HARDWARE = {
    # H100 GPU of a GH200 96 GB: HBM3 4.0 TB/s, ~989 TFLOP/s dense bf16, NVLink 4 450 GB/s/dir.
    "gh200": Hardware("GH200 (H100, 96 GB HBM3)", 4.0e12, 989e12, 450e9),
    # TPU v5p chip: HBM2e 2.765 TB/s, 459 TFLOP/s bf16, ICI 4800 Gb/s = 600 GB/s.
    "tpu-v5p": Hardware("TPU v5p (one chip)", 2.765e12, 459e12, 600e9, backend="tpu"),
}
MODELS = {
    # 36 layers, 16 query heads, 2 KV heads, head_dim 128.
    "qwen2.5-3b": ModelShape("Qwen2.5-3B", 3.09e9, 2.0 * 36 * 2 * 128 * 2, 2.0, 36.0 * 16 * 128),
    # 28 layers, 28 query heads, 4 KV heads, head_dim 128.
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 7.62e9, 2.0 * 28 * 4 * 128 * 2, 2.0, 28.0 * 28 * 128),
}
# An AdamW step reads parameters, gradients and both moments and writes parameters and
# moments: 7 arrays of the parameters' size.
OPTIMIZER_ARRAYS = 7


def roofline_cost_model(
    model: ModelShape,
    hardware: Hardware,
    train: TrainSettings,
    batch: int,
    mfu: float = 0.5,
    chips: int = 1,
) -> CostModel:
    """The roofline CostModel of ``model`` on ``chips`` × ``hardware`` (sharded perfectly)
    training as ``train`` says; ``batch`` is the decode batch (slots) the slope is fitted at."""
    bandwidth, peak = hardware.hbm_bandwidth_bytes_s * chips, hardware.peak_flops * chips
    weights = model.weight_bytes / bandwidth  # every decode step reads all weights once
    compute = batch * 2.0 * model.params / peak
    # Linear in S through the roofline at S = 0 and S = batch: exact at both ends, and above
    # max(memory, compute) in between (so a projection never flatters large batches).
    slope = max(0.0, compute - weights) / batch
    per_token = 2.0 * model.params / (peak * mfu)
    trained = len(train.trained)
    optimizer_steps = train.ppo_epochs * train.num_minibatches * trained
    backward = 3.0  # forward + 2× backward (activations and weights)
    if train.lora_rank:  # no weight gradient of the frozen base; adapters' traffic is small
        backward, optimizer_steps = 2.0, 0
    return CostModel(
        decode_a=weights,
        decode_b=slope,
        decode_c=model.kv_bytes_per_token / bandwidth,  # each slot reads its KV cache
        prefill_p0=weights,  # a prefill call reads the weights at least once
        prefill_p1=per_token,
        n_scorers=train.n_scorers,
        trained_scorers=int("critic" in train.trained),
        admit_p0=weights,
        admit_p1=per_token,
        update_u0=optimizer_steps * OPTIMIZER_ARRAYS * weights,
        update_u1=backward * per_token * train.ppo_epochs * trained,
        # QKᵀ and PV: 2 × 2 FLOPs per query-key pair and unit of attention width
        update_a=backward * 4.0 * model.attention_width / (peak * mfu) * train.ppo_epochs * trained,
        copy_s=0.0 if train.lora_rank else model.weight_bytes / hardware.link_bytes_s,
        label=f"PROJECTION (roofline, mfu {mfu:g}): {model.name} on {chips}× {hardware.name}",
    )


def parse_spec(spec: str) -> tuple[ModelShape, Hardware]:
    """``"MODEL:HARDWARE"`` (e.g. ``qwen2.5-7b:gh200``) as its shape and hardware."""
    model_name, _, hw_name = spec.lower().partition(":")
    if model_name not in MODELS or hw_name not in HARDWARE:
        raise ValueError(
            f"--project {spec!r}: expected MODEL:HARDWARE with MODEL in {sorted(MODELS)} "
            f"and HARDWARE in {sorted(HARDWARE)}"
        )
    return MODELS[model_name], HARDWARE[hw_name]


def project_cost_model(
    spec: str, batch: int, train: TrainSettings = TrainSettings(), mfu: float = 0.5, chips: int = 1
) -> CostModel:
    """The roofline CostModel of ``"MODEL:HARDWARE"``, a PROJECTION."""
    model, hardware = parse_spec(spec)
    return roofline_cost_model(model, hardware, train, batch, mfu, chips)
