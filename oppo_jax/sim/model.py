"""Cost models of the PPO-RLHF stages: the CostModel and roofline projections.

All costs are seconds on one device group (see ``oppo_jax.sim`` for the step model):

    decode_step_s(S, ctx) = a + b·S + c·S·ctx     one lockstep token of S slots at context ctx
    decode_chunk_s                                per decode chunk (dispatch, scan, host read)
    prefill_s(n)          = p0 + p1·n             one scorer call over n tokens (×n_scorers)
    admit_s(n)            = q0 + q1·n             actor prefill of prompts + carried prefixes
    build_s                                       the PPO batch, once the scores are in
    update_s(B, n)        = u0 + u1·n             PPO update over n batch tokens
    copy_s                                        after the update: parameter copy, host tail

``a`` is the weight read of a memory-bound decode, ``b`` per-slot compute, ``c`` the KV-cache
read. Two engines: an *active* one (a serving engine: finished slots stop costing, n counts
real tokens, ctx is a slot's context) and a *padded* one (this project's JAX engine: fixed
shapes, so every slot costs every step, ctx is the cache width W + R, a scorer call costs
its padded [S, width] and the update its padded [B, P + R]; the model is skipped only once
every slot has finished). The host_* delays and the overlap rates describe the machine the
steps ran on (``oppo_jax.sim.fitting`` fits them); roofline projections leave them at 0
and 1 and say PROJECTION.
"""

from __future__ import annotations

import dataclasses

Num = int | float


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Stage costs in seconds (equations in the module docstring)."""

    decode_a: float = 0.0  # s per decode step that runs the model
    decode_b: float = 0.0  # s per decode step per slot
    decode_c: float = 0.0  # s per decode step per slot per context token
    decode_chunk_s: float = 0.0  # s per decode chunk (dispatch, scan set-up, the host's read)
    prefill_p0: float = 0.0  # s per scorer call
    prefill_p1: float = 0.0  # s per token per scorer
    n_scorers: int = 3  # reference, critic, reward (2 with a rule-based reward)
    admit_p0: float = 0.0  # s per actor admission prefill
    admit_p1: float = 0.0  # s per admitted token (prompt + carried prefix)
    build_s: float = 0.0  # s per step building the PPO batch (after the scores arrive)
    update_u0: float = 0.0  # s per update
    update_u1: float = 0.0  # s per batch token (prompt + response; padded: B·(P + R))
    copy_s: float = 0.0  # s per step after the update (parameter copies, host tail)
    host_admit_s: float = 0.0  # s of host work before the actor prefill is dispatched
    host_setup_s: float = 0.0  # s more before the first decode chunk is dispatched
    host_stream_s: float = 0.0  # s more when streaming (dispatching the scorers' admissions)
    host_collect_s: float = 0.0  # s not streaming: from the host's read of the cut to scoring
    host_dispatch_s: float = 0.0  # s not streaming: from that read to all scoring dispatched
    host_finish_s: float = 0.0  # s from the last decode chunk (and the above) to the build
    host_update_s: float = 0.0  # s from the build's dispatch to the update's
    overlap_rate: float = 1.0  # speed of either group's work while the other group works too
    # True: a fixed-shape engine (this project's JAX decode): every admitted slot costs every
    # decode step, decode runs whole chunks plus the one dispatched before the host sees the cut.
    padded_decode: bool = False
    # padded engine: carried rows admitted at the wide context, new ones at the prompt width
    # (False: every slot at the wide context, the engine before the split admission)
    split_admission: bool = True
    label: str = ""  # where the numbers come from; "PROJECTION ..." for roofline models

    def decode_step_s(self, slots: Num, ctx: Num) -> float:
        """One lockstep decode step of ``slots`` slots at mean context ``ctx`` tokens."""
        return self.decode_a + self.decode_b * slots + self.decode_c * slots * ctx

    def prefill_s(self, tokens: Num) -> float:
        """One scorer's prefill of ``tokens`` tokens (one call)."""
        return self.prefill_p0 + self.prefill_p1 * tokens

    def scorers_s(self, tokens: Num) -> float:
        """All scorers' prefill of ``tokens`` tokens, run one after another on their group."""
        return self.n_scorers * self.prefill_s(tokens)

    def admit_s(self, tokens: Num) -> float:
        """The actor's admission prefill of ``tokens`` tokens."""
        return self.admit_p0 + self.admit_p1 * tokens

    def update_s(self, batch: int, total_tokens: Num) -> float:
        """PPO update of ``batch`` sequences holding ``total_tokens`` tokens."""
        del batch  # the linear model depends on tokens only; kept for a per-sequence term later
        return self.update_u0 + self.update_u1 * total_tokens

    def to_dict(self) -> dict:
        """Plain JSON form."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- roofline projections


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-chip peak numbers (public datasheet values, rounded)."""

    name: str
    hbm_bandwidth_bytes_s: float
    peak_flops: float  # dense bf16
    link_bytes_s: float  # chip-to-chip, one direction (parameter copies)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder: parameters and KV-cache bytes per token."""

    name: str
    params: float
    kv_bytes_per_token: float  # 2 (K, V) × layers × kv_heads × head_dim × 2 bytes (bf16)
    bytes_per_param: float = 2.0  # bf16


HARDWARE = {
    # H100 GPU of a GH200 96 GB: HBM3 4.0 TB/s, ~989 TFLOP/s dense bf16, NVLink 4 450 GB/s/dir.
    "gh200": Hardware("GH200 (H100, 96 GB HBM3)", 4.0e12, 989e12, 450e9),
    # TPU v5p chip: HBM2e 2.765 TB/s, 459 TFLOP/s bf16, ICI 4800 Gb/s = 600 GB/s.
    "tpu-v5p": Hardware("TPU v5p (one chip)", 2.765e12, 459e12, 600e9),
}
MODELS = {
    # 36 layers, 2 KV heads, head_dim 128.
    "qwen2.5-3b": ModelShape("Qwen2.5-3B", 3.09e9, 2.0 * 36 * 2 * 128 * 2),
    # 28 layers, 4 KV heads, head_dim 128.
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 7.62e9, 2.0 * 28 * 4 * 128 * 2),
}


def roofline_cost_model(
    params_bytes: float,
    flops_per_token: float,
    hbm_bandwidth_bytes_s: float,
    peak_flops: float,
    batch: int,
    mfu: float = 0.5,
    kv_bytes_per_token: float = 0.0,
    n_scorers: int = 3,
    link_bytes_s: float | None = None,
    ppo_epochs: int = 1,
    trained_models: int = 1,
    label: str = "PROJECTION (roofline)",
) -> CostModel:
    """A CostModel from the roofline: decode max(bytes/BW, FLOPs/peak), prefill FLOPs/(peak·mfu)."""
    weights = params_bytes / hbm_bandwidth_bytes_s  # every decode step reads all weights once
    compute = batch * flops_per_token / peak_flops
    # Linear in S through the roofline at S = 0 and S = batch: exact at both ends, and above
    # max(memory, compute) in between (so a projection never flatters large batches).
    slope = max(0.0, compute - weights) / batch
    per_token = flops_per_token / (peak_flops * mfu)
    return CostModel(
        decode_a=weights,
        decode_b=slope,
        decode_c=kv_bytes_per_token / hbm_bandwidth_bytes_s,  # each slot reads its KV cache
        prefill_p0=weights,  # a prefill call reads the weights at least once
        prefill_p1=per_token,
        n_scorers=n_scorers,
        admit_p0=weights,
        admit_p1=per_token,
        update_u1=3.0 * per_token * ppo_epochs * trained_models,  # forward + 2× backward
        copy_s=0.0 if link_bytes_s is None else params_bytes / link_bytes_s,
        label=label,
    )


def project_cost_model(spec: str, batch: int, mfu: float = 0.5, chips: int = 1) -> CostModel:
    """The roofline CostModel of ``"MODEL:HARDWARE"`` (e.g. ``qwen2.5-7b:gh200``), a PROJECTION."""
    model_name, _, hw_name = spec.lower().partition(":")
    if model_name not in MODELS or hw_name not in HARDWARE:
        raise ValueError(f"--project {spec!r}: expected MODEL:HARDWARE with MODEL in "
                         f"{sorted(MODELS)} and HARDWARE in {sorted(HARDWARE)}")  # fmt: skip
    m, hw = MODELS[model_name], HARDWARE[hw_name]
    return roofline_cost_model(
        m.params * m.bytes_per_param, 2.0 * m.params, hw.hbm_bandwidth_bytes_s * chips,
        hw.peak_flops * chips, batch, mfu, m.kv_bytes_per_token, link_bytes_s=hw.link_bytes_s,
        label=f"PROJECTION (roofline, mfu {mfu:g}): {m.name} on {chips}× {hw.name}",
    )  # fmt: skip
