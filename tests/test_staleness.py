"""Bounded staleness (``rollout.max_staleness``, ``rollout.on_stale``): the carry's histogram of
trained tokens' ages, dropping whole groups at the bound, the config's keys and their
migration from ``pipeline.max_deferrals`` / ``ppo.importance_correction``, and demo runs."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_jax.base.errors import ConfigError
from oppo_jax.config import load_config, to_yaml
from oppo_jax.pipeline.carry import (
    AdmitRule,
    CarryBuffer,
    HostRollout,
    admit,
    carry_out,
    dropped_slots,
    select_batch,
    staleness_counts,
)
from oppo_jax.run.log import config_differences
from oppo_jax.train import train
from tests.ppo_fixtures import ListPrompts
from tests.run_fixtures import metric_values, small_demo_config

R = 24  # response capacity


def test_staleness_counts_worked_example():
    """Step 5: a row whose 3-token prefix was sampled at steps [3, 3, 4], 5 tokens in all."""
    buffer = CarryBuffer()
    slots = admit(buffer, ListPrompts([(0, [7])]), AdmitRule(1, 1, True, 2), 1, 8)
    slots.prefix_len[0], slots.prefix_version[0, :3] = 3, [3, 3, 4]
    got = staleness_counts(slots, np.array([0]), np.array([5]), step=5, bound=2)
    np.testing.assert_array_equal(got, [2, 1, 2])
    with pytest.raises(AssertionError, match="3 versions stale; bound 2"):
        staleness_counts(slots, np.array([0]), np.array([5]), step=6, bound=2)


def _decode(slots, lengths, chunk, batch_size, group_size):
    """Lockstep decoding of the admitted slots to the first chunk boundary where the cut rule
    holds; sample i of prompt p is ``lengths[p, i]`` tokens long (capped at R)."""
    total = np.minimum(lengths[slots.prompt_ids, slots.sample_index], R)
    finish_at = np.where(slots.prefix_finished, 0, np.maximum(total - slots.prefix_len, 0))
    finish_at = np.where(slots.active, finish_at, 0)
    clock, must = 0, (slots.active, slots.must_finish)
    while True:
        clock += chunk
        finish_step = np.where(slots.active & (finish_at <= clock), finish_at, -1)
        selection = select_batch(finish_step, *must, batch_size, group_size)
        if selection is not None:
            break
        assert clock <= 4 * R, "the rollout never ends"
    generated = np.where(finish_step >= 0, slots.prefix_len + finish_at, slots.prefix_len + clock)
    generated = np.minimum(generated, R)
    tokens = np.broadcast_to(np.arange(R), (slots.num_slots, R)).astype(np.int32)
    rollout = HostRollout(tokens, -np.ones(tokens.shape, np.float32), generated, finish_step)
    return selection, rollout


def _whole_groups(prompt_ids: np.ndarray, group_size: int) -> bool:
    groups = prompt_ids.reshape(-1, group_size)
    return bool((groups == groups[:, :1]).all())


_B, _G = 4, 2


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3 * R), min_size=160, max_size=160),
    delta=st.integers(0, _B // _G),
    bound=st.integers(0, 3),
    on_stale=st.sampled_from(["finish", "drop"]),
    chunk=st.sampled_from([1, 3, 8]),
    steps=st.integers(1, 10),
)
def test_no_trained_token_is_staler_than_the_bound(lengths, delta, bound, on_stale, chunk, steps):
    """Whatever the lengths: every trained token is at most ``bound`` versions old, groups are
    trained, carried and dropped whole, a drop happens only with on_stale drop, and every
    admitted prompt is trained once, dropped once or still in flight."""
    if bound == 0 and on_stale == "finish" and delta:
        return  # refused by the config (validate: every admitted group must finish)
    lengths = np.asarray(lengths).reshape(-1, _G)
    prompts = ListPrompts([(i, [5]) for i in range(len(lengths))])
    buffer, trained, dropped = CarryBuffer(), [], []
    for step in range(steps):
        n = _B + delta * _G
        slots = admit(buffer, prompts, AdmitRule(n, n, True, bound, _G, on_stale), 1, R)
        selection, rollout = _decode(slots, lengths, chunk, _B, _G)
        rows = selection.batch
        counts = staleness_counts(slots, rows, rollout.num_generated[rows], step, bound)
        assert len(counts) == bound + 1 and counts.sum() == rollout.num_generated[rows].sum()
        for r in rows:  # the ages, read directly from the carried versions
            assert (step - slots.prefix_version[r, : slots.prefix_len[r]] <= bound).all()
        gone = dropped_slots(slots, selection)
        assert not gone or on_stale == "drop"
        assert _whole_groups(slots.prompt_ids[rows], _G)
        assert _whole_groups(slots.prompt_ids[gone], _G)
        carried = carry_out(slots, selection, rollout, step)
        assert _whole_groups(np.array([c.prompt_id for c in carried], int), _G)
        assert all(c.deferrals <= bound for c in carried)  # no carried group passes the bound
        trained += slots.prompt_ids[rows][::_G].tolist()
        dropped += slots.prompt_ids[gone][::_G].tolist()
        buffer.extend(carried)
    in_flight = [c.prompt_id for c in buffer.take(len(buffer))][::_G]
    admitted = trained + dropped + in_flight
    assert sorted(admitted) == list(range(len(admitted)))  # each once, none lost


def test_drop_removes_the_left_out_group_at_the_bound_and_finish_waits_for_it():
    """B = 2 (one group of G = 2), Δ = 1: the carried group (prompt 0, at the bound 1) is the
    slowest. finish: the cut waits for it and takes it first; drop: the cut takes prompt 1,
    which finished first, and drops prompt 0 (not carried), carrying prompt 2."""
    lengths = np.array([[20, 20], [3, 3], [10, 10], [4, 4]])
    results = {}
    for on_stale in ("finish", "drop"):
        prompts, buffer = ListPrompts([(i, [5]) for i in range(4)]), CarryBuffer()
        for step in range(2):
            slots = admit(buffer, prompts, AdmitRule(4, 4, True, 1, 2, on_stale), 1, R)
            selection, rollout = _decode(slots, lengths, 2, 2, 2)
            carried = carry_out(slots, selection, rollout, step)
            buffer.extend(carried)
        taken = slots.prompt_ids[selection.batch].tolist()
        gone = slots.prompt_ids[dropped_slots(slots, selection)].tolist()
        results[on_stale] = (taken, gone, [c.prompt_id for c in carried])
    assert results["finish"] == ([0, 0], [], [2, 2])
    assert results["drop"] == ([2, 2], [0, 0], [])


@pytest.mark.parametrize(
    "overrides, text",
    [
        (["rollout.on_stale=skip"], "rollout.on_stale='skip': must be one of finish, drop"),
        (["rollout.max_staleness=-1"], "rollout.max_staleness=-1: must be >= 0"),
        (["ppo.off_policy_correction=is"], "ppo.off_policy_correction='is': must be one of"),
        (["ppo.mis_lower=1.5"], "ppo.mis_lower=1.5, ppo.mis_upper=2.0: the band must hold 1"),
        (["ppo.mis_upper=0.9"], "ppo.mis_upper=0.9: the band must hold 1"),
        (
            ["pipeline.mode=oppo", "rollout.max_staleness=0"],
            "rollout.max_staleness=0: with rollout.on_stale=finish every one",
        ),
    ],
)
def test_bad_values_name_their_key(overrides, text):
    with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_max_staleness_zero_drops_where_it_cannot_finish():
    cfg = load_config(
        None, ["pipeline.mode=oppo", "rollout.max_staleness=0", "rollout.on_stale=drop"]
    )
    assert (cfg.rollout.max_staleness, cfg.rollout.on_stale) == (0, "drop")


def test_the_renamed_keys_still_load_and_resume(tmp_path):
    with pytest.warns(FutureWarning, match="ppo.importance_correction is now ppo.off_policy"):
        cfg = load_config(None, ["ppo.importance_correction=true", "pipeline.max_deferrals=3"])
    assert (cfg.ppo.off_policy_correction, cfg.rollout.max_staleness) == ("tis", 3)
    both = tmp_path / "both.yaml"  # one file naming a key twice, old and new: refused
    both.write_text("rollout:\n  max_staleness: 1\npipeline:\n  max_deferrals: 3\n")
    with pytest.raises(ConfigError, match="max_deferrals and rollout.max_staleness both given"):
        load_config(both)
    # A run directory's config.yaml written before the rename: the same run under new names.
    old = to_yaml(cfg).replace("off_policy_correction: tis", "importance_correction: true")
    old = old.replace("  max_staleness: 3\n", "").replace(
        "pipeline:\n", "pipeline:\n  max_deferrals: 3\n"
    )
    assert "max_deferrals: 3" in old and "max_staleness" not in old
    assert config_differences(old, cfg) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        other = load_config(None, ["ppo.importance_correction=false", "pipeline.max_deferrals=3"])
    assert config_differences(old, other) == ["ppo.off_policy_correction"]


# A GRPO demo run that carries one group a step (G = 4, B = 8: two groups trained a step).
GRPO_OPPO = (
    "rollout.group_size=4", "ppo.advantage=grpo", "ppo.kl_coef=0.0", "ppo.kl_in_reward=false",
    "reward.model_weight=0", "reward.functions=[oppo_jax.rewards.demo:sentiment]",
    "ppo.ppo_epochs=2", "ppo.loss_agg=seq_mean", "pipeline.mode=oppo", "pipeline.overcommit=1",
    "pipeline.adaptive_overcommit=false", "train.steps=3", "train.checkpoint_every=0",
)  # fmt: skip


def _records(tmp_path, name, *extra):
    train(small_demo_config(*GRPO_OPPO, *extra), tmp_path / name, progress=False)
    return metric_values(tmp_path / name / "metrics.jsonl")


@pytest.mark.slow  # two demo runs
def test_demo_runs_record_staleness_drops_and_the_correction(demo_cache, tmp_path):
    # Bound 0, drop: the group started beyond the batch is dropped every step, never carried.
    for r in _records(tmp_path, "zero", "rollout.max_staleness=0", "rollout.on_stale=drop"):
        assert (r["dropped"], r["carried"]) == (1, 0)
        assert [k for k in r if k.startswith("staleness_")] == ["staleness_0"]
        assert r["staleness_0"] == round(r["response_len_mean"] * 8)
    # Bound 1, drop, MIS: carried groups' tokens one version old, weighed by the mask.
    records = _records(tmp_path, "mis", "rollout.max_staleness=1", "rollout.on_stale=drop",
                       "ppo.off_policy_correction=mis")  # fmt: skip
    for r in records:
        ages = [r["staleness_0"], r["staleness_1"]]
        assert "staleness_2" not in r and sum(ages) == round(r["response_len_mean"] * 8)
        assert r["stale_token_frac"] == pytest.approx(ages[1] / sum(ages))
        assert r["is_weight_mean"] == pytest.approx(1.0 - r["is_masked_token_frac"])
        assert 0.0 <= r["is_masked_seq_frac"] <= 1.0
    assert any(r["staleness_1"] > 0 for r in records)
