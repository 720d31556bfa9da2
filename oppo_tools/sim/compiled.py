"""A step's programs priced from their compiler-counted FLOPs and bytes (``oppo-jax
compile-plan --json``: the registry compiled for the target), beside the roofline's hand
formulas (``sim.roofline``) for the same work. PROJECTION, both.

Compiled: per device, max(FLOPs / (peak · mfu), bytes accessed / HBM bandwidth), the target's
datasheet peaks (``roofline.HARDWARE``); the counts are XLA's own cost analysis of the
optimized program with every loop's trip count in (a decode chunk's loop at its C steps,
an upper bound: it stops at the cut). Hand: the roofline cost model of the config's model on
its chips (``roofline.roofline_cost_model``), fed the tokens the program computes at its
shape. Where they differ, one of them is wrong about the work: the table says which
program, and docs/PROJECTIONS.md why.
"""

from __future__ import annotations

from oppo_jax.base.shapes import chunk_budget, score_rows_per_call, score_width
from oppo_tools.sim.model import CostModel
from oppo_tools.sim.roofline import Hardware


def compiled_seconds(program: dict, hardware: Hardware, mfu: float) -> float:
    """Seconds of one program on one device from its compiler-counted work."""
    flops = program["flops"] / (hardware.peak_flops * mfu)
    return max(flops, program["bytes_accessed"] / hardware.hbm_bandwidth_bytes_s)


def hand_seconds(program: dict, cost: CostModel, shapes, minibatches: int) -> float | None:
    """The roofline formula's seconds for the work of ``program`` at its shape (``shapes``:
    the run's ``compile_plan.RunShapes``; ``minibatches`` per epoch); None for a family it has
    no formula for."""
    from oppo_jax.scoring.carried import REPLAY_CHUNK  # (JAX: only when a report is priced)

    family, shape = program["family"], program["shape"]
    s, p = shapes.slots, shapes.prompt_width
    if family == "admission prefill":
        return cost.admit_s(s * p) if program["role"] == "actor" else cost.prefill_s(s * p)
    if family == "replay":
        rows, _ = shape
        return cost.prefill_s(rows * REPLAY_CHUNK)
    if family == "decode":
        rows, size, width = shape
        return cost.decode_s(size, rows * size, rows * size * width)
    if family == "streamed scoring":
        size, _ = shape
        tokens = chunk_budget(s, size)[1] if shapes.compaction_floor is None else s * size
        return cost.prefill_s(tokens)
    if family == "sync scoring":
        return cost.prefill_s(score_rows_per_call(shapes.batch_size) * score_width(shapes.capacity))
    if family == "update":
        ((rows, width, _),) = shape
        _, chunks = shapes.update  # per minibatch; the cost model multiplies the epochs in
        return cost.update_s(rows * width * chunks * minibatches)
    return None


def compare(report: dict, cost: CostModel, hardware: Hardware, shapes, run: tuple) -> list[dict]:
    """One row per program of a compile report: compiled and hand seconds and their ratio
    (``run`` = (mfu, minibatches per epoch))."""
    mfu, minibatches = run
    rows = []
    for program in report["programs"]:
        hand = hand_seconds(program, cost, shapes, minibatches)
        compiled = compiled_seconds(program, hardware, mfu)
        rows.append(
            {
                "family": program["family"],
                "shape": program["shape"],
                "role": program["role"],
                "tflop": program["flops"] / 1e12,
                "gb": program["bytes_accessed"] / 1e9,
                "compiled_s": compiled,
                "hand_s": hand,
                "ratio": None if not hand else compiled / hand,
                "upper_bound": program.get("upper_bound", False),
            }
        )
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    """Markdown table of ``compare``'s rows."""
    lines = [
        "| program | shape | role | TFLOP | GB | compiled s | hand s | compiled / hand |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hand = "—" if r["hand_s"] is None else f"{r['hand_s']:.4f}"
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        bound = " (≤)" if r["upper_bound"] else ""
        lines.append(
            f"| {r['family']} | {tuple(r['shape'])} | {r['role']} | {r['tflop']:.2f}{bound} | "
            f"{r['gb']:.1f} | {r['compiled_s']:.4f} | {hand} | {ratio} |"
        )
    return lines
