"""Held-out evaluation (issue #17 part 3): eval.jsonl, sample tables and TensorBoard at step 0,
every eval.every steps and at the end; deterministic, identical after a resume, and on the
demo the gold score rises between the first and the last evaluation."""

import json

import numpy as np
import pytest

from oppo_jax.config import ConfigError, load_config
from oppo_jax.rewards.demo import sentiment
from oppo_jax.train import train
from tests.run_fixtures import small_demo_args

EVAL = (
    "eval.prompts=demo", "eval.num_prompts=6", "eval.greedy=false",
    "eval.samples_per_prompt=2", "eval.every=1",
)  # fmt: skip
OPPO = ("pipeline.mode=oppo", "pipeline.overcommit=2", "train.checkpoint_every=1")


def _cfg(*extra):
    return load_config(None, small_demo_args(*OPPO, *EVAL, *extra))


def _evals(run) -> list[dict]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.num_prompts=0"], "eval.num_prompts=0: must be >= 1"),
        (["eval.every=-1"], "eval.every=-1: must be >= 0"),
        (["eval.samples_per_prompt=3"], "greedy decoding gives one response per prompt"),
        (["eval.split=test"], "eval.split='test': data.prompts='demo' has no splits"),
        (["eval.prompts=random"], "random prompts have no held-out set"),
        (
            ["eval.prompts=demo", "model.actor_path=/a", "model.reward_path=/b"],
            "eval.prompts='demo': the demo's held-out prompts need the demo actor",
        ),
    ],
)
def test_eval_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.slow  # three short demo runs
def test_eval_records_samples_and_identical_resume(demo_cache, tmp_path):
    whole = tmp_path / "whole"
    train(_cfg("train.steps=2"), whole, progress=False, warmup=False)
    evals = _evals(whole)
    assert [e["step"] for e in evals] == [0, 1, 2]
    for e in evals:
        rows = [json.loads(x) for x in (whole / "samples" / f"step_{e['step']}.jsonl").open()]
        assert len(rows) == e["num_samples"] == 12
        # the record's numbers are the table's: reward mean, and gold from the response text
        assert np.mean([r["reward"] for r in rows]) == pytest.approx(e["reward"], abs=1e-6)
        gold = np.mean([sentiment(r["prompt"], r["response"], {}) for r in rows])
        assert gold == pytest.approx(e["gold"], abs=1e-9)
        assert e["response_len_mean"] >= 1 and np.isfinite(e["kl"])
    assert abs(evals[0]["kl"]) < 1e-4  # the actor is the reference before the first update
    assert list((whole / "tensorboard").glob("*.eval"))
    # stopped after step 1 (its final evaluation), then resumed to step 2: the same numbers
    part = tmp_path / "part"
    train(_cfg("train.steps=1"), part, progress=False, warmup=False)
    train(_cfg("train.steps=2"), part, resume=True, progress=False, warmup=False)
    assert _evals(part) == evals
    for step in (0, 1, 2):
        name = f"samples/step_{step}.jsonl"
        assert (part / name).read_text() == (whole / name).read_text()


@pytest.mark.slow  # a 10-step demo run
def test_eval_shows_the_gold_rise_on_the_demo(demo_cache, tmp_path):
    cfg = _cfg(
        "train.steps=10", "train.checkpoint_every=0", "eval.every=0", "eval.num_prompts=32",
        "eval.samples_per_prompt=2", "rollout.batch_size=16", "optim.actor_lr=5e-4",
        "reward.model_weight=0", "reward.functions=[oppo_jax.rewards.demo:sentiment]",
        "model.critic_init=actor",
    )  # fmt: skip
    train(cfg, tmp_path / "run", progress=False, warmup=False)
    first, last = _evals(tmp_path / "run")
    assert (first["step"], last["step"]) == (0, 10)
    assert last["gold"] > first["gold"] + 0.05, (first, last)
    assert last["reward_fn/sentiment"] == pytest.approx(last["gold"], abs=1e-9)


def test_two_evaluations_within_one_second_keep_two_event_files(tmp_path):
    """Each evaluation's TensorBoard events go to a file of its own, even when two open within
    the same second (the file name holds the second it was opened, and the step)."""
    from oppo_jax.run.evaluate import _tensorboard

    rows = [{"prompt": "p", "response": "r", "reward": 1.0}]
    for step in (10, 20):
        _tensorboard(tmp_path, step, {"step": step, "reward": 0.5}, rows)
    files = sorted((tmp_path / "tensorboard").glob("*.eval"))
    assert [f.name.rsplit(".", 2)[-2] for f in files] == ["step10", "step20"]
