"""The GRPO family against TRL 1.9.0's own code, within 1e-6 (float32 on both sides).

Advantages: the lines of ``GRPOTrainer._generate_and_score_completions`` and
``RLOOTrainer._generate_and_score_completions`` that turn rewards into advantages, cut from
TRL's source between anchor lines and run on torch tensors (an anchor TRL no longer has fails
the test). Losses: ``GRPOTrainer._compute_loss`` itself, called unbound on a stub holding only
the attributes it reads, its per-token log-prob function returning given log-probs; the
microbatches' losses summed as the Trainer's accumulation sums them, against
``update.actor_objective`` on one packed chunk (``packing.token_weights``) divided by A as our
accumulation divides. Values and gradients w.r.t. the log-probs. REINFORCE++ has no TRL
trainer: NumPy.

Loss types: our token_mean = TRL bnpo, seq_mean = grpo, dr_grpo = dr_grpo, dapo = dapo.
Sequence-level ratios (``ppo.importance_sampling_level``): ``sequence`` against
``GRPOTrainer._compute_loss`` with importance_sampling_level "sequence" (GSPO) and against
TRL's experimental GSPO-token trainer (its stop-gradient form, "sequence_token");
``sequence_sum`` with seq_mean against ``RLOOTrainer._compute_loss``.
"""

import dataclasses
import importlib.util
import inspect
import textwrap
import warnings
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config.schema import PPOConfig
from oppo_jax.ppo.estimators import sequence_advantages, token_advantages
from oppo_jax.ppo.losses import TokenWeights
from oppo_jax.ppo.packing import token_weights
from oppo_jax.ppo.update import actor_objective

# Looked up, not imported: importing trl and torch at collection would cost every test worker
# seconds. TRL's GRPO and RLOO trainers import requests (its vLLM client), which trl does not
# declare.
for _module in ("trl", "torch", "requests"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_module} is not installed (the peers extra)", allow_module_level=True)

TOL = dict(atol=1e-6, rtol=1e-6)
LOSS_TYPES = {"token_mean": "bnpo", "seq_mean": "grpo", "dr_grpo": "dr_grpo", "dapo": "dapo"}
R = 8  # max_response_len = TRL's max_completion_length
M = 3  # sequences per microbatch (TRL's per_device_train_batch_size)


@pytest.fixture(scope="module")
def trl():
    """TRL's trainer modules (GSPO-token's experimental one too), and torch."""
    import torch
    from trl.trainer import grpo_trainer, rloo_trainer

    with warnings.catch_warnings():  # "APIs here are unstable": the test pins TRL 1.9.0's
        warnings.simplefilter("ignore")
        from trl.experimental.gspo_token import grpo_trainer as gspo_token

    return SimpleNamespace(grpo=grpo_trainer, rloo=rloo_trainer, gspo_token=gspo_token, torch=torch)


# ------------------------------------------------------------------------------ advantages
def _trl_block(func, first: str, last: str):
    """TRL's own lines of ``func``, from the one holding ``first`` to the next holding
    ``last``, dedented and compiled to run on given variables."""
    lines = inspect.getsource(func).splitlines()
    starts = [i for i, line in enumerate(lines) if first in line]
    assert len(starts) == 1, f"anchor {first!r}: {len(starts)} matches in {func.__qualname__}"
    ends = [i for i in range(starts[0], len(lines)) if last in lines[i]]
    assert ends, f"anchor {last!r} not found after {first!r} in {func.__qualname__}"
    source = textwrap.dedent("\n".join(lines[starts[0] : ends[0] + 1]))
    return compile(source, f"<trl {func.__qualname__}>", "exec")


def _run_block(module, func, anchors, **variables):
    """Run TRL's block of ``func`` in its module's namespace; returns its ``advantages``."""
    namespace = {**vars(module), "device": module.torch.device("cpu"), **variables}
    exec(_trl_block(func, *anchors), namespace)
    return namespace["advantages"].numpy()


GRPO_ANCHORS = (
    'if self.multi_objective_aggregation == "sum_then_normalize":',
    "advantages = torch.nan_to_num(advantages, nan=0.0)",
)
RLOO_ANCHORS = (
    "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
    "advantages = torch.nan_to_num(advantages, nan=0.0)",
)


def trl_grpo_advantages(trl, rewards: np.ndarray, group_size: int, scale: str) -> np.ndarray:
    """GRPOTrainer's advantages of one reward function's scores [B] (float32)."""
    torch = trl.torch
    stub = SimpleNamespace(
        multi_objective_aggregation="sum_then_normalize",
        scale_rewards=scale,
        reward_weights=torch.ones(1),
    )
    per_func = torch.from_numpy(rewards.astype(np.float32))[:, None]
    return _run_block(
        trl.grpo,
        trl.grpo.GRPOTrainer._generate_and_score_completions,
        GRPO_ANCHORS,
        self=stub,
        rewards_per_func=per_func,
        unscorable_mask=torch.isnan(per_func).all(dim=1),
        num_generations=group_size,
    )


def trl_rloo_advantages(trl, rewards: np.ndarray, group_size: int, kl=None) -> np.ndarray:
    """RLOOTrainer's advantages (normalize_advantages False, its default); ``kl`` =
    (beta, old_logp [B, T], ref_logp [B, T], mask [B, T]) puts its sequence KL in the reward."""
    torch = trl.torch
    beta, old, ref, mask = kl if kl is not None else (0.0, None, None, None)
    stub = SimpleNamespace(
        reward_weights=torch.ones(1),
        reward_clip_range=None,
        beta=beta,
        normalize_advantages=False,
    )
    per_func = torch.from_numpy(rewards.astype(np.float32))[:, None]
    tensors = {"old_per_token_logps": old, "ref_per_token_logps": ref, "completion_mask": mask}
    return _run_block(
        trl.rloo,
        trl.rloo.RLOOTrainer._generate_and_score_completions,
        RLOO_ANCHORS,
        self=stub,
        rewards_per_func=per_func,
        unscorable_mask=torch.isnan(per_func).all(dim=1),
        num_generations=group_size,
        **{k: None if v is None else torch.from_numpy(v) for k, v in tensors.items()},
    )


def group_rewards(seed: int, groups: int, group_size: int) -> np.ndarray:
    """[groups·G] scores: continuous groups, one binary group and one tied group (std 0)."""
    rng = np.random.default_rng(seed)
    r = rng.normal(0.3, 1.5, (groups, group_size))
    r[1] = rng.integers(0, 2, group_size)
    r[1, :2] = (0.0, 1.0)  # both values present
    r[2] = 0.75  # every response scores the same: A = 0 / (0 + 1e-4)
    return r.reshape(-1).astype(np.float32)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed,groups,group_size", [(0, 4, 4), (1, 3, 2), (2, 3, 8)])
def test_grpo_advantages_match_trl(trl, scale, seed, groups, group_size):
    rewards = group_rewards(seed, groups, group_size)
    want = trl_grpo_advantages(trl, rewards, group_size, scale)
    got = sequence_advantages(jnp.asarray(rewards), group_size, "grpo", scale)
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


@pytest.mark.parametrize("seed,groups,group_size", [(0, 4, 4), (1, 3, 2), (2, 3, 8)])
def test_rloo_advantages_match_trl(trl, seed, groups, group_size):
    rewards = group_rewards(seed, groups, group_size)
    want = trl_rloo_advantages(trl, rewards, group_size)
    got = sequence_advantages(jnp.asarray(rewards), group_size, "rloo")
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_rloo_with_kl_in_reward_matches_trl(trl):
    """RLOO (beta > 0) subtracts beta · Σ_t (old_logp − ref_logp) from each score first;
    ours, given those penalised scores, gives RLOO's advantages."""
    rng = np.random.default_rng(3)
    group_size, beta = 4, 0.05
    rewards = group_rewards(3, 3, group_size)
    lengths = rng.integers(1, R + 1, rewards.size)
    mask = (np.arange(R)[None] < lengths[:, None]).astype(np.int64)
    old = (-np.abs(rng.normal(1.0, 0.5, mask.shape))).astype(np.float32)
    ref = (old + rng.normal(0.0, 0.3, mask.shape)).astype(np.float32)
    want = trl_rloo_advantages(trl, rewards, group_size, (beta, old, ref, mask))
    assert not np.allclose(want, trl_rloo_advantages(trl, rewards, group_size), atol=1e-3)
    penalised = rewards - beta * np.sum((old - ref) * mask, axis=1, dtype=np.float32)
    got = sequence_advantages(jnp.asarray(penalised), group_size, "rloo")
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


@pytest.mark.parametrize("estimator,scale", [("grpo", "group"), ("rloo", "group")])
def test_token_advantages_spread_sequence_advantages(estimator, scale):
    rng = np.random.default_rng(4)
    rewards = group_rewards(4, 3, 4)
    mask = np.arange(R)[None] < rng.integers(1, R + 1, rewards.size)[:, None]
    per_seq = np.asarray(sequence_advantages(jnp.asarray(rewards), 4, estimator, scale))
    got = token_advantages(jnp.asarray(rewards), jnp.asarray(mask), 4, estimator, scale)
    np.testing.assert_array_equal(np.asarray(got), np.where(mask, per_seq[:, None], 0.0))


@pytest.mark.parametrize("seed,group_size", [(0, 4), (1, 2), (2, 8)])
def test_reinforce_pp_matches_numpy(seed, group_size):
    """REINFORCE++ (group baseline): r − group mean on each valid token, whitened over all
    valid tokens of the batch (unbiased variance, + 1e-8 under the root), 0 on padding."""
    rng = np.random.default_rng(seed)
    rewards = group_rewards(seed, 3, group_size)
    mask = np.arange(R)[None] < rng.integers(1, R + 1, rewards.size)[:, None]
    r = rewards.astype(np.float64).reshape(-1, group_size)
    centred = (r - r.mean(axis=1, keepdims=True)).reshape(-1)
    tokens = np.broadcast_to(centred[:, None], mask.shape)[mask]
    whitened = (tokens - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8)
    want = np.zeros(mask.shape)
    want[mask] = whitened
    got = token_advantages(jnp.asarray(rewards), jnp.asarray(mask), group_size, "reinforce_pp")
    np.testing.assert_allclose(np.asarray(got), want, **TOL)
    np.testing.assert_allclose(
        np.asarray(sequence_advantages(jnp.asarray(rewards), group_size, "reinforce_pp")),
        centred,
        **TOL,
    )


# ------------------------------------------------------------------------------ losses
class LossStub:
    """What ``GRPOTrainer._compute_loss`` reads, and nothing more (a new read fails loudly).
    Its per-token log-prob function returns ``self.logps`` / ``self.entropies``."""

    def __init__(self, loss_type, beta, eps, grad_accum, entropy_coef=0.0, level="token"):
        self.loss_type, self.beta, self.max_completion_length = loss_type, beta, R
        self.epsilon_low, self.epsilon_high = eps
        self.current_gradient_accumulation_steps = grad_accum
        self.top_entropy_quantile, self.aux_loss_enabled = 1.0, False
        self.off_policy_mask_threshold, self.importance_sampling_level = None, level
        self.use_vllm, self.vllm_importance_sampling_correction = False, False
        self._entropy_bonus_enabled = entropy_coef != 0.0
        self.entropy_coef, self.use_adaptive_entropy = entropy_coef, False
        self.args = SimpleNamespace(delta=None, use_bias_correction_kl=False)
        self.model = SimpleNamespace(training=True)
        self.accelerator = SimpleNamespace(
            num_processes=1,
            sync_gradients=True,
            gather=lambda x: x.reshape(-1),
            reduce=lambda x, reduction: x,
        )
        self._metrics = defaultdict(lambda: defaultdict(list))
        self.logps = self.entropies = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, mask, logits_to_keep, **kw):
        assert self.logps.shape == (input_ids.shape[0], logits_to_keep)
        return self.logps, self.entropies, None


def loss_case(seed: int, accum: int, on_policy: bool, drift_std: float = 0.3):
    """A minibatch of ``accum`` x M sequences, lengths 1..R-1 (padded to the longest, as TRL
    pads), and its microbatches: random rows [A, M]; π_old is π_θ moved by N(0, ``drift_std``)
    per token."""
    rng = np.random.default_rng(seed)
    n = accum * M
    lengths = rng.integers(1, R, n)
    width = int(lengths.max())
    mask = np.arange(width)[None] < lengths[:, None]
    logp = (-np.abs(rng.normal(1.0, 0.6, (n, width)))).astype(np.float32)
    drift = 0.0 if on_policy else rng.normal(0.0, drift_std, (n, width))
    return SimpleNamespace(
        lengths=lengths,
        mask=mask,
        logp=logp,
        old=(logp + drift).astype(np.float32),  # π_old (= logp when μ = 1: TRL detaches)
        ref=(logp + rng.normal(0.0, 0.2, (n, width))).astype(np.float32),
        entropy=np.abs(rng.normal(2.0, 0.5, (n, width))).astype(np.float32),
        advantages=rng.normal(0.0, 1.0, n).astype(np.float32),
        micro=rng.permutation(n).reshape(accum, M),
    )


def trl_loss(trl, case, stub: LossStub, on_policy: bool, trainer=None, exact=False):
    """TRL's accumulated loss (Σ over microbatches of ``trainer._compute_loss``, GRPOTrainer's
    by default) and its gradients w.r.t. the log-probs [n, T] and the entropies [n, T].
    RLOOTrainer's loss is unscaled and the HF Trainer divides it by the accumulation steps
    (the comment above its aux loss): so is it here. ``exact``: TRL's code on the same values
    in float64."""
    torch = trl.torch
    trainer = trainer or trl.grpo.GRPOTrainer
    divide = len(case.micro) if trainer is trl.rloo.RLOOTrainer else 1

    def tensor(x, **kw):
        return torch.tensor(x.astype(np.float64 if exact else np.float32), **kw)

    logp = tensor(case.logp, requires_grad=True)
    entropy = tensor(case.entropy, requires_grad=True)
    completion_mask = torch.from_numpy(case.mask.astype(np.int64))
    num_items = completion_mask.sum()  # the generation batch's: all A microbatches
    total = 0.0
    for rows in case.micro:
        rows_t = torch.from_numpy(rows)
        stub.logps, stub.entropies = logp[rows_t], entropy[rows_t]
        inputs = {
            "prompt_ids": torch.ones(len(rows), 2, dtype=torch.long),
            "prompt_mask": torch.ones(len(rows), 2, dtype=torch.long),
            "completion_ids": torch.ones(len(rows), case.mask.shape[1], dtype=torch.long),
            "completion_mask": completion_mask[rows_t],
            "advantages": tensor(case.advantages[rows]),
            "ref_per_token_logps": tensor(case.ref[rows]),
            "num_items_in_batch": num_items,
        }
        if not on_policy:
            inputs["old_per_token_logps"] = tensor(case.old[rows])
        if getattr(case, "is_ratio", None) is not None:  # TRL's vLLM IS ratio (its correction)
            inputs["importance_sampling_ratio"] = tensor(case.is_ratio[rows])
        if trainer is trl.rloo.RLOOTrainer:  # its sequences' old log-probs, as it sums them
            inputs["old_logps"] = (tensor(case.old[rows]) * inputs["completion_mask"]).sum(1)
        total = total + trainer._compute_loss(stub, None, inputs) / divide
    total.backward()
    grads = [
        np.zeros_like(x) if t.grad is None else t.grad.numpy()
        for x, t in ((case.logp, logp), (case.entropy, entropy))
    ]
    return total.item(), *grads


def our_loss(ppo: PPOConfig, case, kl_coef: float, seed: int):
    """Our accumulated loss on the packed layout: every valid token of the minibatch in one
    chunk, in shuffled slot order with unused slots after, weighted by ``token_weights``, each
    slot's sequence its row (n for the unused ones, as ``PackIndices.resp_seg``); divided by A
    as the update divides. Gradients mapped back to [n, T]."""
    rng = np.random.default_rng(seed + 100)
    rows, cols = np.nonzero(case.mask)
    order = rng.permutation(len(rows))
    rows, cols = rows[order], cols[order]
    unused = 5
    loss_w, mean_w = token_weights(case.lengths, case.micro, ppo.loss_agg, R)

    def slots(x, fill):
        return jnp.asarray(np.concatenate([x[rows, cols], np.full(unused, fill, x.dtype)]))

    def slot_weights(w):
        return jnp.asarray(np.concatenate([w[rows], np.zeros(unused, w.dtype)]))

    per_seq = np.broadcast_to(case.advantages[:, None], case.mask.shape)
    mb = SimpleNamespace(
        old_logp=slots(case.old, 3.0),
        behaviour_logp=slots(getattr(case, "behaviour", case.old), 3.0),
        ref_logp=slots(case.ref, -7.0),
        advantages=slots(per_seq, 9.0),
        mask=slots(case.mask, False),
    )
    n = len(case.lengths)
    weights = TokenWeights(
        loss=slot_weights(loss_w),
        mean=slot_weights(mean_w),
        segments=jnp.asarray(np.concatenate([rows, np.full(unused, n)]), jnp.int32),
        num_segments=n + 1,
    )

    def loss(logp, entropy):
        value, _ = actor_objective(ppo, logp, entropy, mb, kl_coef, weights)
        return value / ppo.grad_accum_steps

    value, (g_logp, g_entropy) = jax.value_and_grad(loss, argnums=(0, 1))(
        slots(case.logp, 5.0), slots(case.entropy, 4.0)
    )
    grads = []
    for g in (g_logp, g_entropy):
        assert np.all(np.asarray(g)[-unused:] == 0.0)  # unused slots take no gradient
        full = np.zeros(case.mask.shape, np.float32)
        full[rows, cols] = np.asarray(g)[:-unused]
        grads.append(full)
    return float(value), *grads


def check_close(got, want):
    """(loss, d/dlogp, d/dentropy) within 1e-6: the loss absolutely, the gradients relative to
    the largest one (they are small: 1 / tokens); returns the loss's and the largest gradient's
    absolute differences."""
    np.testing.assert_allclose(got[0], want[0], **TOL)
    for mine, theirs in zip(got[1:], want[1:], strict=True):
        scale = max(np.abs(theirs).max(), 1e-30)
        np.testing.assert_allclose(mine / scale, theirs / scale, atol=1e-6)
    grads = zip(got[1:], want[1:], strict=True)
    return abs(got[0] - want[0]), max(np.abs(a - b).max() for a, b in grads)


def grpo_config(agg, beta, eps_high, accum, entropy_coef=0.0, level="token") -> PPOConfig:
    """GRPOTrainer's setting as our keys: k3 in the loss, ε_low 0.2."""
    return PPOConfig(
        advantage="grpo",
        importance_sampling_level=level,
        loss_agg=agg,
        kl_coef=beta,
        kl_estimator="k3",
        kl_in_reward=False,
        cliprange=0.2,
        cliprange_high=eps_high,
        entropy_coef=entropy_coef,
        grad_accum_steps=accum,
    )


def compare(trl, agg, beta, eps_high, accum, on_policy, seed, entropy_coef=0.0, level="token"):
    """Our packed loss and gradients against TRL's, for one setting."""
    ppo = grpo_config(agg, beta, eps_high, accum, entropy_coef, level)
    case = loss_case(seed, accum, on_policy, drift_std=0.3 if level == "token" else 0.6)
    stub = LossStub(LOSS_TYPES[agg], beta, (0.2, eps_high or 0.2), accum, entropy_coef, level)
    check_close(our_loss(ppo, case, beta, seed), trl_loss(trl, case, stub, on_policy))
    return case


@pytest.mark.parametrize("agg", list(LOSS_TYPES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("accum", [1, 2])
def test_loss_matches_trl_compute_loss(trl, agg, beta, eps_high, accum):
    """Off-policy (μ > 1: π_old ≠ π_θ, so ratios leave [1 − ε_low, 1 + ε_high])."""
    case = compare(trl, agg, beta, eps_high, accum, on_policy=False, seed=7 + accum)
    ratio = np.exp(case.logp - case.old)[case.mask]
    assert (ratio > 1.28).any() and (ratio < 0.8).any()  # both clip edges are exercised


@pytest.mark.parametrize("agg", list(LOSS_TYPES))
def test_on_policy_loss_matches_trl(trl, agg):
    """μ = 1: TRL takes π_old = π_θ detached; ours reads π_old = the same numbers."""
    compare(trl, agg, beta=0.04, eps_high=0.28, accum=2, on_policy=True, seed=11)


@pytest.mark.parametrize("agg", list(LOSS_TYPES))
def test_one_epoch_takes_old_from_the_forward_as_trl(trl, agg):
    """One epoch of one minibatch (``PPOConfig.old_is_first_forward``): TRL is given no π_old
    (``per_token_logps.detach()``), and ours is given π_old far from π_θ, which it must not
    read; losses and gradients agree."""
    ppo = dataclasses.replace(grpo_config(agg, 0.04, 0.28, 2), ppo_epochs=1)
    case = loss_case(13, 2, on_policy=True)
    stub = LossStub(LOSS_TYPES[agg], 0.04, (0.2, 0.28), 2, 0.0, "token")
    want = trl_loss(trl, case, stub, on_policy=True)
    case.old = (case.logp + 0.5).astype(np.float32)  # unread: ratios would leave the clip band
    check_close(our_loss(ppo, case, 0.04, 13), want)
    assert not dataclasses.replace(ppo, ppo_epochs=2).old_is_first_forward
    assert not dataclasses.replace(ppo, num_minibatches=2).old_is_first_forward


@pytest.mark.parametrize("agg", list(LOSS_TYPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_parity_across_lengths(trl, agg, seed):
    """Other draws of the lengths and the microbatch split."""
    compare(trl, agg, beta=0.04, eps_high=None, accum=2, on_policy=False, seed=seed)


@pytest.mark.parametrize("agg", ["token_mean", "dapo", "seq_mean", "dr_grpo"])
def test_entropy_bonus_matches_trl(trl, agg):
    """ppo.entropy_coef against TRL's entropy_coef (loss − coef · H)."""
    compare(trl, agg, 0.04, 0.28, 2, on_policy=False, seed=5, entropy_coef=0.01)


# ------------------------------------------------------------------ sequence-level ratios
def sequence_ratios(case, summed: bool) -> np.ndarray:
    """Each sequence's ratio [n]: exp of its mean (or summed) log-ratio."""
    delta = np.where(case.mask, case.logp - case.old, 0.0).sum(axis=1)
    return np.exp(delta if summed else delta / case.lengths)


@pytest.mark.parametrize("agg", list(LOSS_TYPES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("accum", [1, 2])
def test_gspo_matches_trl_sequence_level(trl, agg, beta, accum):
    """importance_sampling_level sequence = GRPOTrainer's "sequence" (GSPO): each sequence's
    ratio exp(mean_t (logp − old_logp)) on every token, clipped, then the loss type's
    aggregation (bnpo, dr_grpo and dapo weigh a sequence by its tokens, as TRL warns)."""
    case = compare(trl, agg, beta, 0.28, accum, False, seed=6, level="sequence")
    ratio = sequence_ratios(case, summed=False)
    assert (ratio > 1.28).any() and (ratio < 0.8).any()  # both clip edges are exercised


@pytest.mark.parametrize("agg", list(LOSS_TYPES))
def test_on_policy_gspo_and_its_entropy_bonus_match_trl(trl, agg):
    """μ = 1 (every ratio 1, the gradient through the sequence's mean), with the entropy bonus."""
    compare(trl, agg, 0.04, 0.28, 2, True, seed=12, entropy_coef=0.01, level="sequence")


@pytest.mark.parametrize("agg", list(LOSS_TYPES))
def test_gspo_equals_trl_gspo_token(trl, agg):
    """TRL's experimental GSPO-token (importance_sampling_level "sequence_token": s_i,t =
    sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)], the paper's stop-gradient form): with one advantage per
    sequence its values and gradients are GSPO's, so ours match it too."""
    ppo = grpo_config(agg, 0.04, 0.28, 2, level="sequence")
    case = loss_case(13, 2, on_policy=False, drift_std=0.6)
    stub = LossStub(LOSS_TYPES[agg], 0.04, (0.2, 0.28), 2, level="sequence_token")
    want = trl_loss(trl, case, stub, False, trl.gspo_token.GRPOTrainer)
    check_close(our_loss(ppo, case, 0.04, 13), want)


def rloo_config(eps_high, accum, level="sequence_sum") -> PPOConfig:
    """RLOOTrainer's setting as our keys: the KL (k1) in the reward, nothing of it in the loss;
    one clipped term per sequence, averaged over the sequences."""
    return PPOConfig(
        advantage="rloo",
        importance_sampling_level=level,
        loss_agg="seq_mean",
        kl_coef=0.05,
        kl_estimator="k1",
        kl_in_reward=True,
        cliprange=0.2,
        cliprange_high=eps_high,
        grad_accum_steps=accum,
    )


@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("on_policy", [False, True])
def test_rloo_sequence_sum_matches_trl_rloo_loss(trl, eps_high, accum, on_policy):
    """importance_sampling_level sequence_sum, loss_agg seq_mean = RLOOTrainer._compute_loss:
    exp(Σ_t logp − Σ_t old_logp) per sequence, clipped, averaged over the sequences; the
    token-level loss ``ppo.advantage: rloo`` trains with by default is not it.

    Held to TRL's code in float64 as the other losses are to its float32: in float32 its two
    sums of ~7 log-probs cancel, which moves its own gradients 1.3e-6 (relative to the largest)
    from their float64 values on these tensors; ours sum the differences (7e-8 at most). To
    TRL's float32: within 1e-6 absolutely."""
    seed = 9
    case = loss_case(seed, accum, on_policy)
    stub = LossStub("rloo", 0.0, (0.2, eps_high or 0.2), accum)
    got = our_loss(rloo_config(eps_high, accum), case, 0.05, seed)
    want = trl_loss(trl, case, stub, on_policy, trl.rloo.RLOOTrainer, exact=True)
    check_close(got, want)
    trl_float32 = trl_loss(trl, case, stub, on_policy, trl.rloo.RLOOTrainer)
    for mine, theirs in zip(got, trl_float32, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    if on_policy:
        return
    ratio = sequence_ratios(case, summed=True)
    assert (ratio > 1.28).any() and (ratio < 0.8).any()  # both clip edges are exercised
    token_level = our_loss(rloo_config(eps_high, accum, "token"), case, 0.05, seed)
    assert abs(token_level[0] - want[0]) > 1e-3
