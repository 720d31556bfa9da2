"""PPO math layer against independent float64 NumPy references written as plain loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import PPOConfig
from oppo_jax.ppo import (
    AdaptiveKLController,
    FixedKLController,
    apply_missing_eos_penalty,
    entropy_from_logits,
    gae,
    kl_estimate,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    penalized_rewards,
    policy_loss,
    value_loss,
)
from oppo_jax.ppo.estimators import whiten_rewards
from oppo_jax.ppo.losses import aggregate
from oppo_jax.ppo.masked import last_valid_index, masked_var
from oppo_jax.ppo.off_policy import correction_metrics, correction_weight

SEEDS = [0, 1, 2]
B, T, V = 5, 7, 16
TOL = dict(atol=1e-6, rtol=1e-6)


def batch(seed):
    """Random right-padded batch: row 0 has length 1, the others random lengths in [1, T]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0] = 1
    mask = np.arange(T)[None, :] < lengths[:, None]
    return rng, lengths, mask


def f32(rng, *shape, scale=1.0, mask=None):
    """float32 normal sample; NaN at padded positions so leaks through the mask show up."""
    x = (scale * rng.standard_normal(shape)).astype(np.float32)
    if mask is not None:
        x[~mask] = np.nan
    return x


def j(x):
    return jnp.asarray(x)


# ----------------------------------------------------------------------------- references
def ref_kl(lp, rp, est):
    d = float(lp) - float(rp)
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1.0 + d}[est]


def ref_gae(rewards, values, lengths, gamma, lam):
    adv, ret = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        last = 0.0
        for t in reversed(range(lengths[b])):
            next_v = float(values[b, t + 1]) if t + 1 < lengths[b] else 0.0
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            last = delta + gamma * lam * last
            adv[b, t] = last
            ret[b, t] = last + float(values[b, t])
    return adv, ret


def ref_whiten(x, lengths, shift_mean):
    valid = np.array([float(x[b, t]) for b in range(B) for t in range(lengths[b])])
    mean, var = valid.mean(), valid.var(ddof=1)
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(lengths[b]):
            out[b, t] = (float(x[b, t]) - mean) / math.sqrt(var + 1e-8)
            out[b, t] += 0.0 if shift_mean else mean
    return out


def ref_aggregate(per_token, lengths, agg):
    rows = [[per_token[b][t] for t in range(lengths[b])] for b in range(B)]
    if agg == "token_mean":
        flat = [x for row in rows for x in row]
        return sum(flat) / len(flat)
    row_means = [sum(row) / len(row) for row in rows if row]
    return sum(row_means) / len(row_means)


def ref_policy(lp, olp, adv, lengths, eps, agg, blp=None, is_clip=None):
    per, clip, kl, ratio, weight = [], [], [], [], []
    for b in range(B):
        per.append([])
        for t in range(lengths[b]):
            r = math.exp(float(lp[b, t]) - float(olp[b, t]))
            a = float(adv[b, t])
            w = 1.0 if blp is None else min(math.exp(float(olp[b, t]) - float(blp[b, t])), is_clip)
            per[b].append(w * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps)))
            clip.append(float(abs(r - 1) > eps))
            kl.append(0.5 * (float(lp[b, t]) - float(olp[b, t])) ** 2)
            ratio.append(r)
            weight.append(w)
    aux = {k: np.mean(v) for k, v in [("clipfrac", clip), ("approx_kl", kl), ("ratio_mean", ratio)]}
    if blp is not None:
        aux["is_weight_mean"] = np.mean(weight)
    return ref_aggregate(per, lengths, agg), aux


# ----------------------------------------------------------------------------- masked helpers
def test_last_valid_index_worked_example():
    mask = j(np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]], np.int32))
    np.testing.assert_array_equal(last_valid_index(mask), [1, 2, 0, 2])


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_mean_var_whiten_match_numpy(seed):
    rng, lengths, mask = batch(seed)
    x = f32(rng, B, T, scale=2.0, mask=mask)
    valid = np.array([float(x[b, t]) for b in range(B) for t in range(lengths[b])])
    np.testing.assert_allclose(masked_mean(j(x), j(mask)), valid.mean(), **TOL)
    np.testing.assert_allclose(masked_var(j(x), j(mask)), valid.var(ddof=1), **TOL)
    for shift in (True, False):
        want = ref_whiten(x, lengths, shift)
        np.testing.assert_allclose(masked_whiten(j(x), j(mask), shift_mean=shift), want, **TOL)
    np.testing.assert_allclose(whiten_rewards(j(x), j(mask)), ref_whiten(x, lengths, False), **TOL)


def test_aggregations_by_hand_with_empty_row():
    per_token = j(np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], np.float32))
    mask = j(np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool))
    assert float(aggregate(per_token, mask, "token_mean")) == pytest.approx(10.0 / 4.0)
    assert float(aggregate(per_token, mask, "seq_mean")) == pytest.approx((2.0 + 4.0) / 2.0)


# ----------------------------------------------------------------------------- rewards
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference(estimator):
    rng = np.random.default_rng(3)
    lp, rp = f32(rng, B, T), f32(rng, B, T)
    want = np.array([[ref_kl(lp[b, t], rp[b, t], estimator) for t in range(T)] for b in range(B)])
    np.testing.assert_allclose(kl_estimate(j(lp), j(rp), estimator), want, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator,kl_in_reward", [("k1", True), ("k3", True), ("k2", False)])
def test_penalized_rewards_match_reference(seed, estimator, kl_in_reward):
    rng, lengths, mask = batch(seed)
    scores = f32(rng, B)
    lp, rp = f32(rng, B, T, scale=0.5, mask=mask), f32(rng, B, T, scale=0.5, mask=mask)
    coef = 0.05
    want_r, want_kl = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        for t in range(lengths[b]):
            want_kl[b, t] = ref_kl(lp[b, t], rp[b, t], estimator)
            want_r[b, t] = -coef * want_kl[b, t] if kl_in_reward else 0.0
        want_r[b, lengths[b] - 1] += float(scores[b])
    rewards, kl = penalized_rewards(j(scores), j(lp), j(rp), j(mask), coef, estimator, kl_in_reward)
    np.testing.assert_allclose(rewards, want_r, **TOL)
    np.testing.assert_allclose(kl, want_kl, **TOL)


def test_penalized_rewards_skip_empty_row():
    mask = j(np.array([[1, 1, 0], [0, 0, 0]], bool))
    zeros = jnp.zeros((2, 3), jnp.float32)
    rewards, _ = penalized_rewards(j(np.array([2.0, 5.0], np.float32)), zeros, zeros, mask, 0.1)
    np.testing.assert_allclose(rewards, [[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])


def test_missing_eos_penalty():
    scores = j(np.array([1.0, 2.0, -1.0], np.float32))
    eos = j(np.array([True, False, False]))
    np.testing.assert_allclose(apply_missing_eos_penalty(scores, eos, 1.0), [1.0, 1.0, -2.0])
    np.testing.assert_allclose(apply_missing_eos_penalty(scores, eos, None), [1.0, 2.0, -1.0])


# ----------------------------------------------------------------------------- GAE
def test_gae_worked_by_hand():
    # gamma=1, lam=0.95, no padding, V after the end = 0:
    #   t=2: delta = 1 + 0   - 0.1 =  0.9              A2 = 0.9
    #   t=1: delta = 0 + 0.1 - 0.2 = -0.1   A1 = -0.1 + 0.95*0.9   =  0.755
    #   t=0: delta = 0 + 0.2 - 0.5 = -0.3   A0 = -0.3 + 0.95*0.755 =  0.41725
    #   returns = A + V = [0.91725, 0.955, 1.0]
    rewards = j(np.array([[0.0, 0.0, 1.0]], np.float32))
    values = j(np.array([[0.5, 0.2, 0.1]], np.float32))
    adv, ret = gae(rewards, values, j(np.ones((1, 3), np.int32)), 1.0, 0.95)
    np.testing.assert_allclose(adv, [[0.41725, 0.755, 0.9]], **TOL)
    np.testing.assert_allclose(ret, [[0.91725, 0.955, 1.0]], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_matches_reference(seed, gamma, lam):
    rng, lengths, mask = batch(seed)
    rewards, values = f32(rng, B, T, mask=mask), f32(rng, B, T, mask=mask)
    want_adv, want_ret = ref_gae(rewards, values, lengths, gamma, lam)
    adv, ret = gae(j(rewards), j(values), j(mask), gamma, lam)
    np.testing.assert_allclose(adv, want_adv, **TOL)
    np.testing.assert_allclose(ret, want_ret, **TOL)


def test_gae_jit_equals_eager():
    rng, _, mask = batch(7)
    rewards, values = f32(rng, B, T), f32(rng, B, T)
    args = (j(rewards), j(values), j(mask))
    eager = gae(*args, 0.99, 0.95)
    jitted = jax.jit(gae)(*args, 0.99, 0.95)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    assert float(jnp.abs(eager[0]).sum()) > 0.0


# ----------------------------------------------------------------------------- losses
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("is_clip", [None, 1.2])
def test_policy_loss_matches_reference(seed, agg, is_clip):
    rng, lengths, mask = batch(seed)
    olp = f32(rng, B, T, mask=mask) - 2.0
    lp = olp + f32(rng, B, T, scale=0.3)
    adv = f32(rng, B, T, mask=mask)
    blp = None if is_clip is None else olp + f32(rng, B, T, scale=0.3)
    want, want_aux = ref_policy(lp, olp, adv, lengths, 0.2, agg, blp, is_clip)
    weight = None
    if blp is not None:  # tis (ppo.off_policy_correction): its weight and its metric
        ppo = PPOConfig(off_policy_correction="tis", importance_clip=is_clip)
        weight = correction_weight(ppo, j(olp), j(blp), j(mask))
        (metric,) = correction_metrics(ppo, j(olp), j(blp), j(mask)).values()
        np.testing.assert_allclose(metric, want_aux.pop("is_weight_mean"), **TOL)
    loss, aux = policy_loss(j(lp), j(olp), j(adv), j(mask), 0.2, agg, weight)
    np.testing.assert_allclose(loss, want, **TOL)
    assert set(aux) == set(want_aux)
    for key, value in want_aux.items():
        np.testing.assert_allclose(aux[key], value, **TOL, err_msg=key)


def test_policy_loss_gradient_is_zero_where_clip_is_active():
    # eps=0.2. Token 0: r=1.5, A>0 and token 1: r=0.5, A<0 take the (constant) clipped
    # branch. Token 2: r=1.1 is inside the clip. Token 3: r=1.5, A<0 keeps the unclipped
    # branch. Token 4 is padding. d/dlogp of -A*r/N is -A*r/N with N=4 valid tokens.
    olp = jnp.zeros((1, 5), jnp.float32)
    lp = jnp.log(jnp.array([[1.5, 0.5, 1.1, 1.5, 3.0]], jnp.float32))
    adv = j(np.array([[1.0, -1.0, 1.0, -1.0, 1.0]], np.float32))
    mask = j(np.array([[1, 1, 1, 1, 0]], bool))
    grad = jax.grad(lambda x: policy_loss(x, olp, adv, mask, 0.2)[0])(lp)
    np.testing.assert_allclose(grad, [[0.0, 0.0, -1.1 / 4, 1.5 / 4, 0.0]], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_value_loss_matches_reference(seed, agg):
    rng, lengths, mask = batch(seed)
    old = f32(rng, B, T, mask=mask)
    values = old + f32(rng, B, T, scale=0.3)
    returns = f32(rng, B, T, mask=mask)
    eps = 0.2
    per, clip_used = [], []
    for b in range(B):
        per.append([])
        for t in range(lengths[b]):
            v, vo, r = float(values[b, t]), float(old[b, t]), float(returns[b, t])
            v_clip = vo + min(max(v - vo, -eps), eps)
            per[b].append(max((v - r) ** 2, (v_clip - r) ** 2))
            clip_used.append(float((v_clip - r) ** 2 > (v - r) ** 2))
    loss, aux = value_loss(j(values), j(old), j(returns), j(mask), eps, agg)
    np.testing.assert_allclose(loss, 0.5 * ref_aggregate(per, lengths, agg), **TOL)
    np.testing.assert_allclose(aux["vf_clipfrac"], np.mean(clip_used), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_matches_reference(seed):
    rng, lengths, mask = batch(seed)
    logits = f32(rng, B, T, V, scale=2.0)
    logits[~mask] = np.nan
    logits[..., 0] = -np.inf  # a banned vocabulary entry: p = 0 must contribute 0
    want = np.zeros((B, T))
    for b in range(B):
        for t in range(lengths[b]):
            z = [float(v) for v in logits[b, t]]
            zmax = max(z)
            norm = sum(math.exp(v - zmax) for v in z)
            probs = [math.exp(v - zmax) / norm for v in z]
            want[b, t] = -sum(p * math.log(p) for p in probs if p > 0)
    entropy, mean = entropy_from_logits(j(logits), j(mask))
    np.testing.assert_allclose(entropy, want, **TOL)
    np.testing.assert_allclose(mean, want[mask].mean(), **TOL)


# ----------------------------------------------------------------------------- KL control
def test_adaptive_kl_controller_by_hand():
    ctl = make_kl_controller(0.1, adaptive=True, target_kl=6.0, horizon=10000)
    assert isinstance(ctl, AdaptiveKLController)
    # KL 7 > 6: e = 7/6 - 1 = 1/6; beta = 0.1 * (1 + (1/6) * 256 / 10000) = 0.100426667
    np.testing.assert_allclose(ctl.update(7.0, 256).value, 0.1004266667, rtol=1e-6)
    # KL 3 < 6: e = clip(-0.5) = -0.2; beta = 0.1 * (1 - 0.2 * 256 / 10000) = 0.099488
    np.testing.assert_allclose(ctl.update(3.0, 256).value, 0.099488, rtol=1e-6)
    # KL 100: e = clip(15.67) = 0.2; beta = 0.1 * 1.00512. Also runs under jit.
    jitted = jax.jit(lambda c, kl: c.update(kl, 256))(ctl, jnp.float32(100.0))
    np.testing.assert_allclose(jitted.value, 0.100512, rtol=1e-6)


def test_fixed_kl_controller_and_factory():
    ctl = make_kl_controller(0.05)
    assert isinstance(ctl, FixedKLController)
    np.testing.assert_allclose(ctl.update(100.0, 256).value, 0.05, rtol=1e-7)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller(0.05, adaptive=True)
