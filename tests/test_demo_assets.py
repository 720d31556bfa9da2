"""The demo's SFT actor and reward model: training, Hugging Face round trip, cache, length stats."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oppo_jax
from oppo_jax.data import (
    EOS_ID,
    DemoTaskSpec,
    gold_scores,
    pad_batch,
    sample_preference_pairs,
    sample_sft_corpus,
)
from oppo_jax.demo import assets
from oppo_jax.demo.common import demo_model_config, join_batch, split_by_length, summary_lines
from oppo_jax.demo.sft import response_target_mask, sft_loss

SPEC = DemoTaskSpec()
# A smaller backbone than the default, so the whole file stays within a CPU minute.
SIZES = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
STEPS = 100  # SFT and RM steps at the test budget (compiling costs more than stepping)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tiny SFT actor and reward model, trained once for the module."""
    root = tmp_path_factory.mktemp("demo")
    sft = assets.train_sft(
        SPEC, root / "actor", STEPS, progress=False, model_cfg=demo_model_config(SPEC, **SIZES)
    )
    rm = assets.train_reward_model(
        SPEC,
        root / "reward",
        STEPS,
        progress=False,
        model_cfg=demo_model_config(SPEC, "score", **SIZES),
    )
    return root, sft, rm


def test_mask_and_split_helpers():
    mask = response_target_mask(jnp.array([2, 3]), jnp.array([4, 5]), 5)
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0], [0, 0, 1, 1]])
    parts = split_by_length(np.array([40, 5, 7, 9]), 74)
    assert [(idx.tolist(), width) for idx, width in parts] == [([1, 2, 3], 32), ([0], 74)]
    lengths = np.random.default_rng(0).integers(1, 70, 32)
    (short, short_width), (long, long_width) = split_by_length(lengths, 74)
    assert sorted([*short, *long]) == list(range(32)) and len(long) == 8
    assert lengths[short].max() <= min(lengths[long]) and long_width == 74
    assert short_width == (32 if lengths[short].max() <= 32 else 74)


@pytest.mark.slow  # trains the demo actor and reward model
def test_sft_actor_learns_and_loads_like_a_real_checkpoint(trained):
    root, sft, _ = trained
    assert sft["final_loss"] < sft["initial_loss"] - 0.1  # from about ln(52) = 3.95
    config = json.loads((root / "actor" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    model = oppo_jax.load_hf_model(root / "actor")
    ids = model.tokenizer.encode("w4 w5 <eos>", add_special_tokens=False)
    assert ids == [8, 9, 1]
    assert model.tokenizer.decode(ids) == "w4 w5 <eos>"

    corpus = sample_sft_corpus(SPEC, 64, np.random.default_rng(7))
    prompts, responses = [e.prompt for e in corpus], [e.response for e in corpus]
    # Reference: a loop over every response token (eos included) of the loaded model's logits.
    ids, _ = pad_batch([np.concatenate(pr) for pr in zip(prompts, responses, strict=True)], 0)
    logp = np.asarray(jax.nn.log_softmax(model.logits(ids), axis=-1), np.float64)
    nll = [
        -logp[i, t - 1, ids[i, t]]
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
        for t in range(len(p), len(p) + len(r))
    ]
    # The training loss, on the batch split by length and padded as training does, agrees.
    total = np.array([len(p) + len(r) for p, r in zip(prompts, responses, strict=True)])
    parts = []
    for idx, width in split_by_length(total, SPEC.max_prompt_len + SPEC.max_response_len):
        part = join_batch([prompts[i] for i in idx], [responses[i] for i in idx], width)
        parts.append(tuple(jnp.asarray(a) for a in part))
    loss = jax.jit(sft_loss, static_argnums=0)(model.config, model.params, tuple(parts))
    np.testing.assert_allclose(loss, np.mean(nll), rtol=1e-4)
    # Fresh data scores like the last training steps: the export kept the trained weights.
    assert abs(np.mean(nll) - sft["final_loss"]) < 0.1


@pytest.mark.slow  # trains the demo actor and reward model
def test_reward_model_ranks_held_out_pairs(trained):
    root, _, rm = trained
    config = json.loads((root / "reward" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    model = oppo_jax.load_hf_model(root / "reward")
    assert model.tokenizer.encode("w4 w5 <eos>", add_special_tokens=False) == [8, 9, 1]
    pairs = sample_preference_pairs(SPEC, 256, np.random.default_rng(11))
    rows = [np.concatenate([p.prompt, p.chosen]) for p in pairs]
    rows += [np.concatenate([p.prompt, p.rejected]) for p in pairs]
    ids, _ = pad_batch(rows, 0)
    chosen, rejected = np.split(np.asarray(model.score(ids, (ids > 0).astype(np.int32))), 2)
    accuracy = float(np.mean(chosen > rejected))
    assert accuracy >= 0.75, accuracy  # chance is 0.5
    assert abs(accuracy - rm["pair_accuracy"]) < 0.1
    assert rm["gold_corr"] > 0.5


@pytest.mark.slow  # trains the demo actor and reward model
def test_length_stats_describe_the_sampled_responses(trained):
    root, _, _ = trained
    tokens, lengths = assets.sample_responses(root / "actor", SPEC, n_prompts=64, seed=3)
    stats = assets.response_length_stats(root / "actor", SPEC, n_prompts=64, seed=3)
    # Lengths recomputed from the tokens: through the first eos, else the full capacity.
    is_eos = tokens == EOS_ID
    expected = np.where(is_eos.any(1), is_eos.argmax(1) + 1, SPEC.max_response_len)
    np.testing.assert_array_equal(lengths, expected)
    ordered = np.sort(lengths)
    assert stats["median"] == (ordered[31] + ordered[32]) / 2
    rank = 0.99 * 63  # linear interpolation between order statistics
    lo = int(rank)
    p99 = ordered[lo] + (rank - lo) * (ordered[lo + 1] - ordered[lo])
    assert stats["p99"] == pytest.approx(p99)
    assert stats["ratio"] == pytest.approx(p99 / stats["median"])
    assert stats["mean_gold"] == pytest.approx(gold_scores(tokens, lengths, SPEC).mean())
    assert stats["p99"] > stats["median"] >= 2  # the corpus has no one-token responses


@pytest.mark.slow
def test_ensure_demo_assets_caches_and_rebuilds(tmp_path, monkeypatch):
    calls = []
    for name in ("train_sft", "train_reward_model"):
        real = getattr(assets, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(assets, name, counted)

    def build(steps=4):
        return assets.ensure_demo_assets(
            tmp_path, SPEC, steps, steps, progress=False, model_sizes=SIZES
        )

    actor, reward = build()
    assert calls == ["train_sft", "train_reward_model"]
    assert oppo_jax.load_hf_model(actor).config.hidden_size == SIZES["hidden_size"]
    files = [actor / "model.safetensors", reward / "model.safetensors", tmp_path / assets.MARKER]
    mtimes = [os.stat(f).st_mtime_ns for f in files]
    assert build() == (actor, reward)
    assert len(calls) == 2  # cached: nothing retrained
    assert [os.stat(f).st_mtime_ns for f in files] == mtimes

    (tmp_path / assets.MARKER).unlink()  # as if the first build had been interrupted
    build()
    assert len(calls) == 4
    build(steps=5)  # a different recipe
    assert len(calls) == 6
    configs = [demo_model_config(SPEC), demo_model_config(SPEC, "score")]
    other_spec = DemoTaskSpec(long_prob=0.2)
    assert assets._recipe(SPEC, 5, 5, 0, configs) != assets._recipe(other_spec, 5, 5, 0, configs)
    marker = json.loads((tmp_path / assets.MARKER).read_text())
    assert marker["recipe"]["sft_steps"] == 5 and "pair_accuracy" in marker["reward"]


def test_sft_and_rm_commands_print_a_summary_not_a_dict():
    stats = {"initial_loss": 5.5123, "final_loss": 3.7312, "seconds": 95.24}
    assert summary_lines("SFT actor", "/c/actor", 3000, stats) == [
        "SFT actor: 3000 steps in 95.2 s (compilation and saving included)",
        "  saved to /c/actor (Hugging Face format)",
        "  loss 5.512 -> 3.731 (means of the first and last 20 steps)",
    ]
    stats |= {"pair_accuracy": 0.9125, "gold_corr": 0.8512}
    lines = summary_lines("reward model", "/c/reward", 5, stats)
    assert lines[2] == "  loss 5.512 -> 3.731 (first and last step)"
    assert lines[3] == (
        "  held out: picks the preferred response of 91.2% of pairs; "
        "correlation with the gold score 0.851"
    )
