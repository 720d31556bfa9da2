"""Held-out accuracy as the field reports it: greedy ``pass@1`` and ``mean@k`` over k responses
per prompt sampled at the training temperature, in eval.jsonl, the sample tables, the plots and
the run summary."""

import json
from collections import Counter

import pytest

from oppo_jax.config import ConfigError, load_config


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _right(row) -> bool:
    """Whether a response of the addition task is the prompt's sum, digit by digit."""
    left, right = row["prompt"].removesuffix("=").split("+")
    total = int(left.replace(" ", "")) + int(right.replace(" ", ""))
    return row["response"] == " ".join(str(total))


def test_mean_at_k_is_validated():
    assert load_config("grpo_math_cpu").eval.mean_at_k == 4
    assert load_config("grpo_demo_cpu").eval.mean_at_k == 0  # off unless set
    with pytest.raises(ConfigError, match="eval.mean_at_k=-1: must be >= 0"):
        load_config("grpo_demo_cpu", ["eval.mean_at_k=-1"])


@pytest.mark.slow  # the addition task's small SFT actor (800 steps, shared) and two GRPO steps
def test_pass_at_1_is_greedy_and_mean_at_k_averages_k_samples(demo_cache, tmp_path):
    from oppo_jax.train import summarize, train

    k, n = 3, 48
    overrides = [
        "train.sft_steps=800", "train.steps=2", "train.checkpoint_every=0", "eval.every=0",
        f"eval.num_prompts={n}", f"eval.mean_at_k={k}", "rollout.batch_size=8",
        "pipeline.mode=sync",
    ]  # fmt: skip
    train(load_config("grpo_demo_cpu", overrides), tmp_path, progress=False, warmup=False)
    evals = _rows(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert {"pass@1", "mean@k", "k"} <= set(e) and e["k"] == k
        greedy = _rows(tmp_path / "samples" / f"step_{e['step']}.jsonl")
        sampled = _rows(tmp_path / "samples" / f"step_{e['step']}_k.jsonl")
        # one greedy response per prompt; k sampled ones per prompt
        assert len(greedy) == n and Counter(r["prompt_index"] for r in greedy) == Counter(range(n))
        assert Counter(r["prompt_index"] for r in sampled) == Counter({i: k for i in range(n)})
        # the values: the share of right responses, counted here from the responses themselves
        assert e["pass@1"] == pytest.approx(sum(map(_right, greedy)) / n, abs=1e-12)
        assert e["mean@k"] == pytest.approx(sum(map(_right, sampled)) / (n * k), abs=1e-12)
        assert 0 < e["pass@1"] < 1 and 0 < e["mean@k"] < 1  # both kinds: the counts can tell
        # sampled, not greedy: some prompt's k responses differ from each other
        by_prompt = {}
        for r in sampled:
            by_prompt.setdefault(r["prompt_index"], set()).add(r["response"])
        assert any(len(v) > 1 for v in by_prompt.values())
    assert (tmp_path / "plots" / "eval_accuracy.png").is_file()
    summary = summarize(tmp_path / "metrics.jsonl")
    first, last = evals
    assert (
        summary["held_out_pass@1"]
        == f"{first['pass@1']:.3f} (step 0) -> {last['pass@1']:.3f} (step 2)"
    )
    assert (
        summary["held_out_mean@k"]
        == f"{first['mean@k']:.3f} (step 0) -> {last['mean@k']:.3f} (step 2)"
    )
