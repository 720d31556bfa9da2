"""Bounds for the tests that compare two float32 computations of one PPO update (packed vs
padded rows, Pallas segment attention vs XLA's, a mesh vs one device, two pipelines), derived
from the computation rather than tuned on one machine.

The rounding model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1 and
§4.2): a float32 sum of n terms, in any order, is within γ_n·Σ|x_i| of the exact sum,
γ_n = n·u / (1 - n·u) ≈ n·u, u = 2^-24 ≈ 6.0e-8 (round to nearest). A chain of reductions (a
model's layers, then the loss's mean) adds its sums' lengths, to first order; two paths that sum
in different orders are each within that bound of the exact value, so within twice it of each
other. These bounds take the condition number Σ|x_i| / |Σ x_i| as 1. That holds for the norm of
a parameter tensor's gradient (its large elements make it), and fails for one element: a
gradient element that sums to about 0 has an unbounded relative error, and Adam divides each
element by the root of its own second moment, so such an element moves by up to lr a step
whatever its gradient (a sign that rounding flips moves it 2·lr apart). The largest elementwise
difference of the parameters after Adam is therefore not bounded by float32 rounding at all (it
compared 1.2e-5 against a tuned 1e-5 on one machine, 4e-6 on another). Here the parameters are
compared through what Adam cannot blow up: its first moment (a linear function of the
gradients), the update weighted by √ν (each element's step times the size of its own gradient)
and, elementwise, only against Adam's largest possible step.

Measured on two XLA:CPU configurations (the suite's flags, and XLA's defaults with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``), over every test that uses these: the
moments' difference at most 6.7e-6 (100x under ``grad_rtol``), the weighted update's 2.8e-7
(3,000x under ``update_rtol``), the largest elementwise change 1.2e-5 (325x under
``adam_drift_bound``), the loss metrics at least 250x inside ``loss_tolerance``. A real bug is
far outside: one token left out of one path measures 20-280x over ``grad_rtol``, a 1e-3 error
in the attention's output 6x, one tensor's gradient off by 0.1 % 1.5x.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import optax

U = 2.0**-24  # float32 unit roundoff (round to nearest)
ADAM_B1, ADAM_B2 = 0.9, 0.999  # OptimConfig's defaults, which every compared update uses


def chain_summands(cfgs, tokens: int, keys: int) -> int:
    """n: the summands along the longest chain of float32 reductions from the parameters to the
    loss of one optimizer step (any of ``cfgs``, the actor's and the critic's ModelConfig), over
    ``tokens`` (N: a minibatch's rows × their width, padding included) in rows of ``keys`` (T):

        n = N                           the token sum (the loss's mean and the weight gradients,
                                         over microbatches, chunks or devices: N summands in all)
          + L·(5·D + F + Dh + 2·T)      per layer: 2 RMSNorms, q/k/v and o projections and
                                         SwiGLU's gate/up (D each), its down projection (F),
                                         the scores (Dh), softmax's sum and the weighted values
                                         (T keys each; the kernel's online-softmax
                                         rescalings are at most T more products, inside 2·T)
          + 2·D + V                     the final RMSNorm, the head, log-softmax over V outputs

    e.g. the segment-attention test (rows of 32, 8 a minibatch, D = F = 64, Dh = 16, V = 96):
    n = 8·32 + 2·(5·64 + 64 + 16 + 2·32) + 2·64 + 96 = 1408."""
    n = 0
    for cfg in cfgs:
        d = cfg.hidden_size
        layer = 5 * d + cfg.intermediate_size + cfg.head_dim + 2 * keys
        outputs = cfg.vocab_size if cfg.head == "lm" else cfg.num_labels
        n = max(n, tokens + cfg.num_layers * layer + 2 * d + outputs)
    return n


def loss_tolerance(n: int, scale: float) -> tuple[float, float]:
    """(rtol, atol) of a loss metric: a mean over tokens of per-token terms, each the output of
    the forward chain of n summands, so each path is within n·u·mean|term| of the exact mean and
    the two within 2·n·u·mean|term|: rtol = 2·n·u (terms of one sign), atol = 2·n·u·scale, with
    scale a bound on the terms' magnitudes (where they cancel: whitened advantages, a KL of
    nearly equal log-probs). The tests' terms are at most about log V (log-probs, entropy), and
    the whitened advantages' RMS is 1: scale = log V. e.g. n = 1408, V = 96: rtol = 1.7e-4,
    atol = 7.7e-4."""
    rtol = 2 * n * U
    return rtol, rtol * scale


def grad_rtol(n: int, steps: int = 1) -> float:
    """Bound on ‖g_a - g_b‖ / ‖g_b‖ for two float32 computations of the gradients, of each
    parameter tensor (``leaf_norm_rel``), or of Adam's first moment (a weighted sum of the
    steps' gradients):

        4·steps·n·u = 2 paths × 2·n (the forward chain and its transpose, the backward pass)
                      × steps (each optimizer step's rounding, carried into the next steps'
                      parameters and moments, adds to first order)

    e.g. n = 1408 over 2 steps: 4·2·1408·u = 6.7e-4. A real difference is far above it: one
    token of the ~100 real ones of a minibatch left out changes its gradient by ~1e-2, a
    tensor's gradient off by 0.1 % changes it by 1e-3 (the float32 paths measure ~1e-6)."""
    return 4 * steps * n * U


def adam_ratio_bound(step: int, b1: float = ADAM_B1, b2: float = ADAM_B2) -> float:
    """a_t: the largest |m̂_t| / √v̂_t after ``step`` (t) steps, over every gradient sequence.
    m̂ = Σ_i w_i·g_i and v̂ = Σ_i v_i·g_i² with w_i = (1-b1)·b1^(t-i) / (1-b1^t) and
    v_i = (1-b2)·b2^(t-i) / (1-b2^t); Cauchy-Schwarz: |Σ w_i·g_i| ≤ √(Σ w_i²/v_i)·√(Σ v_i·g_i²),
    so a_t = √(Σ_i w_i²/v_i): 1 at t = 1, 1.0014 at t = 2, 1.0068 at t = 4 (b1 0.9, b2 0.999)."""
    t = step
    w = [(1 - b1) * b1 ** (t - i) / (1 - b1**t) for i in range(1, t + 1)]
    v = [(1 - b2) * b2 ** (t - i) / (1 - b2**t) for i in range(1, t + 1)]
    return math.sqrt(sum(wi * wi / vi for wi, vi in zip(w, v, strict=True)))


def adam_drift_bound(steps: int, lr: float) -> float:
    """Bound on |Δθ_a - Δθ_b| for any one element, whatever the gradients: Adam (no weight
    decay, as in these tests) moves an element by lr·|m̂_t| / (√v̂_t + ε) ≤ lr·a_t at step t,
    so two paths end at most 2·lr·Σ_t a_t apart: an element whose gradient rounding decides
    may use all of it. e.g. 2 steps, lr = 1e-3: 2·1e-3·(1 + 1.0014) = 4.0e-3."""
    return 2 * lr * sum(adam_ratio_bound(t) for t in range(1, steps + 1))


def update_rtol(n: int, steps: int) -> float:
    """Bound on Σ_j √ν_j·|Δθ_a,j - Δθ_b,j| / Σ_j √ν_j·|Δθ_b,j| (Δθ: the update's change of the
    parameters, ν: the reference's second moment), which Adam's per-element division cannot
    blow up. Adam's step t moves element j by -lr·f_t with f_t = m̂_t / (√v̂_t + ε), and

        ∂f_t/∂g_i = w_i/(√v̂+ε) - m̂·v_i·g_i / (√v̂·(√v̂+ε)²),  so
        √v̂_t·|δf_t| ≤ Σ_i (w_i + a_t·√v_i)·|δg_i| ≤ (1 + a_t·√t)·max_i |δg_i|

    (Σ w_i = 1, √v_i·|g_i| ≤ √v̂, Σ √v_i ≤ √t). Weighted by √ν (the steps' gradients are of one
    batch, so ν ≈ each step's v̂), the numerator is at most lr·Σ_t (1 + a_t·√t)·‖δg_t‖₁ and the
    denominator lr·Σ_t ‖g_t‖₁ (exactly at t = 1, where f = ±1):

        update_rtol = (1 + a_T·√T)·grad_rtol(n, T),  T = steps

    e.g. n = 1408, T = 2: (1 + 1.0014·√2)·6.7e-4 = 1.6e-3."""
    return (1 + adam_ratio_bound(steps) * math.sqrt(steps)) * grad_rtol(n, steps)


@dataclasses.dataclass(frozen=True)
class UpdateBounds:
    """The three bounds one compared update is held to (see ``update_bounds``)."""

    grad: float  # ‖μ_a - μ_b‖ / ‖μ_b‖ for each leaf: Adam's first moments, linear in the gradients
    update: float  # Σ √ν·|Δθ_a - Δθ_b| / Σ √ν·|Δθ_b|
    drift: float  # max |Δθ_a - Δθ_b| elementwise: Adam's largest possible step, twice
    n: int  # the chain's summands they were derived from
    steps: int


def update_bounds(cfgs, tokens: int, keys: int, steps: int, lr: float) -> UpdateBounds:
    """The bounds of an update of ``steps`` optimizer steps of ``tokens`` each (a minibatch,
    padded) in rows of ``keys``, learning rate ``lr``, for the models ``cfgs``."""
    n = chain_summands(cfgs, tokens, keys)
    return UpdateBounds(
        grad_rtol(n, steps), update_rtol(n, steps), adam_drift_bound(steps, lr), n, steps
    )


def adam_moments(opt_state):
    """(μ, ν) of the AdamW inside an optax chain's state."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1, found
    return found[0].mu, found[0].nu


def _flat(tree) -> np.ndarray:
    # On the host, in float64: the trees may live on different devices (a mesh's shards against
    # one device), and a device op mixing them has aborted XLA:CPU after a long module run.
    leaves = jax.tree.leaves(jax.device_get(tree))
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])


def leaf_norm_rel(a, b) -> float:
    """max over the leaves of ‖a - b‖₂ / ‖b‖₂ (each leaf a parameter tensor: a small one, a
    norm's scale or a bias, is held to the bound on its own, not drowned in the whole tree)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = _flat(x), _flat(y)
        diff, ref = np.linalg.norm(x - y), np.linalg.norm(y)
        worst = max(worst, float(diff / ref) if ref > 0 else (0.0 if diff == 0 else np.inf))
    return worst


def _model_diffs(before, got_params, got_opt, want_params, want_opt) -> dict[str, float]:
    p0 = _flat(before)
    got, want = _flat(got_params) - p0, _flat(want_params) - p0
    (mu_got, _), (mu_want, nu_want) = adam_moments(got_opt), adam_moments(want_opt)
    weight = np.sqrt(_flat(nu_want))
    return {
        "grad": leaf_norm_rel(mu_got, mu_want),
        "update": float(np.sum(weight * np.abs(got - want)) / np.sum(weight * np.abs(want))),
        "drift": float(np.max(np.abs(got - want))),
    }


def update_diffs(before: dict, got_state, want_state) -> dict[str, dict[str, float]]:
    """The measured counterparts of ``UpdateBounds``, {"actor": {...}, "critic": {...}}, of two
    train states after an update (``want_state``: the reference); ``before``: {"actor": params,
    "critic": params} before it (the actor's alone: a critic-free update)."""
    return {
        model: _model_diffs(
            before[model],
            getattr(got_state, f"{model}_params"),
            getattr(got_state, f"{model}_opt"),
            getattr(want_state, f"{model}_params"),
            getattr(want_state, f"{model}_opt"),
        )
        for model in before
    }


def assert_same_update(bounds: UpdateBounds, before: dict, got_state, want_state) -> dict:
    """Hold the actor's and the critic's updates of two train states to ``bounds`` (arguments as
    ``update_diffs``); returns the measured values, for reports."""
    measured = update_diffs(before, got_state, want_state)
    check_update(bounds, measured)
    return measured


def check_update(bounds: UpdateBounds, measured: dict) -> None:
    """Assert measured {"actor": update_diffs, "critic": ...} within ``bounds``."""
    for model, got in measured.items():
        for name, value in got.items():
            bound = getattr(bounds, name)
            assert value <= bound, f"{model} {name}: {value:.3g} > {bound:.3g} ({bounds})"


def assert_same_metrics(got: dict, want: dict, names, n: int, steps: int, vocab: int) -> None:
    """|got - want| ≤ atol + rtol·|want| for each of ``names``: loss metrics (means over
    tokens) with ``loss_tolerance(n, log V)``, gradient norms (their mean over ``steps``) with
    rtol ``grad_rtol(n, steps)``."""
    rtol, atol = loss_tolerance(n, math.log(vocab))
    for name in names:
        if name.endswith("grad_norm"):
            tol = {"rtol": grad_rtol(n, steps), "atol": 0.0}
        else:
            tol = {"rtol": rtol, "atol": atol}
        np.testing.assert_allclose(got[name], want[name], **tol, err_msg=name)
