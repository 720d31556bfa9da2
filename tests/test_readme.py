"""README.md's Python API example runs as written (with the small test demo and two steps)."""

import re
from pathlib import Path

import numpy as np
import pytest

from oppo_jax.data.demo_task import DemoTaskSpec
from oppo_jax.demo.assets import ensure_demo_assets
from tests.run_fixtures import small_demo_args, small_demo_config

README = Path(__file__).resolve().parents[1] / "README.md"
DEMO_RUN = '["train.steps=20"]'  # the example's overrides, swapped for the small test demo's


def api_example() -> str:
    """The Python block of README's "Python API" section."""
    found = re.search(r"## Python API\s*```python\n(.*?)```", README.read_text(), re.S)
    assert found, "the API example is missing from README.md"
    return found.group(1)


@pytest.mark.slow  # builds the small demo models when no other test has, then two steps
def test_the_api_example_runs_as_written(demo_cache, tmp_path, monkeypatch):
    cfg = small_demo_config()
    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    ensure_demo_assets(
        demo_cache / "demo", spec, cfg.train.sft_steps, cfg.train.rm_steps, progress=False
    )
    code = api_example()
    assert code.count(DEMO_RUN) == 1
    monkeypatch.chdir(tmp_path)  # the example writes exported/ and runs/ where it runs
    scope: dict = {}
    exec(code.replace(DEMO_RUN, repr(small_demo_args("train.steps=2"))), scope)
    vocab = scope["model"].config.vocab_size
    assert scope["logits"].shape == (2, 4, vocab) and scope["scores"].shape == (2,)
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    mask, scores = np.asarray(scope["attention_mask"], bool), np.asarray(scope["scores"])
    # γ = 1, λ = 0.95, zero values: a valid token's return is its row's score times λ^(steps
    # from the last valid token)
    to_last = mask.sum(axis=1, keepdims=True) - 1 - np.arange(mask.shape[1])
    expected = np.where(mask, scores[:, None] * 0.95 ** np.maximum(to_last, 0), 0.0)
    np.testing.assert_allclose(np.asarray(scope["returns"]), expected, rtol=1e-5, atol=1e-6)
    assert scope["summary"]["steps"] == 2
    assert (tmp_path / "runs" / "api-example" / "metrics.jsonl").is_file()
