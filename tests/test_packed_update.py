"""The packed PPO update equals the padded one (the reference): losses, gradients and
parameters after one update, on tiny random Hugging Face Qwen2 and Llama models loaded through
``oppo_jax.load_hf_model``, with ragged and carried rows, minibatches and accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oppo_jax
from oppo_jax.base.shapes import first_fit_decreasing, update_chunk_rows, update_chunks
from oppo_jax.config import OptimConfig, PPOConfig
from oppo_jax.models import init_params
from oppo_jax.parallel.sharding import make_device_groups, make_mesh
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.kernels import build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.step import run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo.experience import ScoredRollout, build_batch
from oppo_jax.ppo.optimizer import make_optimizer
from oppo_jax.ppo.packed_update import make_update, packed_actor_loss, packed_critic_loss
from oppo_jax.ppo.packing import (
    gather_microbatch,
    microbatch_rows,
    packed_shapes,
    plan_packing,
)
from oppo_jax.ppo.update import UpdateSpec, init_train_state
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from tests import tolerances
from tests.hf_fixtures import save_tiny_hf_model
from tests.oracles import critic_values, policy_logprobs
from tests.padded_update import actor_loss, critic_loss, make_padded_update
from tests.ppo_fixtures import (
    ACTOR,
    CRITIC,
    ListPrompts,
    make_spec,
    step_engine,
    step_plan,
    tiny_params,
)

B, P, R = 16, 4, 20  # 4 sequences per microbatch with 2 minibatches x 2 accumulation steps
KL = jnp.float32(0.05)
LR = 1e-3  # the actor's and the critic's
MINIBATCHES = 2  # optimizer steps of one update (1 epoch)


@functools.cache
def _models(model_type: str, root: str):
    """(actor, critic) HFModels saved by transformers and loaded by the project."""
    from pathlib import Path

    base = Path(root) / model_type
    save_tiny_hf_model(base / "actor", model_type, "ForCausalLM", seed=0)
    save_tiny_hf_model(base / "critic", model_type, "ForSequenceClassification", seed=1)
    return oppo_jax.load_hf_model(base / "actor"), oppo_jax.load_hf_model(base / "critic")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("packed_hf"))


def _spec(actor, critic, loss_agg: str, width_factor: int = 1) -> UpdateSpec:
    ppo = PPOConfig(
        ppo_epochs=1, num_minibatches=MINIBATCHES, grad_accum_steps=2, loss_agg=loss_agg,
        entropy_coef=0.01, kl_in_reward=False, off_policy_correction="tis", pack_granule=4,
        pack_width_factor=width_factor,
    )  # fmt: skip
    optim = OptimConfig(actor_lr=LR, critic_lr=LR)
    return UpdateSpec(
        actor.config, critic.config, ppo, 0.7,
        make_optimizer(optim, LR, 10), make_optimizer(optim, LR, 10),
    )  # fmt: skip


def _batch(spec: UpdateSpec, actor_params, critic_params, seed=0, group_size=1, drift=0.0):
    """Ragged rows (prompts 1..P, long-tailed responses 0..R tokens), some carried: their
    first tokens were sampled at an earlier step, so their behaviour log-probs differ from
    this step's old log-probs over that prefix (the importance weight is not 1 there).
    Critic-free (``critic_params`` None): groups of ``group_size`` rows; ``drift``: π_old is
    π_θ moved by N(0, drift) per token, so the first step's ratios are not all 1."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(1, P + 1, B)
    resp_len = (rng.random(B) ** 2 * (R + 1)).astype(int)  # mostly short
    resp_len[:2] = (0, R)  # an empty response and a full one
    tokens = np.zeros((B, P + R), np.int32)
    for b in range(B):
        tokens[b, : prompt_len[b] + resp_len[b]] = rng.integers(3, 96, prompt_len[b] + resp_len[b])
    mask = np.arange(R)[None, :] < resp_len[:, None]
    tokens, prompt_len, mask = map(jnp.asarray, (tokens, prompt_len, mask))
    logp, _ = policy_logprobs(spec.actor, actor_params, tokens, prompt_len, R, spec.temperature)
    values = jnp.zeros((B, R), jnp.float32)
    if critic_params is not None:
        values = critic_values(spec.critic, critic_params, tokens, prompt_len, R)
    carried_prefix = np.where(rng.random(B) < 0.5, rng.integers(1, R + 1, B), 0)
    stale = (np.arange(R)[None, :] < carried_prefix[:, None]) * rng.normal(0, 0.2, (B, R))
    rollout = ScoredRollout(
        tokens, prompt_len, mask,
        scores=jnp.asarray(rng.normal(size=B), jnp.float32),
        ended_with_eos=jnp.asarray(rng.random(B) < 0.7),
        old_logp=logp, behaviour_logp=logp + jnp.asarray(stale, jnp.float32),
        ref_logp=logp + jnp.asarray(rng.normal(0, 0.05, (B, R)), jnp.float32), values=values,
    )  # fmt: skip
    if drift:
        moved = jnp.asarray(rng.normal(0, drift, (B, R)), jnp.float32)
        rollout = rollout.replace(
            old_logp=rollout.old_logp + moved, behaviour_logp=rollout.behaviour_logp + moved
        )
    return build_batch(spec.ppo, rollout, KL, group_size)[0]


def _relative_diff(a, b) -> float:
    """max |a - b| / max |b| over the leaves: how far an update moved the parameters (not a
    comparison of two float32 paths: Adam's per-element steps make that one unbounded by
    rounding; those are tests/tolerances.py's)."""
    # On the host: the trees may live on different devices (a mesh's shards against one
    # device), and a device op mixing them has aborted XLA:CPU after a long module run.
    a, b = jax.device_get((a, b))
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b))
    return max(diffs) / max(float(np.max(np.abs(x))) for x in jax.tree.leaves(b))


def _run(update, spec, actor, critic, batch, key):
    state = init_train_state(spec, actor.params, critic.params)
    return update(jax.tree.map(jnp.copy, state), batch, key, KL)


LOSSES = ("policy_loss", "value_loss", "entropy", "clipfrac", "approx_kl", "is_weight_mean")
GRAD_NORMS = ("actor_grad_norm", "critic_grad_norm")


def _bounds(actor, critic, keys: int | None = None):
    """tests/tolerances.py's bounds of one update: 2 optimizer steps of B / 2 rows of P + R
    tokens, attention over rows of ``keys`` (P + R; wider where packing widens the rows)."""
    cfgs, width = (actor.config, critic.config), P + R
    return tolerances.update_bounds(
        cfgs, (B // MINIBATCHES) * width, keys or width, MINIBATCHES, LR
    )


def assert_updates_agree(actor, critic, got, want, got_state, want_state, bounds) -> dict:
    """Two updates of ``actor`` and ``critic`` from the same state agree within ``bounds``: their
    loss metrics and gradient norms, Adam's moments and the parameters' changes."""
    vocab = actor.config.vocab_size
    tolerances.assert_same_metrics(got, want, LOSSES + GRAD_NORMS, bounds.n, bounds.steps, vocab)
    before = {"actor": actor.params, "critic": critic.params}
    return tolerances.assert_same_update(bounds, before, got_state, want_state)


@pytest.mark.parametrize(
    "model_type,loss_agg,width_factor",
    [
        ("qwen2", "token_mean", 1),
        ("llama", "seq_mean", 1),
        ("qwen2", "seq_mean", 2),  # rows of 2 (P + R): any two sequences share one
        pytest.param("qwen2", "seq_mean", 1, marks=pytest.mark.slow),
        pytest.param("llama", "token_mean", 1, marks=pytest.mark.slow),
    ],
)
def test_packed_update_equals_padded(root, model_type, loss_agg, width_factor):
    actor, critic = _models(model_type, root)
    spec = _spec(actor, critic, loss_agg, width_factor)
    batch, key = _batch(spec, actor.params, critic.params), jax.random.key(7)
    padded, packed = make_padded_update(spec), make_update(spec)
    want_state, want = _run(padded, spec, actor, critic, batch, key)
    got_state, got = _run(packed, spec, actor, critic, batch, key)
    assert got["update_tokens_computed"] < want["update_tokens_computed"]  # it did pack
    plan = packed.plan(batch, key)
    assert plan.shape[1] == width_factor * (P + R)  # P + R = 24, a multiple of the granule
    used = plan.indices.used
    assert used.any(axis=-1).all()
    if width_factor == 1:  # a chunk left idle: the skip is checked (the wide rows fill both)
        assert not used.all()
    assert got["update_tokens_real"] == want["update_tokens_real"]
    assert float(got["skipped_steps"]) == float(want["skipped_steps"]) == 0
    moved = _relative_diff(want_state.actor_params, actor.params)
    assert moved > 1e-4  # the update did something the comparison can see
    bounds = _bounds(actor, critic, keys=width_factor * (P + R))
    assert_updates_agree(actor, critic, got, want, got_state, want_state, bounds)
    # A non-finite batch is skipped the same way: nothing applied, the state bitwise unchanged.
    bad = batch.replace(advantages=batch.advantages.at[3, 0].set(jnp.nan))
    state0 = init_train_state(spec, actor.params, critic.params)
    for update in (padded, packed):
        new, metrics = update(jax.tree.map(jnp.copy, state0), bad, key, KL)
        assert float(metrics["nonfinite_batch"]) == 1 and float(metrics["skipped_steps"]) == 2
        assert int(new.step) == 0 and np.isnan(float(metrics["policy_loss"]))
        leaves = zip(jax.tree.leaves(new.actor_params), jax.tree.leaves(actor.params), strict=True)
        for x, y in leaves:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "level,advantage,loss_agg",
    [("sequence", "grpo", "seq_mean"), ("sequence_sum", "rloo", "seq_mean")],
)
def test_packed_sequence_level_update_equals_padded(root, level, advantage, loss_agg):
    """ppo.importance_sampling_level sequence (GSPO) and sequence_sum (TRL RLOOTrainer's
    summed ratio), critic-free with groups of 4: the packed update's segment sums over each
    sequence's slots equal the padded update's row sums, through one update of 2 optimizer
    steps (the second from moved parameters), with ratios clipped on both sides."""
    actor, _ = _models("qwen2", root)
    ppo = PPOConfig(
        advantage=advantage, importance_sampling_level=level, loss_agg=loss_agg, ppo_epochs=1,
        num_minibatches=MINIBATCHES, grad_accum_steps=2, entropy_coef=0.01, kl_coef=0.05,
        kl_estimator="k3", kl_in_reward=False, cliprange_high=0.28, pack_granule=4,
    )  # fmt: skip
    tx = make_optimizer(OptimConfig(actor_lr=LR), LR, 10)
    spec = UpdateSpec(actor.config, None, ppo, 0.7, tx, None)
    batch, key = (
        _batch(spec, actor.params, None, seed=3, group_size=4, drift=0.3),
        jax.random.key(7),
    )
    logp, _ = policy_logprobs(spec.actor, actor.params, batch.tokens, batch.prompt_len, R, 0.7)
    mask = np.asarray(batch.mask)
    delta = np.where(mask, np.asarray(logp) - np.asarray(batch.old_logp), 0.0).sum(1)
    ratio = np.exp(delta if level == "sequence_sum" else delta / np.maximum(mask.sum(1), 1))
    assert (ratio > 1.28).any() and (ratio < 0.8).any()  # the first step clips both sides
    state = init_train_state(spec, actor.params, None)
    padded, packed = make_padded_update(spec), make_update(spec)
    want_state, want = padded(jax.tree.map(jnp.copy, state), batch, key, KL)
    got_state, got = packed(jax.tree.map(jnp.copy, state), batch, key, KL)
    assert got["update_tokens_computed"] < want["update_tokens_computed"]  # it did pack
    assert float(got["skipped_steps"]) == float(want["skipped_steps"]) == 0
    assert _relative_diff(want_state.actor_params, actor.params) > 1e-4
    bounds = tolerances.update_bounds((actor.config,), (B // MINIBATCHES) * (P + R), P + R,
                                      MINIBATCHES, LR)  # fmt: skip
    names = ("policy_loss", "entropy", "clipfrac", "approx_kl", "ratio_mean", "actor_grad_norm")
    vocab = actor.config.vocab_size
    tolerances.assert_same_metrics(got, want, names, bounds.n, bounds.steps, vocab)
    tolerances.assert_same_update(bounds, {"actor": actor.params}, got_state, want_state)


@pytest.mark.parametrize(
    "model_type,loss_agg",
    [("qwen2", "seq_mean"), pytest.param("llama", "token_mean", marks=pytest.mark.slow)],
)
def test_packed_microbatch_gradients_equal_padded(root, model_type, loss_agg):
    """Gradients of one microbatch's actor and critic losses, packed vs padded rows."""
    actor, critic = _models(model_type, root)
    spec = _spec(actor, critic, loss_agg)
    batch = _batch(spec, actor.params, critic.params, seed=1)
    rows = np.array([0, 1, 5, 9])  # the empty and the full response among them
    plan = plan_packing(
        np.asarray(batch.prompt_len), np.asarray(batch.mask).sum(1),
        rows.reshape(1, 1, 1, -1), (P + R, R), granule=4, agg=loss_agg,
    )  # fmt: skip
    # The microbatch is dealt to K chunks of one height; its loss is their weighted sum.
    chunks = [jax.tree.map(lambda x, a=a: jnp.asarray(x[0, 0, a]), plan.indices)
              for a in range(plan.indices.used.shape[2])]  # fmt: skip
    packed_mbs = [gather_microbatch(batch, one, len(rows)) for one in chunks]
    padded_mb = jax.tree.map(lambda x: x[rows], batch)
    cases = (
        (actor_loss, packed_actor_loss, actor.params, (KL,)),
        (critic_loss, packed_critic_loss, critic.params, ()),
    )
    for loss, packed_loss, params, args in cases:
        padded_grad = jax.grad(lambda p, f=loss, a=args: f(spec, p, padded_mb, *a)[0])
        packed_grad = jax.grad(
            lambda p, f=packed_loss, a=args: sum(f(spec, p, mb, *a)[0] for mb in packed_mbs)
        )
        want, got = jax.jit(padded_grad)(params), jax.jit(packed_grad)(params)
        n = tolerances.chain_summands((actor.config, critic.config), len(rows) * (P + R), P + R)
        diff, bound = tolerances.leaf_norm_rel(got, want), tolerances.grad_rtol(n)
        assert diff <= bound, (diff, bound)


def sharded_against_single_device(root: str) -> dict:
    """The packed update on a 2 x 2 x 2 mesh against the padded one on one device: its row
    counts, the measured counterparts of tests/tolerances.py's bounds (``update_diffs``) for
    the actor and the critic, and both updates' loss metrics and gradient norms."""
    actor, critic = _models("qwen2", root)
    spec = _spec(actor, critic, "token_mean")
    batch, key = _batch(spec, actor.params, critic.params, seed=2), jax.random.key(1)
    want_state, want = _run(make_padded_update(spec), spec, actor, critic, batch, key)
    mesh = make_mesh(2, 2, 2)
    update = make_update(spec, mesh)
    got_state, got = _run(update, spec, actor, critic, batch, key)
    before = {"actor": actor.params, "critic": critic.params}
    return {
        "rows": int(got["update_rows"]),
        "slots": int(got["update_slots"]),
        "update": tolerances.update_diffs(before, got_state, want_state),
        "metrics": {name: (float(got[name]), float(want[name])) for name in LOSSES + GRAD_NORMS},
    }


@pytest.mark.slow  # ~100 s of CPU: one more compile of the update, on a 2 x 2 x 2 mesh
def test_sharded_packed_update_equals_single_device(root):
    """In a fresh interpreter (the suite's device flags and float32 matmuls), run up to three
    times on one failure only. XLA:CPU's in-process collectives deadlock in this 8-device
    program now and then: some fake devices wait in an all-reduce over pairs while others wait
    in a collective permute over all 8, and XLA aborts the process after its collective
    timeout (about half the runs of this module in one process, before this session's changes
    too), which took the test's xdist worker down with it. The deadlock is named by XLA's own
    message; any other failure, and a wrong result, fail at once."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import jax, json, sys; jax.config.update('jax_default_matmul_precision', 'highest'); "
        "from tests.test_packed_update import sharded_against_single_device as run; "
        "print(json.dumps(run(sys.argv[1])))"
    )
    repo = Path(__file__).resolve().parents[1]
    # XLA's default waits 40 s per collective before aborting. 20 s aborted all three tries of a
    # CI run at 2026-12-07 14:27 (the other worker busy: 8 fake devices' threads on 2 cores
    # reach a collective far apart), so the wait is 60 s: a starved device arrives, and a real
    # deadlock still ends each try in about a minute.
    flags = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_collective_call_terminate_timeout_seconds=60"
    )
    env = {**os.environ, "XLA_FLAGS": flags}
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code, root], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        if done.returncode == 0 or "Termination timeout for" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rows"] % 4 == 0 and got["slots"] % 4 == 0  # rows shard evenly
    actor, critic = _models("qwen2", root)
    bounds = _bounds(actor, critic)
    tolerances.check_update(bounds, got["update"])
    pairs = got["metrics"]
    tolerances.assert_same_metrics(
        {k: v[0] for k, v in pairs.items()}, {k: v[1] for k, v in pairs.items()},
        LOSSES + GRAD_NORMS, bounds.n, bounds.steps, actor.config.vocab_size,
    )  # fmt: skip


def test_chunk_heights_and_first_fit():
    # one height a config: pow2(m / 64) rows, at least one, in whole shards, at most m / k
    assert [update_chunk_rows(m) for m in (1, 4, 16, 64, 112, 256)] == [1, 1, 1, 1, 2, 4]
    assert update_chunk_rows(112, row_multiple=4) == 4 and update_chunk_rows(3, 1, 2) == 1
    # K: enough chunks for the A·m / k rows first-fit may need
    assert update_chunks(16) == 16 and update_chunks(2, 56) == 112
    assert update_chunks(112, 2, 1, 2) == 112  # rows of 2L: 112 of them, one a chunk
    assert first_fit_decreasing(np.array([5, 3, 4, 2]), 8) == [[0, 1], [2, 3]]
    assert first_fit_decreasing(np.array([8, 8]), 8) == [[0], [1]]


@pytest.mark.parametrize(("agg", "factor"), [("token_mean", 1), ("seq_mean", 1), ("dapo", 2)])
def test_plan_covers_every_real_token_once_and_shapes_stay_bounded(agg, factor):
    rng = np.random.default_rng(0)
    full, resp, shapes, mixed, idle = 16 + 64, 64, set(), 0, 0
    for _ in range(60):
        prompt_len, resp_len = rng.integers(1, 17, 32), rng.integers(0, resp + 1, 32)
        resp_len = np.minimum(resp_len, rng.lognormal(2.0, 1.0, 32).astype(int))  # long tail
        perms = np.stack([rng.permutation(32) for _ in range(2)])
        micro = microbatch_rows(perms, 2, 2)
        plan = plan_packing(prompt_len, resp_len, micro, (full, resp), granule=16, row_multiple=2,
                            agg=agg, width_factor=factor)  # fmt: skip
        shapes.add(plan.shape)
        rows, width, slots = plan.shape
        idx = plan.indices
        assert rows % 2 == 0 and slots % 2 == 0 and width == factor * full
        assert rows * width <= 8 * full  # no chunk holds more than the padded microbatch
        for e, j in np.ndindex(*micro.shape[:2]):
            seqs = micro[e, j].reshape(-1)  # minibatch-local index -> batch row
            owner = np.repeat(np.arange(micro.shape[2]), micro.shape[3])  # its microbatch
            mean_sum, loss_sum = np.zeros(micro.shape[2]), np.zeros(micro.shape[2])
            for a in range(idx.used.shape[2]):  # the K chunks
                seg = idx.segments[e, j, a]
                assert bool(idx.used[e, j, a]) == bool((seg >= 0).any())
                idle += not idx.used[e, j, a]
                mixed += len(np.unique(owner[seg[seg >= 0]])) > 1
                w_mean, w_loss = idx.mean_weight[e, j, a], idx.loss_weight[e, j, a]
                np.add.at(mean_sum, owner[np.minimum(idx.resp_seg[e, j, a], len(seqs) - 1)],
                          np.where(idx.resp_seg[e, j, a] < len(seqs), w_mean, 0))  # fmt: skip
                np.add.at(loss_sum, owner[np.minimum(idx.resp_seg[e, j, a], len(seqs) - 1)],
                          np.where(idx.resp_seg[e, j, a] < len(seqs), w_loss, 0))  # fmt: skip
            for local, b in enumerate(seqs):
                where = [
                    a for a in range(idx.used.shape[2]) if (idx.segments[e, j, a] == local).any()
                ]
                assert len(where) == 1  # in exactly one chunk
                a = where[0]
                seg, pos, src = idx.segments[e, j, a], idx.positions[e, j, a], idx.tok_src[e, j, a]
                at = seg == local
                n = prompt_len[b] + resp_len[b]
                assert at.sum() == n and len(np.unique(np.nonzero(at)[0])) == 1  # one row
                np.testing.assert_array_equal(pos[at], np.arange(n))  # RoPE restarts
                np.testing.assert_array_equal(src[at], b * full + np.arange(n))
                r_at = idx.resp_seg[e, j, a] == local
                np.testing.assert_array_equal(
                    idx.resp_src[e, j, a][r_at], b * resp + np.arange(resp_len[b])
                )
                # the output read for response token i sits just before it in the same segment
                flat = idx.resp_at[e, j, a][r_at]
                np.testing.assert_array_equal(seg.reshape(-1)[flat], local)
                np.testing.assert_array_equal(
                    pos.reshape(-1)[flat], prompt_len[b] - 1 + np.arange(resp_len[b])
                )
            # Each microbatch's tokens weigh 1 in its masked means, wherever they were dealt:
            # the padded update's per-microbatch mean (0 for a microbatch with no token).
            has = np.array([resp_len[micro[e, j, a]].sum() > 0 for a in range(micro.shape[2])])
            np.testing.assert_allclose(mean_sum, has.astype(float), rtol=1e-6)
            # dapo: each microbatch's share of the minibatch's tokens, times A (TRL's
            # num_items_in_batch, with the accumulation's division by A undone)
            tokens = np.array([resp_len[micro[e, j, a]].sum() for a in range(micro.shape[2])])
            dapo = micro.shape[2] * tokens / max(tokens.sum(), 1)
            expected = dapo if agg == "dapo" else has.astype(float)
            np.testing.assert_allclose(loss_sum, expected, rtol=1e-6)
        assert plan.tokens_real == (prompt_len + resp_len).sum() * 2
        assert plan.tokens_computed == int(idx.used.sum()) * rows * width >= plan.tokens_real
    assert mixed > 0 and idle > 0  # chunks mixed microbatches, and some did not run
    # One shape whatever the lengths (packed_shapes, m = 8 sequences per microbatch, 2 chunks):
    # rows of a quarter of the padded microbatch's tokens, in whole shards, and K chunks, enough
    # for the 2 x 8 sequences of a minibatch however they pack.
    shape, count = packed_shapes(8, full, resp, granule=16, row_multiple=2, chunks=2,
                                 width_factor=factor)  # fmt: skip
    if factor == 1:
        assert (shape, count) == ((2, 80, 160), 8)
    else:  # rows of 160
        assert (shape, count) == ((2, 160, 320), 4)
    assert shapes == {shape}


def _pipeline_run(packed: bool, steps: int = 2):
    """OPPO steps (B = 4, Δ = 3: carried rows) through ``run_step`` with the packed or the
    padded update; returns the results and the final train state."""
    ppo = PPOConfig(ppo_epochs=1, num_minibatches=2, pack_granule=4)
    spec = make_spec(ppo, temperature=1.0)
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompt_width=4, max_response_len=16,
                          eos_ids=tuple(range(20, 26)))  # fmt: skip
    update = make_update(spec) if packed else make_padded_update(spec)
    kernels = build_kernels(spec, rollout, reward_model=CRITIC, update=update)
    actor, critic = tiny_params(seed=5)
    place = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    state = init_train_state(spec, *jax.tree.map(jnp.copy, (actor, critic)))
    rng = np.random.default_rng(0)
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(2, 5))) for i in range(64)])
    engine = step_engine(kernels, place, actor, init_params(CRITIC, jax.random.key(11)))
    buffer, timeline, results = CarryBuffer(), Timeline(), []
    for step in range(steps):
        plan = step_plan(step, 4, overcommit=3, chunk_size=4)
        state, carried, result = run_step(
            engine, SCHEDULES["oppo"], plan, state, buffer, prompts, timeline
        )
        buffer.extend(carried)
        results.append(result)
    return results, state


@pytest.mark.slow  # two pipelines' kernels: ~2-3 min of CPU
def test_step_with_packed_update_equals_padded():
    """Through the step (host lengths handed to the update, carried rows): the same batches,
    losses and parameters as the padded update, and the work ledger counts the packed slots."""
    padded, padded_state = _pipeline_run(False)
    packed, packed_state = _pipeline_run(True)
    assert any(r.slots.prefix_len.any() for r in packed)  # carried prefixes were replayed
    # 2 steps of 2 optimizer steps each, minibatches of 2 rows of 4 + 16 columns (B = 4).
    bounds = tolerances.update_bounds((ACTOR, CRITIC), 2 * 20, 20, 4, 1e-3)
    for a, b in zip(padded, packed, strict=True):
        np.testing.assert_array_equal(a.responses, b.responses)
        names = ("policy_loss", "value_loss", "entropy")
        tolerances.assert_same_metrics(b.metrics, a.metrics, names, bounds.n, 2, ACTOR.vocab_size)
        assert b.metrics["update_tokens_real"] == a.metrics["update_tokens_real"]
        assert b.metrics["update_tokens_computed"] <= a.metrics["update_tokens_computed"]
    actor, critic = tiny_params(seed=5)
    tolerances.assert_same_update(
        bounds, {"actor": actor, "critic": critic}, packed_state, padded_state
    )


@pytest.mark.parametrize("kind", ["tis", "mis"])
def test_one_step_counts_its_correction_against_its_own_forward(root, kind):
    """One epoch of one minibatch: π_old is the update's own forward, so the correction's
    metrics come from its weights there, counted over the chunks (``off_policy.
    finish_correction``), not from the batch's old log-probs (moved 0.5 nats off here, which
    must not be read). Against ``correction_metrics`` of an independent forward
    (``tests.oracles``) at the update's start; the padded oracle counts them alike."""
    import dataclasses

    from oppo_jax.ppo.off_policy import correction_metrics

    actor, critic = _models("qwen2", root)
    spec = _spec(actor, critic, "dapo")
    ppo = dataclasses.replace(spec.ppo, num_minibatches=1, off_policy_correction=kind,
                              mis_lower=0.95, mis_upper=1.05)  # fmt: skip
    spec = dataclasses.replace(spec, ppo=ppo)
    assert ppo.old_is_first_forward and ppo.grad_accum_steps == 2  # counts over two chunks
    batch, key = _batch(spec, actor.params, critic.params), jax.random.key(7)
    logp, _ = policy_logprobs(spec.actor, actor.params, batch.tokens, batch.prompt_len, R,
                              spec.temperature)  # fmt: skip
    batch = batch.replace(old_logp=batch.old_logp + 0.5)
    want = correction_metrics(ppo, logp, batch.behaviour_logp, batch.mask)
    misread = correction_metrics(ppo, batch.old_logp, batch.behaviour_logp, batch.mask)
    if kind == "mis":
        assert 0 < float(want["is_masked_seq_frac"]) < 1  # the band masks some sequences
    for update in (make_update(spec), make_padded_update(spec)):
        _, got = _run(update, spec, actor, critic, batch, key)
        for name, value in want.items():
            assert float(got[name]) == pytest.approx(float(value), abs=1e-5), name
            assert abs(float(misread[name]) - float(value)) > 1e-3 or name != "is_weight_mean"
