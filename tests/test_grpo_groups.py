"""Groups under OPPO's overlaps (the GRPO family): the cut takes whole groups, carried groups
keep their finished members, and the invariances of PPO (chunk size, Δ = 0 oppo = sync,
resume) hold for a critic-free step."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_jax.base.errors import InputError
from oppo_jax.export import export_run
from oppo_jax.pipeline.carry import AdmitRule, CarryBuffer, HostRollout, admit, carry_out
from oppo_jax.pipeline.carry import select_batch as host_select
from oppo_jax.rollout.decode import CutRule
from oppo_jax.run.log import read_metrics
from oppo_jax.train import train
from tests.ppo_fixtures import ListPrompts
from tests.run_fixtures import metric_values, small_demo_config

R = 24  # response capacity
_B, _G = 8, 4


def _length(lengths, prompt_id, sample_index):
    return min(lengths[(prompt_id * _G + sample_index) % len(lengths)], R)


def _device_ready(finish_step, slots) -> bool:
    """The decode's cut rule (CutRule) on the same finish positions."""
    import jax.numpy as jnp

    n = slots.num_slots
    rule = CutRule(
        jnp.asarray(slots.active), jnp.asarray(slots.must_finish), jnp.int32(_B // _G),
        jnp.arange(n, dtype=jnp.int32) // _G,
    )  # fmt: skip
    return bool(rule.ready(jnp.asarray(finish_step >= 0)))


def _simulate_step(slots, lengths, chunk, step, check_device=False):
    """Lockstep decoding stopped at the first chunk boundary where the cut rule holds; a
    sequence's length is fixed by (prompt id, sample index)."""
    n = slots.num_slots
    full = np.array([
        _length(lengths, slots.prompt_ids[i], slots.sample_index[i]) if slots.active[i] else 0
        for i in range(n)
    ])  # fmt: skip
    finish_at = np.where(slots.prefix_finished, 0, np.maximum(full - slots.prefix_len, 0))
    clock = 0
    while True:
        clock += chunk
        finish_step = np.where(slots.active & (finish_at <= clock), finish_at, -1)
        selection = host_select(finish_step, slots.active, slots.must_finish, _B, _G)
        if check_device:  # the host can choose a batch exactly when the device may stop
            assert _device_ready(finish_step, slots) == (selection is not None)
        if selection is not None:
            break
    generated = np.where(finish_step >= 0, slots.prefix_len + finish_at, slots.prefix_len + clock)
    generated = generated.clip(max=R)
    tokens = np.stack([
        slots.prompt_ids[i] * 1000 + slots.sample_index[i] * 100 + np.arange(R) for i in range(n)
    ]).astype(np.int32)  # fmt: skip
    rollout = HostRollout(tokens, -np.ones((n, R), np.float32), generated, finish_step)
    return selection, carry_out(slots, selection, rollout, step), full


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3 * R), min_size=97, max_size=97),
    delta=st.integers(0, _B // _G),
    max_deferrals=st.integers(1, 3),
    chunk=st.sampled_from([1, 3, 8]),
    steps=st.integers(1, 10),
)
def test_updates_hold_whole_groups_and_carried_groups_keep_their_members(
    lengths, delta, max_deferrals, chunk, steps
):
    prompts = ListPrompts([(i, [5, 6]) for i in range(200)])
    buffer, seen = CarryBuffer(), []
    for step in range(steps):
        rule = AdmitRule(_B + delta * _G, _B + delta * _G, True, max_deferrals, _G)
        slots = admit(buffer, prompts, rule, 2, R)
        slots.check_carried_first()
        selection, carried, full = _simulate_step(slots, lengths, chunk, step, step < 3)
        batch = selection.batch
        # Exactly B/G whole groups, each its G samples in order.
        assert len(batch) == _B
        ids = slots.prompt_ids[batch].reshape(-1, _G)
        assert (ids == ids[:, :1]).all() and len(set(ids[:, 0])) == _B // _G
        assert (slots.sample_index[batch].reshape(-1, _G) == np.arange(_G)).all()
        # No group is split: none of a batch group's members is carried.
        assert not {c.prompt_id for c in carried} & set(ids[:, 0].tolist())
        assert len(carried) % _G == 0 and len(carried) == int(slots.active.sum()) - _B
        for i, c in zip([i for i in range(slots.num_slots) if slots.active[i] and i not in
                         set(batch.tolist())], carried, strict=True):  # fmt: skip
            # A finished member is carried complete; its tokens are kept as sampled.
            assert c.sample_index == slots.sample_index[i]
            assert c.response == [c.prompt_id * 1000 + c.sample_index * 100 + j
                                  for j in range(len(c.response))]  # fmt: skip
            if c.finished:
                assert len(c.response) == full[i]
            assert len(c.behaviour_logp) == len(c.version) == len(c.response)
            assert c.deferrals <= max_deferrals
        groups = [carried[k : k + _G] for k in range(0, len(carried), _G)]
        for group in groups:  # carried whole and contiguous, deferred together
            assert len({c.prompt_id for c in group}) == 1
            assert [c.sample_index for c in group] == list(range(_G))
            assert len({c.deferrals for c in group}) == 1
        seen.extend(ids[:, 0].tolist())
        buffer.extend(carried)
    assert len(seen) == len(set(seen))  # a group trains once


def test_the_cut_waits_for_a_groups_last_member():
    finish = np.array([2, 9, 3, 3, -1, 1, 1, 1])  # groups of 4: [2, 9, 3, 3] and [-1, 1, 1, 1]
    active, none = np.ones(8, bool), np.zeros(8, bool)
    sel = host_select(finish, active, none, 4, 4)
    assert sel.batch.tolist() == [0, 1, 2, 3] and sel.cut == 9
    assert host_select(np.array([2, -1, 3, 3, -1, 1, 1, 1]), active, none, 4, 4) is None


# End to end: a critic-free GRPO step on the demo, scored by a reward function.
GRPO = (
    "rollout.group_size=4", "ppo.advantage=grpo", "ppo.kl_coef=0.0", "ppo.kl_in_reward=false",
    "reward.model_weight=0", "reward.functions=[oppo_jax.rewards.demo:sentiment]",
    "ppo.ppo_epochs=2", "ppo.loss_agg=seq_mean", "ppo.cliprange_high=0.28",
)  # fmt: skip
GRPO_OPPO = ("pipeline.mode=oppo", "pipeline.overcommit=1", "pipeline.adaptive_overcommit=false")


def _run(tmp_path, name, *extra, resume=False):
    train(small_demo_config(*GRPO, *extra), tmp_path / name, resume=resume, progress=False)
    return metric_values(tmp_path / name / "metrics.jsonl")


def test_a_grpo_run_has_no_critic_and_no_reference(demo_cache, tmp_path):
    records = _run(tmp_path, "a", *GRPO_OPPO, "ppo.off_policy_correction=tis")
    stages = set(read_metrics(tmp_path / "a" / "metrics.jsonl")[0]["stage_time_s"])
    assert not {s for s in stages if "critic" in s or "reference" in s}
    assert "value_loss" not in records[0] and "critic_grad_norm" not in records[0]
    assert all(r["kl"] == 0.0 for r in records)
    assert any(r["carried"] > 0 for r in records) and all(r["carried"] % 4 == 0 for r in records)
    # Members sampled by an older policy (carried groups) are weighted; fresh tokens weigh 1.
    for r in records:
        assert (r["is_weight_mean"] != 1.0) == (r["stale_token_frac"] > 0), r
    # The trained actor exports as any run's; there is no critic to export.
    with pytest.raises(InputError, match="trains no critic"):
        export_run(tmp_path / "a", tmp_path / "critic", critic=True)
    assert (Path(export_run(tmp_path / "a", tmp_path / "hf")) / "config.json").is_file()


@pytest.mark.slow  # four demo runs
def test_grpo_chunk_size_invariance_and_delta_zero_oppo_equals_sync(demo_cache, tmp_path):
    def results(records):  # what was trained on and its update (not the work's layout)
        keys = ("reward", "gold", "policy_loss", "actor_grad_norm", "clipfrac", "entropy",
                "response_len_mean", "carried", "deferral_age_mean")  # fmt: skip
        return [[r[k] for k in keys] for r in records]

    carrying = _run(tmp_path, "c4", *GRPO_OPPO, "pipeline.chunk_size=4")
    assert results(carrying) == results(_run(tmp_path, "c16", *GRPO_OPPO, "pipeline.chunk_size=16"))
    sync = _run(tmp_path, "sync")
    oppo = _run(tmp_path, "oppo0", "pipeline.mode=oppo", "pipeline.overcommit=0",
                "pipeline.adaptive_overcommit=false")  # fmt: skip
    assert results(sync) == results(oppo)


@pytest.mark.slow  # three demo runs
def test_grpo_resume_with_groups_in_flight_is_bit_identical(demo_cache, tmp_path):
    # β > 0: the streamed reference keeps its rows of the carried members (checkpointed too)
    with_reference = (*GRPO_OPPO, "ppo.kl_coef=0.04", "ppo.kl_estimator=k3")
    full = _run(tmp_path, "full", *with_reference)
    assert full[1]["carried"] > 0  # the checkpoint at step 2 holds groups in flight
    _run(tmp_path, "half", *with_reference, "train.steps=2")
    assert _run(tmp_path, "half", *with_reference, resume=True) == full


@pytest.mark.parametrize(
    "extra",
    [
        # β > 0: the reference is loaded and run, its k3 KL in the loss
        ("ppo.advantage=rloo", "ppo.kl_coef=0.05", "ppo.kl_estimator=k3", "ppo.loss_agg=dr_grpo"),
        ("ppo.advantage=reinforce_pp", "ppo.loss_agg=dapo", "pipeline.mode=intra"),
        # LoRA: the actor's adapters alone are trained; its base serves the reference
        (
            "model.lora_rank=4",
            "model.lora_alpha=8",
            "optim.actor_lr=1e-3",
            "ppo.kl_coef=0.05",
            "ppo.kl_estimator=k3",
            *GRPO_OPPO,
        ),  # fmt: skip
    ],
)
def test_every_group_estimator_trains_without_a_critic(demo_cache, tmp_path, extra):
    records = _run(tmp_path, "e", *extra, "train.steps=2", "train.checkpoint_every=0")
    stages = set(read_metrics(tmp_path / "e" / "metrics.jsonl")[0]["stage_time_s"])
    assert not {s for s in stages if "critic" in s}
    with_reference = "ppo.kl_coef=0.05" in extra
    assert any("reference" in s for s in stages) == with_reference
    assert all(np.isfinite(r["policy_loss"]) and r["skipped_steps"] == 0 for r in records)
    assert (records[-1]["kl"] != 0.0) == with_reference  # the updated policy left the reference


def test_kl_in_the_reward_leaves_each_score_before_the_group_baseline():
    """ppo.kl_in_reward with a group estimator (TRL's RLOO): r = score − β·Σ_t KL_t, then the
    leave-one-out baseline; against a NumPy computation of the same."""
    import jax.numpy as jnp

    from oppo_jax.config import load_config
    from oppo_jax.ppo.experience import ScoredRollout, build_batch

    cfg = load_config(None, ["ppo.advantage=rloo", "rollout.group_size=2", "ppo.kl_coef=0.1",
                             "ppo.kl_in_reward=true", "ppo.kl_estimator=k1"])  # fmt: skip
    rng = np.random.default_rng(0)
    mask = np.arange(5)[None, :] < np.array([3, 5, 1, 4])[:, None]
    old, ref = (
        rng.normal(size=(4, 5)).astype(np.float32),
        rng.normal(size=(4, 5)).astype(np.float32),
    )
    scores = np.array([1.0, 0.0, 0.5, 2.0], np.float32)
    rollout = ScoredRollout(
        tokens=jnp.zeros((4, 8), jnp.int32), prompt_len=jnp.full(4, 3), mask=jnp.asarray(mask),
        scores=jnp.asarray(scores), ended_with_eos=jnp.ones(4, bool), old_logp=jnp.asarray(old),
        behaviour_logp=jnp.asarray(old), ref_logp=jnp.asarray(ref), values=jnp.zeros((4, 5)),
    )  # fmt: skip
    batch, _ = build_batch(cfg.ppo, rollout, jnp.float32(0.1), group_size=2)
    r = scores - 0.1 * np.where(mask, old - ref, 0.0).sum(axis=1)
    groups = r.reshape(2, 2)
    want = (groups - groups[:, ::-1]).reshape(-1)  # G = 2: the other member is the baseline
    np.testing.assert_allclose(np.asarray(batch.advantages), np.where(mask, want[:, None], 0.0),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
