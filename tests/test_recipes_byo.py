"""docs/RECIPES.md "Bring your own model and data": its worked example runs as written (a saved
DatasetDict of conversations, a chat template, one reward function, an evaluation), here with
the small test actor and two steps."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from oppo_jax.data.demo_task import DemoTaskSpec
from oppo_jax.demo.assets import ensure_demo_assets
from tests.run_fixtures import small_demo_config
from tests.xla_flags import COMPILE_FLAGS

RECIPES = Path(__file__).resolve().parents[1] / "docs" / "RECIPES.md"


def example_code() -> str:
    """The Python block after the <!-- byo-example --> marker."""
    text = RECIPES.read_text()
    found = re.search(r"<!-- byo-example -->\s*```python\n(.*?)```", text, re.S)
    assert found, "the worked example is missing from docs/RECIPES.md"
    return found.group(1)


@pytest.mark.slow  # a two-step training run in a fresh process
def test_the_worked_example_runs_as_written(demo_cache, tmp_path):
    cfg = small_demo_config()
    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    actor, _ = ensure_demo_assets(
        demo_cache / "demo", spec, cfg.train.sft_steps, cfg.train.rm_steps, progress=False
    )
    env = dict(os.environ, BYO_WORK=str(tmp_path / "byo"), BYO_ACTOR=str(actor), BYO_STEPS="2")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    env["XLA_FLAGS"] = COMPILE_FLAGS  # the command adds its own device count
    done = subprocess.run(
        [sys.executable, "-c", example_code()], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "byo" / "run"
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and "reward_model" not in evals[0]
    test_rows = datasets.load_from_disk(str(tmp_path / "byo" / "prompts"))["test"]
    for e in evals:
        samples = [json.loads(x) for x in (run / "samples" / f"step_{e['step']}.jsonl").open()]
        assert len(samples) == 32
        for s in samples:  # the reward recomputed from the sample's text and its record
            target = test_rows[s["prompt_index"]]["target"]
            assert s["prompt"] == test_rows[s["prompt_index"]]["messages"][0]["content"]
            expected = -abs(len(s["response"].split()) - target) / target
            assert s["reward"] == pytest.approx(expected, abs=1e-9)
        mean = sum(s["reward"] for s in samples) / len(samples)
        assert e["reward_fn/near_target"] == pytest.approx(mean, abs=1e-9)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all("reward_fn/near_target" in r for r in records)
