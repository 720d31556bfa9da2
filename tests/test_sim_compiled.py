"""The simulator's pricing of compiled programs (``oppo_tools.sim.compiled``) against the
roofline's hand formulas, on a report whose counts are chosen by hand."""

import pytest

from oppo_jax.config import load_config
from oppo_jax.pipeline.compile_plan import run_shapes
from oppo_tools.sim.compiled import compare, compiled_seconds, format_rows
from oppo_tools.sim.model import CostModel
from oppo_tools.sim.roofline import HARDWARE


def _program(family, shape, flops, nbytes, role="actor"):
    return {"family": family, "shape": shape, "role": role, "flops": flops,
            "bytes_accessed": nbytes, "upper_bound": family == "decode"}  # fmt: skip


def test_compiled_seconds_are_the_slower_of_compute_and_memory():
    gh200 = HARDWARE["gh200"]
    compute_bound = _program("update", [[1, 8, 8]], 989e12, 1e9)
    memory_bound = _program("decode", [8, 16, 80], 1e9, 8e12)
    assert compiled_seconds(compute_bound, gh200, 0.5) == pytest.approx(2.0)
    assert compiled_seconds(memory_bound, gh200, 0.5) == pytest.approx(2.0)


def test_hand_formulas_get_the_tokens_each_program_computes():
    cfg = load_config("qwen2.5-7b_gh200x1_lora_grpo")
    shapes = run_shapes(cfg, backend="gpu")
    cost = CostModel(decode_a=1.0, decode_b=0.1, decode_c=0.001, prefill_p0=2.0, prefill_p1=0.5,
                     admit_p0=3.0, admit_p1=0.25, update_u0=4.0, update_u1=0.01)  # fmt: skip
    size, width = shapes.chunk_sizes[0], shapes.capacity
    report = {"programs": [
        _program("admission prefill", ["prompts"], 1e12, 1e9),
        _program("decode", [shapes.slots, size, width], 1e12, 1e9),
        _program("update", [list(shapes.update[0])], 1e12, 1e9),
        _program("experience", ["batch"], 1e6, 1e6),
    ]}  # fmt: skip
    rows = compare(report, cost, HARDWARE["gh200"], shapes, (0.5, cfg.ppo.num_minibatches))
    s, p = shapes.slots, shapes.prompt_width
    assert rows[0]["hand_s"] == pytest.approx(3.0 + 0.25 * s * p)
    decode = 1.0 * size + 0.1 * s * size + 0.001 * s * size * width
    assert rows[1]["hand_s"] == pytest.approx(decode)
    (r, w, _), chunks = shapes.update
    assert rows[2]["hand_s"] == pytest.approx(4.0 + 0.01 * r * w * chunks * cfg.ppo.num_minibatches)
    assert rows[3]["hand_s"] is None and rows[3]["ratio"] is None
    assert rows[1]["ratio"] == pytest.approx(rows[1]["compiled_s"] / decode)
    table = format_rows(rows)
    assert table[2].startswith("| admission prefill |") and "(≤)" in table[3]
