"""The off-policy corrections (``ppo.off_policy_correction``): their weights against NumPy,
verl's geometric rejection (transcribed in NumPy) and TRL 1.9.0's own IS code; the loss they
weight against ``GRPOTrainer._compute_loss``; their metrics; and the update with none equal,
bit for bit, to one whose MIS band keeps every sequence.

TRL's IS ratio is computed inline in ``GRPOTrainer._generate_and_score_completions``: its lines
are cut from TRL's source between anchors and run on torch tensors (as
``tests/test_grpo_trl_parity.py`` runs its advantage lines). TRL's ``sequence_mask`` takes the
sequence's summed log-ratio (a product of token ratios); fed each row's log-probs divided by
its length, its sum is our mean, so its band decision is verl's geometric one.
"""

import dataclasses
import inspect
import textwrap
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import PPOConfig
from oppo_jax.ppo.losses import TokenWeights
from oppo_jax.ppo.off_policy import correction_metrics, correction_weight
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.update import init_train_state
from tests.padded_update import ppo_update
from tests.ppo_fixtures import make_spec, random_batch, tiny_params
from tests.test_grpo_trl_parity import (
    LOSS_TYPES,
    LossStub,
    check_close,
    grpo_config,
    loss_case,
    our_loss,
    trl_loss,
)

TOL = dict(atol=1e-6, rtol=1e-6)
BAND = (0.8, 1.25)


@pytest.fixture(scope="module")
def trl():
    import torch
    from trl.trainer import grpo_trainer, rloo_trainer

    return SimpleNamespace(grpo=grpo_trainer, rloo=rloo_trainer, torch=torch)


def _stale_case(seed: int, rows: int = 10, width: int = 7):
    """[rows, width] old and behaviour log-probs: each row a carried prefix of random length
    whose behaviour log-probs differ from the old ones by N(0, 0.5), then fresh tokens (equal)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, rows)
    lengths[0] = 0  # a row without tokens
    mask = np.arange(width)[None] < lengths[:, None]
    old = (-np.abs(rng.normal(1.0, 0.6, (rows, width)))).astype(np.float32)
    prefix = np.arange(width)[None] < rng.integers(0, width + 1, rows)[:, None]
    behaviour = (old + prefix * rng.normal(0.0, 0.5, (rows, width))).astype(np.float32)
    return old, behaviour, mask


def numpy_weights(kind, old, behaviour, mask, clip=2.0, band=BAND):
    """The weights in float64 NumPy: tis min(ρ_t, clip); mis verl's geometric rejection
    (rollout_rs "geometric": exp of the clamped masked mean, kept inside the closed band)."""
    log_rho = np.where(mask, old.astype(np.float64) - behaviour, 0.0)
    if kind == "tis":
        return np.where(mask, np.minimum(np.exp(log_rho), clip), 0.0)
    mean = log_rho.sum(1) / np.maximum(mask.sum(1), 1)
    ratio = np.exp(np.clip(mean, -20.0, 20.0))
    keep = (ratio >= band[0]) & (ratio <= band[1])
    return np.where(mask, keep[:, None], 0.0)


def _ppo(kind, **kw):
    return PPOConfig(off_policy_correction=kind, mis_lower=BAND[0], mis_upper=BAND[1], **kw)


def ours(ppo, old, behaviour, mask, weights=None):
    """``correction_weight`` of host arrays (NumPy, as a [B, R] or packed [N] layout)."""
    w = correction_weight(ppo, *map(jnp.asarray, (old, behaviour, mask)), weights)
    return None if w is None else np.asarray(w)


@pytest.mark.parametrize("kind", ["tis", "mis"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_equal_numpy_padded_and_packed(kind, seed):
    old, behaviour, mask = _stale_case(seed)
    want = numpy_weights(kind, old, behaviour, mask)
    np.testing.assert_allclose(ours(_ppo(kind), old, behaviour, mask), want, **TOL)
    if kind == "mis":  # the case holds both kept and masked sequences
        assert {0.0, 1.0} <= set(want[mask.any(1), 0])
    # Packed: the valid tokens in shuffled slots, each slot's sequence id its row.
    rows, cols = np.nonzero(mask)
    order = np.random.default_rng(seed).permutation(len(rows))
    rows, cols = rows[order], cols[order]
    seg = TokenWeights(loss=jnp.zeros(len(rows)), mean=jnp.zeros(len(rows)),
                       segments=jnp.asarray(rows, jnp.int32), num_segments=len(mask))  # fmt: skip
    packed = ours(_ppo(kind), old[rows, cols], behaviour[rows, cols], np.ones(len(rows), bool), seg)
    np.testing.assert_allclose(packed, want[rows, cols], **TOL)


def test_none_has_no_weight_and_fresh_tokens_weigh_one():
    old, _, mask = _stale_case(3)
    assert ours(PPOConfig(), old, old, mask) is None
    for kind in ("tis", "mis"):
        np.testing.assert_array_equal(ours(_ppo(kind), old, old, mask), mask.astype(np.float32))


def _trl_is_block(trl):
    """TRL's lines that turn old and sampling log-probs into ``vllm_importance_sampling_ratio``."""
    func = trl.grpo.GRPOTrainer._generate_and_score_completions
    lines = inspect.getsource(func).splitlines()
    first = "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask"
    starts = [i for i, line in enumerate(lines) if first in line]
    ends = [i for i, line in enumerate(lines) if "Unknown vLLM importance sampling level" in line]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], "TRL's anchors moved"
    source = textwrap.dedent("\n".join(lines[starts[0] : ends[0] + 2]))  # + the raise's ")"
    return compile(source, "<trl IS ratio>", "exec")


def trl_is_ratio(trl, mode, old, behaviour, mask, clip_min=None, clip_max=None):
    """TRL 1.9.0's vLLM IS ratio ([B, T] token modes, [B, 1] sequence modes)."""
    torch = trl.torch
    stub = SimpleNamespace(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    namespace = {
        **vars(trl.grpo),
        "self": stub,
        "mask": torch.from_numpy(mask.astype(np.float32)),
        "old_per_token_logps": torch.from_numpy(old.astype(np.float32)),
        "sampling_per_token_logps": torch.from_numpy(behaviour.astype(np.float32)),
    }
    exec(_trl_is_block(trl), namespace)
    return namespace["vllm_importance_sampling_ratio"].numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tis_is_trl_token_truncate_and_mis_is_its_sequence_mask_on_the_mean(trl, seed):
    old, behaviour, mask = _stale_case(seed)
    tis = ours(_ppo("tis"), old, behaviour, mask)
    want = trl_is_ratio(trl, "token_truncate", old, behaviour, mask, clip_max=2.0)
    np.testing.assert_allclose(tis[mask], want[mask], **TOL)
    # sequence_mask sums the log-ratio: each row divided by its length sums to our mean.
    n = np.maximum(mask.sum(1, keepdims=True), 1)
    ratio = trl_is_ratio(trl, "sequence_mask", old / n, behaviour / n, mask, *BAND)
    mis = ours(_ppo("mis"), old, behaviour, mask)
    np.testing.assert_array_equal(mis, np.where(mask, ratio > 0, 0.0))


@pytest.mark.parametrize("kind", ["tis", "mis"])
@pytest.mark.parametrize("agg", list(LOSS_TYPES))
def test_the_weighted_loss_matches_trl_compute_loss(trl, kind, agg):
    """Our packed GRPO loss with the correction against ``GRPOTrainer._compute_loss`` given
    TRL's IS ratio (tis: its token_truncate at C_max 2; mis: the 0/1 mask, TRL's
    sequence_mask decision as above): loss and gradients within 1e-6."""
    ppo = dataclasses.replace(grpo_config(agg, 0.04, 0.28, accum=2), off_policy_correction=kind)
    ppo = dataclasses.replace(ppo, mis_lower=BAND[0], mis_upper=BAND[1])
    case = loss_case(seed=5, accum=2, on_policy=False)
    rng = np.random.default_rng(6)
    prefix = np.arange(case.mask.shape[1])[None] < rng.integers(0, 8, len(case.mask))[:, None]
    case.behaviour = (case.old + prefix * rng.normal(0, 0.5, case.mask.shape)).astype(np.float32)
    if kind == "tis":
        case.is_ratio = trl_is_ratio(trl, "token_truncate", case.old, case.behaviour, case.mask,
                                     clip_max=ppo.importance_clip)  # fmt: skip
    else:
        n = np.maximum(case.mask.sum(1, keepdims=True), 1)
        seq = trl_is_ratio(trl, "sequence_mask", case.old / n, case.behaviour / n, case.mask, *BAND)
        assert 0 < (seq > 0).sum() < len(seq)  # some sequences kept, some masked
        case.is_ratio = np.broadcast_to(seq > 0, case.mask.shape).astype(np.float32)
    stub = LossStub(LOSS_TYPES[agg], 0.04, (0.2, 0.28), 2)
    stub.use_vllm = stub.vllm_importance_sampling_correction = True
    want = trl_loss(trl, case, stub, on_policy=False)
    check_close(our_loss(ppo, case, 0.04, seed=5), want)
    case.is_ratio = None  # and the correction changes the loss
    assert abs(trl_loss(trl, case, LossStub(LOSS_TYPES[agg], 0.04, (0.2, 0.28), 2), False)[0]
               - want[0]) > 1e-4  # fmt: skip


@pytest.mark.parametrize("kind", ["tis", "mis"])
def test_metrics_equal_numpy(kind):
    old, behaviour, mask = _stale_case(4, rows=12)
    w = numpy_weights(kind, old, behaviour, mask)
    arrays = tuple(map(jnp.asarray, (old, behaviour, mask)))
    got = {k: float(v) for k, v in correction_metrics(_ppo(kind), *arrays).items()}
    want = {"is_weight_mean": w[mask].mean()}
    if kind == "mis":
        masked = (w == 0) & mask
        want["is_masked_token_frac"] = masked[mask].mean()
        has = mask.any(1)
        want["is_masked_seq_frac"] = masked.any(1)[has].mean()
        assert 0 < want["is_masked_seq_frac"] < 1
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
    assert correction_metrics(PPOConfig(), *arrays) == {}


def _updates(ppo: PPOConfig, padded: bool = False):
    spec = make_spec(ppo)
    actor, critic = tiny_params()
    batch = random_batch(spec, actor, critic)
    state = init_train_state(spec, actor, critic)
    copy = jax.tree.map(jnp.copy, state)
    if padded:
        return jax.jit(lambda s, b: ppo_update(spec, s, b, jax.random.key(3), 0.05))(copy, batch)
    return make_update(spec)(copy, batch, jax.random.key(3), jnp.float32(0.05))


BASE = dict(ppo_epochs=2, num_minibatches=2, grad_accum_steps=2, entropy_coef=0.01)


def test_mis_keeping_every_sequence_is_the_uncorrected_update_bit_for_bit():
    none_state, none_metrics = _updates(PPOConfig(**BASE))
    wide = PPOConfig(**BASE, off_policy_correction="mis", mis_lower=0.0, mis_upper=1e30)
    state, metrics = _updates(wide)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(none_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(metrics.pop("is_masked_seq_frac")) == 0.0 and float(metrics["is_weight_mean"]) == 1
    metrics.pop("is_weight_mean"), metrics.pop("is_masked_token_frac")
    assert {k: float(v) for k, v in metrics.items()} == {
        k: float(v) for k, v in none_metrics.items()
    }


def test_mis_packed_update_equals_the_padded_oracle():
    """random_batch's behaviour is π_old + N(0, 0.05): a band of ±1% masks some sequences."""
    ppo = PPOConfig(**BASE, off_policy_correction="mis", mis_lower=0.99, mis_upper=1.01)
    state, metrics = _updates(ppo)
    want_state, want = _updates(ppo, padded=True)
    assert 0 < float(metrics["is_masked_seq_frac"]) < 1
    for k in ("is_weight_mean", "is_masked_seq_frac", "is_masked_token_frac"):
        assert float(metrics[k]) == float(want[k]), k
    for k in ("policy_loss", "clipfrac", "entropy"):
        assert float(metrics[k]) == pytest.approx(float(want[k]), rel=1e-4, abs=1e-6), k
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # and the mask matters: the update differs from the uncorrected one
    none_state, _ = _updates(PPOConfig(**BASE))
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in
             zip(jax.tree.leaves(state.actor_params), jax.tree.leaves(none_state.actor_params),
                 strict=True)]  # fmt: skip
    assert max(moved) > 1e-6
