"""benchmarks/shared_prefix_update_estimate.py's ratio: an update computing each group's prompt
once, over one computing every sample's, against hand counts of tokens and causal pairs."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from oppo_tools.sim.model import CostModel

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "shared_prefix_update_estimate.py"


def _estimate():
    spec = importlib.util.spec_from_file_location("shared_prefix_update_estimate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cost(u1: float, a: float) -> CostModel:
    fields = {f: 0.0 for f in CostModel.__dataclass_fields__}
    return CostModel(**(fields | {"update_u1": u1, "update_a": a}))


def test_the_ratio_counts_each_groups_prompt_once():
    ratio = _estimate().update_ratio
    lengths = np.array([3, 3])  # every draw is 3: a batch of 4 in 2 groups of 2, prompt 5
    # tokens alone: 4 x (5 + 3) = 32 per-sample against 2 x 5 + 4 x 3 = 22 shared
    assert ratio(_cost(1.0, 0.0), lengths, 4, 2, 5, steps=3) == pytest.approx(22 / 32)
    # pairs alone: 4 x 8·9/2 = 144 against 2 x 5·6/2 + 4 x (3·5 + 3·4/2) = 30 + 84 = 114
    assert ratio(_cost(0.0, 1.0), lengths, 4, 2, 5, steps=3) == pytest.approx(114 / 144)
    # one sample a group, or no prompt: nothing is shared
    assert ratio(_cost(1.0, 1.0), np.array([1, 7, 30]), 4, 1, 5) == pytest.approx(1.0)
    assert ratio(_cost(1.0, 1.0), np.array([1, 7, 30]), 4, 2, 0) == pytest.approx(1.0)
