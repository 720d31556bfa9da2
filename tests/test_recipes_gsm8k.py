"""docs/RECIPES.md section 7's GRPO-on-GSM8K configs: each loads a tiny random model of its
architecture family (Qwen2, with the preset's tied or untied embeddings) through the real
import path (a Hugging Face directory read by ``load_hf_model``), a GSM8K-shaped saved
``DatasetDict`` through its own data keys (chat template, system prompt, answer field, splits),
and runs two steps on the CPU with the math verifier and the evaluation's pass@1 and mean@k."""

import json
from pathlib import Path

import pytest

from oppo_jax.config import load_config
from oppo_jax.models.model_config import PRESETS

datasets = pytest.importorskip("datasets")

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(p.stem for p in CONFIGS.glob("*_gsm8k.yaml"))
# What makes a real-size config run on a CPU in seconds; everything else is the recipe's own.
CPU_RUN = [
    "mesh.fsdp=1", "mesh.tensor=1", "model.dtype=float32", "model.param_dtype=float32",
    "rollout.batch_size=8", "rollout.group_size=4", "rollout.max_prompt_len=192",
    "rollout.max_response_len=16", "ppo.grad_accum_steps=1", "pipeline.chunk_size=8",
    "pipeline.chunk_candidates=[8]", "pipeline.chunk_tuning=false",
    "pipeline.adaptive_overcommit=false", "pipeline.overcommit=1", "train.steps=2",
    "train.checkpoint_every=0", "eval.num_prompts=4", "eval.mean_at_k=2",
]  # fmt: skip


def gsm8k_splits(n_train: int, n_test: int) -> dict[str, list[dict]]:
    """GSM8K-shaped records (question; answer with a rationale and '#### n', commas in n)."""

    def rows(start, n):
        out = []
        for i in range(start, start + n):
            a, b = 17 * i + 5, 990 + 3 * i
            answer = f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}\n#### {a + b:,}"
            out.append({"question": f"Ana has {a} apples and buys {b} more. How many?",
                        "answer": answer})  # fmt: skip
        return out

    return {"train": rows(0, n_train), "test": rows(n_train, n_test)}


def test_there_are_six_recipes_and_they_name_their_presets():
    assert RECIPES == [
        f"qwen2.5-{m}_{hw}_gsm8k"
        for m in ("0.5b", "1.5b", "math-7b")
        for hw in ("gh200x1", "tpu-v5p-8")
    ]
    for name in RECIPES:
        cfg = load_config(name)
        assert cfg.model.preset == name.split("_")[0]
        assert cfg.reward.functions == ["oppo_jax.rewards.math:verify"]
        assert (cfg.data.answer_field, cfg.eval.split, cfg.eval.greedy) == ("answer", "test", True)
        assert cfg.eval.mean_at_k == 4


@pytest.mark.slow  # six two-step runs of a tiny model
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_two_steps_on_a_tiny_model_of_its_family(name, tmp_path):
    from oppo_jax.models.api import load_hf_model
    from oppo_jax.train import train
    from tests.hf_fixtures import save_tiny_hf_model
    from tests.test_math_data import byte_tokenizer

    cfg = load_config(name)
    arch = PRESETS[cfg.model.preset]
    model = tmp_path / "model"
    tokenizer = byte_tokenizer(model)
    save_tiny_hf_model(
        model, "qwen2", "ForCausalLM", vocab_size=len(tokenizer), max_position_embeddings=256,
        tie_word_embeddings=arch.tie_word_embeddings,
    )  # fmt: skip
    loaded = load_hf_model(model)
    assert loaded.config.model_type == arch.model_type == "qwen2"
    assert loaded.config.tie_word_embeddings == arch.tie_word_embeddings
    data = tmp_path / "gsm8k"
    splits = {k: datasets.Dataset.from_list(v) for k, v in gsm8k_splits(24, 4).items()}
    datasets.DatasetDict(splits).save_to_disk(str(data))
    paths = [f"model.actor_path={model}", f"model.reward_path={model}", f"data.prompts={data}"]
    run = tmp_path / "run"
    train(load_config(name, paths + CPU_RUN), run, progress=False, warmup=False)

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all("reward_fn/verify" in m for m in metrics)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert e["num_samples"] == 4 and e["k"] == 2
        assert 0 <= e["pass@1"] <= 1 and 0 <= e["mean@k"] <= 1
        rows = [json.loads(x) for x in (run / "samples" / f"step_{e['step']}.jsonl").open()]
        assert all(
            r["prompt"].startswith(f"<system>{cfg.data.system_prompt}</system>") for r in rows
        )
