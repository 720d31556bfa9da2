"""Cost models of the PPO-RLHF stages: the CostModel, calibration, roofline projections.

All costs are seconds on one device group (see ``oppo_jax.sim`` for the step model):

    decode_step_s(S, ctx) = a + b·S + c·S·ctx     one lockstep token for S slots, mean context ctx
    prefill_s(n)          = p0 + p1·n             one scorer call over n tokens (×n_scorers)
    admit_s(n)            = q0 + q1·n             actor prefill of prompts + carried prefixes
    update_s(B, n)        = u0 + u1·n             build batch + PPO update over n batch tokens
    copy_s                                        parameter movement, once per step

``a`` is the weight read of a memory-bound decode, ``b`` per-slot compute, ``c`` the KV-cache
read. ``calibrate`` fits them by least squares to measured per-step records; the roofline
functions derive them from hardware and model numbers, and label the result PROJECTION.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

Num = int | float


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Stage costs in seconds (equations in the module docstring)."""

    decode_a: float = 0.0  # s per decode step
    decode_b: float = 0.0  # s per decode step per slot
    decode_c: float = 0.0  # s per decode step per slot per context token
    prefill_p0: float = 0.0  # s per scorer call
    prefill_p1: float = 0.0  # s per token per scorer
    n_scorers: int = 3  # reference, critic, reward (2 with a rule-based reward)
    admit_p0: float = 0.0  # s per actor admission prefill
    admit_p1: float = 0.0  # s per admitted token (prompt + carried prefix)
    update_u0: float = 0.0  # s per update
    update_u1: float = 0.0  # s per batch token (prompt + response)
    copy_s: float = 0.0  # s per step moving parameters between shardings/groups
    # True: a fixed-shape engine (this project's JAX decode): every admitted slot costs every
    # decode step, decode runs whole chunks plus the one dispatched before the host sees the cut.
    padded_decode: bool = False
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
        """Build batch and PPO update of ``batch`` sequences holding ``total_tokens`` tokens."""
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


# ---------------------------------------------------------------- calibration

_EXACT = ("decode_steps", "slot_steps", "slot_ctx", "admit_tokens", "scorer_calls",
          "scorer_tokens", "batch_tokens")  # fmt: skip
_NEEDED = ("stage_time_s", "step_time_s", "response_len_mean", "response_len_max", "chunk_size")


def _scorer_names(stages: dict) -> set[str]:
    return {k.split(" ", 1)[1] for k in stages if k.startswith(("prefill ", "score "))} - {"actor"}


def _counts(r: dict, batch: int | None, prompt_len: int, streamed: bool, padded: bool) -> dict:
    """The regressors of one record: exact ``counts`` when present, else an approximation."""
    if all(k in r.get("counts", {}) for k in _EXACT):
        return r["counts"]
    missing = [k for k in _NEEDED if k not in r]
    if missing:
        raise ValueError(f"metrics record of step {r.get('step')} lacks {missing}")
    b = int(r.get("batch_size", batch or 0))
    if b <= 0:
        raise ValueError("calibration needs the batch size: pass batch= or a 'batch_size' key")
    p = float(r.get("prompt_len", prompt_len))
    slots = b + int(r.get("overcommit", 0))
    mean, cut, c = float(r["response_len_mean"]), int(r["response_len_max"]), r["chunk_size"]
    chunks = math.ceil(cut / c)
    if padded:  # whole chunks over every slot, one more chunk than the cut needs
        n = (chunks + 1) * c
        steps, ctx, gen = slots * n, slots * (n * p + n * (n - 1) / 2), slots * chunks * c
    else:  # approximates the Σ of lengths and of squared lengths by the batch's mean
        n, steps = cut, b * mean
        ctx, gen = b * (p * mean + mean * (mean - 1) / 2), b * mean
    admit = slots * p + float(r.get("stale_token_frac", 0.0)) * b * mean
    k = len(_scorer_names(r["stage_time_s"])) or 3
    calls = 1 + (chunks if r.get("streamed", streamed) else 1)
    return {"decode_steps": n, "slot_steps": steps, "slot_ctx": ctx, "admit_tokens": admit,
            "scorer_calls": k * calls, "scorer_tokens": k * (admit + gen),
            "batch_tokens": b * (p + mean), "n_scorers": k}  # fmt: skip


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares; a column whose coefficient comes out negative (noise) is dropped, refit."""
    keep = np.ones(x.shape[1], bool)
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or keep.sum() == 1:
            return np.maximum(coef, 0.0)
        keep &= coef >= 0


def calibrate(
    measurements: list[dict],
    batch: int | None = None,
    prompt_len: int = 0,
    streamed: bool = True,
    padded_decode: bool = False,
) -> CostModel:
    """Fit a CostModel by least squares to per-step metrics records (``metrics.jsonl`` lines).

    Each record needs ``stage_time_s`` ("decode", "prefill actor", "prefill <scorer>",
    "score <scorer>", "build batch", "update", optionally "copy"), ``step_time_s``,
    ``response_len_mean``, ``response_len_max`` and ``chunk_size``; ``overcommit`` and
    ``stale_token_frac`` are used when present. ``batch_size``, ``prompt_len`` and ``streamed``
    keys override the arguments per record. A ``counts`` dict (the simulator writes one) gives
    the exact regressors; without it they are approximated from the mean and max lengths.
    Without a "copy" stage, copy_s is the median unexplained time of a step (clipped at 0).
    """
    if not measurements:
        raise ValueError("calibration needs at least one metrics record")
    rows = [_counts(r, batch, prompt_len, streamed, padded_decode) for r in measurements]
    st = [r["stage_time_s"] for r in measurements]
    if not any("decode" in s for s in st):
        raise ValueError("the records have no 'decode' stage time (an older metrics format?)")

    def col(key: str) -> np.ndarray:
        return np.array([float(c[key]) for c in rows])

    def stage(pred) -> np.ndarray:
        return np.array([sum(v for k, v in s.items() if pred(k)) for s in st], float)

    one = np.ones(len(rows))
    dec = _nonneg_lstsq(np.stack([col("decode_steps"), col("slot_steps"), col("slot_ctx")], 1),
                        stage(lambda k: k == "decode"))  # fmt: skip
    scorer = stage(lambda k: k.split(" ")[0] == "score" or (k.startswith("prefill ")
                                                            and k != "prefill actor"))  # fmt: skip
    pre = _nonneg_lstsq(np.stack([col("scorer_calls"), col("scorer_tokens")], 1), scorer)
    adm = _nonneg_lstsq(
        np.stack([one, col("admit_tokens")], 1), stage(lambda k: k == "prefill actor")
    )
    upd = _nonneg_lstsq(np.stack([one, col("batch_tokens")], 1),
                        stage(lambda k: k in ("update", "build batch")))  # fmt: skip
    if any("copy" in s for s in st):
        copy = float(np.mean(stage(lambda k: k == "copy")))
    else:
        unexplained = np.array([r["step_time_s"] for r in measurements]) - stage(lambda k: True)
        copy = float(max(0.0, np.median(unexplained)))
    return CostModel(
        decode_a=float(dec[0]), decode_b=float(dec[1]), decode_c=float(dec[2]),
        prefill_p0=float(pre[0]), prefill_p1=float(pre[1]),
        n_scorers=int(rows[0].get("n_scorers", 3)),
        admit_p0=float(adm[0]), admit_p1=float(adm[1]),
        update_u0=float(upd[0]), update_u1=float(upd[1]), copy_s=copy,
        padded_decode=padded_decode, label=f"calibrated from {len(rows)} measured steps",
    )  # fmt: skip


def calibrate_from_bench(bench_json: dict, padded_decode: bool = True) -> CostModel:
    """Fit a CostModel to the per-step records of a ``bench.json``, where it holds them.

    ``oppo-jax bench`` writes step times per schedule but (so far) no per-stage times; then this
    raises and the records of a run's ``metrics.jsonl`` must be used (``calibrate``). Records are
    looked for under ``schedules[NAME]["records"]`` (a list, or a list per seed).
    """
    rollout = bench_json.get("workload", {}).get("config", {}).get("rollout", {})
    records = []
    for name, s in bench_json.get("schedules", {}).items():
        recs = s.get("records") or []
        for r in (x for item in recs for x in (item if isinstance(item, list) else [item])):
            if "stage_time_s" in r:
                records.append({"streamed": name in ("intra", "oppo"), **r})
    if not records:
        raise ValueError("bench.json has step times but no per-stage times (stage_time_s): "
                         "calibrate from a run's metrics.jsonl instead (--metrics)")  # fmt: skip
    return calibrate(records, rollout.get("batch_size"), int(rollout.get("max_prompt_len", 0)),
                     padded_decode=padded_decode)  # fmt: skip
