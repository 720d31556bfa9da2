"""Refilling runs end to end (rollout.refill_every; issue 44): the exactness the issue asks for,
on the demo. A run is a function of its config and seed: two runs agree bit for bit (one of
them beside processes loading every core), whatever the chunk size dividing refill_every, and
a resume with refilled groups in flight equals the run it interrupted. PPO (G = 1, a critic,
the reward model, the reference) trains through the same path."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oppo_jax.base.errors import ConfigError
from oppo_jax.config import load_config
from oppo_jax.config.schema import PPOConfig
from oppo_jax.models.hf_io import read_config
from oppo_jax.run.log import read_metrics
from oppo_jax.train import train
from tests import tolerances
from tests.run_fixtures import metric_values, small_demo_config
from tests.test_grpo_groups import GRPO

REFILL = (
    "pipeline.mode=oppo", "pipeline.overcommit=1", "pipeline.adaptive_overcommit=false",
    "rollout.refill_every=8", "rollout.length_sampler=lognormal", "rollout.length_median=6",
    "rollout.length_p99=28", "ppo.off_policy_correction=tis",
)  # fmt: skip


def _run(tmp_path, name, *extra, resume=False, warmup=False):
    cfg = small_demo_config(*GRPO, *REFILL, *extra)
    train(cfg, tmp_path / name, resume=resume, progress=False, warmup=warmup)
    return metric_values(tmp_path / name / "metrics.jsonl")


def _burn_cpus(n: int = 2):
    """``n`` processes spinning on the CPU (the machine's cores), until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.slow  # four demo runs
def test_a_refilling_run_is_its_config_and_seed_alone(demo_cache, tmp_path):
    # warmed up: every program of the refilling step is in the registry, none compiles after
    full = _run(tmp_path, "full", "pipeline.chunk_size=4", warmup=True)
    assert [r["compiles"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl")] == [0] * 4
    # refill kept the rows busy and groups straddled the cuts
    assert all(r["efficiency"]["decode"] > 0.5 for r in full if r["efficiency"].get("decode"))
    assert full[1]["carried"] > 0 and any(r["staleness_1"] > 0 for r in full)
    assert all(r["staleness_2"] + r["staleness_1"] + r["staleness_0"] > 0 for r in full)
    burners = _burn_cpus()
    try:
        loaded = _run(tmp_path, "loaded", "pipeline.chunk_size=4")
        _run(tmp_path, "half", "pipeline.chunk_size=4", "train.steps=2")
    finally:
        for p in burners:
            p.kill()
    assert loaded == full
    assert _run(tmp_path, "half", "pipeline.chunk_size=4", resume=True) == full
    c8 = _run(tmp_path, "c8", "pipeline.chunk_size=8")
    assert [r | {"chunk_size": 4} for r in c8] == full  # and only the setting itself differs


@pytest.mark.slow  # one demo run each
@pytest.mark.parametrize("refill", ["rollout.refill_every=8", "rollout.refill_every=0"])
def test_a_warmed_up_carrying_run_on_a_mesh_compiles_nothing_after(demo_cache, tmp_path, refill):
    """Rows over 2 devices, with refill and without: the host's arrays (admissions, stop
    rules, the refill points' row lists) reach their programs as host arrays, so no small
    program reslices a one-device array over the mesh after the warm-up (5 did with refill,
    3 without)."""
    records = _run(tmp_path, "mesh", refill, "pipeline.chunk_size=4", "train.steps=3",
                   "mesh.data=2", warmup=True)  # fmt: skip
    assert [r["compiles"] for r in read_metrics(tmp_path / "mesh" / "metrics.jsonl")] == [0] * 3
    assert any(r["carried"] > 0 for r in records)  # a step resumed rows (the replay ran)


@pytest.mark.slow  # one demo run
def test_ppo_with_a_critic_reward_model_and_reference_refills(demo_cache, tmp_path):
    cfg = small_demo_config(
        "pipeline.mode=inter", "pipeline.overcommit=2", "pipeline.adaptive_overcommit=false",
        "rollout.refill_every=8", "pipeline.chunk_size=8", "train.steps=3",
    )  # fmt: skip
    train(cfg, tmp_path / "ppo", progress=False, warmup=False)
    records = metric_values(tmp_path / "ppo" / "metrics.jsonl")
    assert all(np.isfinite(r["value_loss"]) and np.isfinite(r["policy_loss"]) for r in records)
    assert all(r["kl"] != 0.0 for r in records[1:])  # the reference scored the batch
    assert any(r["carried"] > 0 for r in records)  # groups decoded on across a step boundary


@pytest.mark.slow  # two demo runs
def test_oppo_starts_reward_functions_as_samples_end(demo_cache, tmp_path, monkeypatch):
    """Under refill, ``oppo`` (streaming) submits a sample's reward functions at the refill
    point that harvests it, while rows decode on; ``inter`` submits them at the cut. The
    scores, and so every metric, are the same: a result counts only for its tokens."""
    import oppo_jax.pipeline.refill_step as refill_step
    from oppo_jax.rewards.runner import RewardFunctions

    during = []  # per submit: was the rollout decoding?
    decoding = [False]
    rollout, submit = refill_step.refill_rollout, RewardFunctions.submit

    def refill_rollout(*args, **kwargs):
        decoding[0] = True
        try:
            return rollout(*args, **kwargs)
        finally:
            decoding[0] = False

    def recorded_submit(self, *args, **kwargs):
        during.append(decoding[0])
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(refill_step, "refill_rollout", refill_rollout)
    monkeypatch.setattr(RewardFunctions, "submit", recorded_submit)
    oppo = _run(tmp_path, "oppo", "pipeline.chunk_size=4")
    in_oppo, during[:] = list(during), []
    inter = _run(tmp_path, "inter", "pipeline.chunk_size=4", "pipeline.mode=inter")
    assert sum(in_oppo) > len(in_oppo) // 2 and not any(during)
    assert oppo == inter


@pytest.mark.slow  # two demo runs each
@pytest.mark.parametrize("correction", ["none", "mis"])
def test_one_epoch_skips_the_old_logprob_pass_nothing_reads(
    demo_cache, tmp_path, monkeypatch, correction
):
    """One epoch of one minibatch, no reference: π_old is the update's own forward
    (``PPOConfig.old_is_first_forward``), for the ratio and for the off-policy correction
    (its weights and metrics), and nothing else reads the batch's old log-probs, so a
    refilling step skips the actor's pass over tokens sampled under earlier weights. Forcing
    the pass must change nothing but the tokens it computes."""
    extra = ("ppo.ppo_epochs=1", f"ppo.off_policy_correction={correction}",
             "pipeline.chunk_size=4")  # fmt: skip
    skipped = _run(tmp_path, "skipped", *extra)
    assert all(("is_masked_seq_frac" in r) == (correction == "mis") for r in skipped)
    monkeypatch.setattr(PPOConfig, "reads_old_logprobs", property(lambda self: True))
    forced = _run(tmp_path, "forced", *extra)
    scoring = [[r["tokens_computed"]["scoring"] for r in x] for x in (skipped, forced)]
    assert sum(scoring[0]) == 0 and sum(scoring[1]) > 0  # the pass ran in one run only
    assert any(r["staleness_1"] > 0 for r in skipped)  # tokens sampled under earlier weights
    counts = ("efficiency", "tokens_computed", "tokens_real")
    assert [_without(r, counts) for r in skipped] == [_without(r, counts) for r in forced]


def _without(record: dict, keys) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


@pytest.mark.parametrize(
    "extra, message",
    [
        (("pipeline.mode=sync",), "refill is a carrying schedule's; pipeline.mode=sync"),
        (("pipeline.chunk_size=16",), r"must be a multiple of every chunk size \(\[16\]\)"),
        (("pipeline.adaptive_overcommit=true",), "refill decodes a fixed B"),
        (("rollout.carry_kv=stale",), "rollout.carry_kv"),
    ],
)
def test_settings_refill_cannot_run_are_refused(extra, message):
    args = ["pipeline.mode=oppo", "pipeline.overcommit=1", "rollout.refill_every=8", *extra]
    with pytest.raises(ConfigError, match=message):
        load_config(None, args)


@pytest.mark.slow  # two demo runs
def test_keep_and_replay_sample_the_same_tokens_when_the_weights_stay(demo_cache, tmp_path):
    """carry_kv keep (the rows' keys and values kept across the update) against replay (re-
    prefilled under the new weights), with a learning rate of 0: the weights never change, so
    both continue every row from the same context and sample the same tokens, step by step.
    Their old log-probs come from different programs (keep: the packed forward; replay: the
    replay prefill), so the losses agree to float32 rounding, not to the bit."""
    zero_lr = ("optim.actor_lr=0.0", "train.steps=3", "pipeline.chunk_size=8")
    keep = _run(tmp_path, "keep", "rollout.carry_kv=keep", *zero_lr)
    replay = _run(tmp_path, "replay", *zero_lr)
    same = ("reward", "gold", "response_len_mean", "response_len_max", "carried", "dropped",
            "staleness_0", "staleness_1", "staleness_2")  # fmt: skip
    rows = lambda records: [  # noqa: E731
        {**{k: r[k] for k in same}, "decode": r["efficiency"].get("decode")} for r in records
    ]
    assert rows(keep) == rows(replay)
    # keep replays nothing: less admission work from the second step on
    assert keep[1]["efficiency"]["admission"] > replay[1]["efficiency"]["admission"]
    assert keep[1]["carried"] > 0  # rows were in flight across a step boundary
    # The loss's bound: each path's old log-probs are a forward chain of n float32 summands
    # (tokens of the batch, P + R keys), ``tolerances.loss_tolerance``, the terms log-probs.
    actor, r = read_config(Path(demo_cache) / "demo" / "actor"), small_demo_config().rollout
    width = r.max_prompt_len + r.max_response_len
    n = tolerances.chain_summands((actor,), r.batch_size * width, width)
    rtol, atol = tolerances.loss_tolerance(n, math.log(actor.vocab_size))
    for a, b in zip(keep, replay, strict=True):
        np.testing.assert_allclose(a["policy_loss"], b["policy_loss"], rtol=rtol, atol=atol)
