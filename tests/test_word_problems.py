"""The built-in word problems (``data.prompts: word_problems``): a deterministic generator with
disjoint splits, GSM8K-shaped answers the real math verifier accepts (and whose forgotten
carries it rejects), a tokenizer that reads the records as the SFT ids and decodes numbers
whole, and the CPU math config, which loads and runs two steps."""

import json

import numpy as np
import pytest

from oppo_jax.config import load_config
from oppo_jax.data.answers import after_hashes
from oppo_jax.data.demo_task import EOS_ID
from oppo_jax.data.sources import open_source
from oppo_jax.data.word_problems import (
    TEMPLATES,
    WordProblemRecords,
    WordProblemSpec,
    build_tokenizer,
    encode,
    forget_carries,
    record,
    sample_sft,
    split_problems,
)

SPEC = WordProblemSpec()


def _keys(rows) -> set[tuple[int, int, int]]:
    return {(int(t), int(a), int(b)) for t, a, b, *_ in rows}


def test_generator_is_deterministic_and_splits_are_disjoint():
    train, test = _keys(split_problems(SPEC, "train")), _keys(split_problems(SPEC, "test"))
    assert len(test) == SPEC.num_test and not train & test
    # every problem once: 2 addition templates x 100 x 100, 2 subtraction ones x (a >= b) pairs
    assert len(train | test) == 2 * 100 * 100 + 2 * (100 * 101 // 2)
    assert np.array_equal(split_problems(WordProblemSpec(), "test"), split_problems(SPEC, "test"))
    assert _keys(split_problems(WordProblemSpec(seed=1), "test")) != test
    rl = WordProblemRecords(SPEC, "train")
    assert len(rl) == SPEC.num_train_prompts
    held_out = {r["prompt"] for r in open_source("word_problems", "test").records()}
    assert len(held_out) == SPEC.num_test and not held_out & {r["prompt"] for r in rl.records()}
    a = sample_sft(SPEC, 100, np.random.default_rng(3))
    b = sample_sft(SPEC, 100, np.random.default_rng(3))
    assert all(np.array_equal(x.response, y.response) for x, y in zip(a, b, strict=True))
    tok = build_tokenizer(SPEC)
    test_prompts = {tuple(tok.encode(r["prompt"]).ids) for r in held_out_records()}
    assert not test_prompts & {tuple(x.prompt.tolist()) for x in a}


def held_out_records():
    return list(WordProblemRecords(SPEC, "test").records())


def test_records_are_gsm8k_shaped_and_right():
    add = record([0, 17, 25, 0, 0])
    assert add == {
        "prompt": "<bos> Ana has 17 apples and buys 25 more. How many apples does Ana have now?",
        "answer": "17 + 25 = 42 #### 42",
    }
    assert record([2, 52, 17, 1, 2])["answer"] == "52 - 17 = 35 #### 35"
    assert forget_carries(57, 68, "+") == 15 and forget_carries(52, 17, "-") == 45
    assert forget_carries(40, 3, "+") == 43 and forget_carries(43, 21, "-") == 22  # none to drop
    for rec in held_out_records():
        left, op, right, _, result, *_ = rec["answer"].split()
        assert int(result) == (int(left) + int(right) if op == "+" else int(left) - int(right))
        assert int(result) >= 0 and f" {left} " in rec["prompt"] and f" {right} " in rec["prompt"]
    assert {op for op, _ in TEMPLATES} == {"+", "-"}


def test_the_tokenizer_decodes_numbers_whole_and_refuses_unknown_words():
    tok = build_tokenizer(SPEC)
    rec = record([1, 64, 9, 4, 6])
    ex = encode(tok, [1, 64, 9, 4, 6])
    assert tok.decode(ex.prompt.tolist(), skip_special_tokens=True) == rec["prompt"][6:]
    assert ex.response.tolist()[-1] == EOS_ID
    assert tok.decode(ex.response.tolist()) == "64 + 9 = 73 #### 73" == rec["answer"]
    assert len(ex.prompt) <= SPEC.max_prompt_len and len(ex.response) <= SPEC.max_response_len
    assert tok.get_vocab_size() == SPEC.vocab_size
    with pytest.raises(Exception, match="UNK|unk"):
        tok.encode("zebra")


@pytest.mark.parametrize("wrong", [False, True])
def test_the_real_verifier_reads_the_answers(wrong):
    from oppo_jax.rewards.math import verify

    tok = build_tokenizer(SPEC)
    for row in split_problems(SPEC, "test")[:40]:
        rec = record(row)
        t, a, b = map(int, row[:3])
        op = TEMPLATES[t][0]
        dropped = forget_carries(a, b, op)
        if wrong and dropped == (a + b if op == "+" else a - b):
            continue  # no carry to forget: the answer is right either way
        ex = encode(tok, row, dropped if wrong else None)
        response = tok.decode(ex.response.tolist(), skip_special_tokens=True)
        assert after_hashes(response) == str(dropped if wrong else int(rec["answer"].split()[-1]))
        assert verify(rec["prompt"], response, rec, "gsm8k") == (0.0 if wrong else 1.0)


def test_math_cpu_config_loads():
    cfg = load_config("grpo_math_cpu")
    assert (cfg.data.prompts, cfg.eval.split, cfg.model.actor_path) == (
        "word_problems",
        "test",
        "demo_word_problems",
    )
    assert cfg.reward.functions == ["oppo_jax.rewards.math:verify"]
    assert cfg.reward.kwargs == [{"extract": "gsm8k"}]
    assert cfg.rollout.max_prompt_len >= SPEC.max_prompt_len
    assert cfg.rollout.max_response_len >= SPEC.max_response_len


@pytest.mark.slow  # a 60-step SFT actor and two GRPO steps with the real verifier
def test_math_cpu_config_runs_two_steps(demo_cache, tmp_path):
    from oppo_jax.train import train

    overrides = [
        "train.sft_steps=60", "train.steps=2", "train.checkpoint_every=0", "eval.num_prompts=16",
        "eval.mean_at_k=2",
    ]  # fmt: skip
    train(load_config("grpo_math_cpu", overrides), tmp_path, progress=False, warmup=False)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all("reward_fn/verify" in m for m in metrics)
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        rows = [json.loads(x) for x in (tmp_path / "samples" / f"step_{e['step']}.jsonl").open()]
        truth = {r["prompt"]: r["answer"].split()[-1] for r in held_out_records()}
        right = [after_hashes(r["response"]) == truth["<bos> " + r["prompt"]] for r in rows]
        assert e["pass@1"] == pytest.approx(np.mean(right), abs=1e-12)
        assert e["k"] == 2 and 0 <= e["mean@k"] <= 1
