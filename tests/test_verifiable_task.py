"""The built-in verifiable task (``data.prompts: arith``): a deterministic generator with
disjoint splits, the exact-match rule reward, the evaluation's exact_match, and the GRPO demo's
config."""

import json

import numpy as np
import pytest

from oppo_jax.config import ConfigError, load_config
from oppo_jax.data.arith_task import (
    ArithRecords,
    ArithSpec,
    carryless_sum,
    encode,
    record,
    sample_sft_pairs,
    split_pairs,
)
from oppo_jax.data.demo_task import EOS_ID, PAD_ID, load_tokenizer, save_tokenizer
from oppo_jax.data.sources import open_source
from oppo_jax.rewards.arith import exact_match

SPEC = ArithSpec()


def _pairs(rows) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in rows}


def _true_answer(prompt: str) -> str:
    """The sum of a prompt's text "4 0 + 3 8 =" (<bos> skipped), written digit by digit."""
    left, right = prompt.removesuffix("=").split("+")
    return " ".join(str(int(left.replace(" ", "")) + int(right.replace(" ", ""))))


def test_generator_is_deterministic_and_splits_are_disjoint():
    train, test = _pairs(split_pairs(SPEC, "train")), _pairs(split_pairs(SPEC, "test"))
    assert len(test) == SPEC.num_test and not train & test
    assert len(train | test) == 10 ** (2 * SPEC.digits)  # every ordered pair, once
    assert np.array_equal(split_pairs(ArithSpec(), "test"), split_pairs(SPEC, "test"))
    assert _pairs(split_pairs(ArithSpec(seed=1), "test")) != test  # the seed moves the split
    # the RL prompts and the SFT corpus come from train only, and repeat from their seeds
    rl = ArithRecords(SPEC, "train")
    assert len(rl) == SPEC.num_train_prompts
    held_out = {r["prompt"] for r in open_source("arith", "test").records()}
    assert len(held_out) == SPEC.num_test and not held_out & {r["prompt"] for r in rl.records()}
    a = sample_sft_pairs(SPEC, 200, np.random.default_rng(3))
    b = sample_sft_pairs(SPEC, 200, np.random.default_rng(3))
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b, strict=True))
    test_prompts = {tuple(encode(*p).prompt.tolist()) for p in test}
    assert not test_prompts & {tuple(x.prompt.tolist()) for x in a}


def test_records_carry_the_answer_and_the_tokenizer_matches_the_ids():
    r = record(57, 68)
    assert r == {"prompt": "<bos> 5 7 + 6 8 =", "answer": "1 2 5"}
    assert _true_answer("5 7 + 6 8 =") == "1 2 5"
    assert carryless_sum(57, 68) == 15 and carryless_sum(50, 50) == 0 and carryless_sum(3, 4) == 7
    for rec in ArithRecords(SPEC, "test").records():
        assert rec["answer"] == _true_answer(rec["prompt"].removeprefix("<bos> "))


def test_the_actor_tokenizer_reads_records_as_the_sft_ids(tmp_path):
    save_tokenizer(SPEC, tmp_path)
    tok = load_tokenizer(tmp_path, probe="<bos> 1 2 + 9 = 2 1 <eos>")
    ex = encode(12, 9)
    assert tok.encode(record(12, 9)["prompt"], add_special_tokens=False) == ex.prompt.tolist()
    assert ex.response.tolist() == [4 + 2, 4 + 1, EOS_ID]
    assert (tok.pad_token_id, tok.eos_token_id, len(tok)) == (PAD_ID, EOS_ID, SPEC.vocab_size)


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("1 2 5", 1.0),  # right (what "1 2 5 <eos>" decodes to)
        ("1 2 4", 0.0),  # a wrong digit
        ("1 5", 0.0),  # carry-less
        ("1 2", 0.0),  # a digit missing
        ("1 2 5 0", 0.0),  # a digit more
        ("1 2 5 +", 0.0),  # a token more
        ("1 2 5 ", 0.0),  # a space more
        ("125", 0.0),  # not written digit by digit
        ("", 0.0),
    ],
)
def test_exact_match_is_exact(response, reward):
    assert exact_match("5 7 + 6 8 =", response, record(57, 68)) == reward


def test_exact_match_tolerates_only_the_eos(tmp_path):
    save_tokenizer(SPEC, tmp_path)
    tok = load_tokenizer(tmp_path, probe="<bos> 1 2 + 9 = 2 1 <eos>")
    right = encode(57, 68).response.tolist()  # 1 2 5 <eos>

    def score(ids):  # as the reward runner decodes a response
        return exact_match("", tok.decode(ids, skip_special_tokens=True), record(57, 68))

    assert score(right) == 1.0 and score(right[:-1]) == 1.0  # with or without the eos
    assert score(right[:-1] + [4 + 3, EOS_ID]) == 0.0  # an extra digit before the eos
    with pytest.raises(KeyError, match="answer"):
        exact_match("", "1", {"prompt": "1 + 0 ="})


def test_grpo_demo_config_loads_and_validates():
    cfg = load_config("grpo_demo_cpu")
    assert (cfg.data.prompts, cfg.eval.split) == ("arith", "test")
    assert cfg.model.actor_path == "demo_arith"
    assert cfg.reward.functions == ["oppo_jax.rewards.arith:exact_match"]
    assert (cfg.rollout.group_size, cfg.ppo.advantage, cfg.reward.model_weight) == (4, "grpo", 0)
    with pytest.raises(ConfigError, match="model.reward_path='demo_arith' names no reward model"):
        load_config("grpo_demo_cpu", ["reward.model_weight=1"])


@pytest.mark.slow  # trains a small SFT actor (800 steps, about 10 s) and runs one GRPO step
def test_eval_exact_match_is_the_share_of_exact_answers(demo_cache, tmp_path):
    from oppo_jax.train import train

    overrides = [
        "train.sft_steps=800", "train.steps=1", "train.checkpoint_every=0", "eval.every=1",
        "eval.num_prompts=48", "rollout.batch_size=8", "pipeline.mode=sync",
    ]  # fmt: skip
    train(load_config("grpo_demo_cpu", overrides), tmp_path, progress=False, warmup=False)
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1]
    for e in evals:
        rows = [json.loads(x) for x in (tmp_path / "samples" / f"step_{e['step']}.jsonl").open()]
        assert len(rows) == e["num_samples"] == 48
        right = sum(r["response"] == _true_answer(r["prompt"]) for r in rows)
        assert e["exact_match"] == pytest.approx(right / len(rows), abs=1e-12)
        assert 0 < right < len(rows)  # both kinds present: the count can tell them apart
        assert e["exact_match"] == pytest.approx(e["reward_fn/exact_match"], abs=1e-12)
    assert (tmp_path / "plots" / "eval_exact_match.png").is_file()
    # The run's printed summary ends with the held-out accuracy, first and last evaluation.
    from oppo_jax.train import summarize

    first, last = evals[0], evals[-1]
    assert summarize(tmp_path / "metrics.jsonl")["held_out_exact_match"] == (
        f"{first['exact_match']:.3f} (step 0) -> {last['exact_match']:.3f} (step 1)"
    )
