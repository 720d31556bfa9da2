"""The pipeline simulator (oppo_jax.sim) on hand-made cases with numbers worked out by hand."""

import dataclasses
import json

import numpy as np
import pytest

from oppo_jax.sim import (
    CostModel,
    calibrate,
    calibrate_from_bench,
    project_cost_model,
    recommend,
    roofline_cost_model,
    simulate,
)
from oppo_jax.sim.cli import demo_lengths, main

COST = CostModel(
    decode_a=1e-3, decode_b=1e-4, decode_c=1e-6, prefill_p0=2e-4, prefill_p1=1e-5, n_scorers=3,
    admit_p0=5e-4, admit_p1=2e-5, update_u0=1e-2, update_u1=1e-5, copy_s=3e-3,
)  # fmt: skip


def _decode(cost, lengths, base, cut):
    """Σ over lockstep positions t < cut of a + b·S_t + c·Σ ctx, by brute force."""
    total = 0.0
    for t in range(cut):
        running = [i for i, n in enumerate(lengths) if n > t]
        ctx = sum(base[i] + t for i in running)
        total += cost.decode_a + cost.decode_b * len(running) + cost.decode_c * ctx
    return total


def _one(schedule, lengths, b, **kw):
    kw = {"seed": None, "steps": 1, **kw}
    return simulate(COST, schedule, b, lengths, **kw)


def test_equal_lengths_intra_hides_exactly_the_overlapped_scoring():
    b, n, c, p = 8, 64, 16, 16
    kw = {"chunk_size": c, "prompt_len": p, "steps": 3}
    sync, intra = _one("sync", [n], b, **kw), _one("intra", [n], b, **kw)
    inter, oppo = _one("inter", [n], b, **kw), _one("oppo", [n], b, **kw)
    admit, dec = COST.admit_s(b * p), _decode(COST, [n] * b, [p] * b, n)
    tail = COST.update_s(b, b * (p + n)) + COST.copy_s
    expected_sync = admit + dec + COST.scorers_s(b * p) + COST.scorers_s(b * n) + tail
    # Intra: the scorers' admission and chunks 0..K-2 hide under decoding; only the last
    # chunk's scoring is exposed (each chunk's scoring is shorter than a decode chunk).
    expected_intra = admit + dec + COST.scorers_s(b * c) + tail
    assert COST.scorers_s(b * c) < _decode(COST, [c] * b, [p] * b, c)
    np.testing.assert_allclose(sync.step_times, expected_sync, rtol=1e-12)
    np.testing.assert_allclose(intra.step_times, expected_intra, rtol=1e-12)
    hidden = COST.scorers_s(b * p) + COST.scorers_s(b * n) - COST.scorers_s(b * c)
    assert sync.step_times[0] - intra.step_times[0] == pytest.approx(hidden, rel=1e-9)
    np.testing.assert_allclose(inter.step_times, sync.step_times, rtol=1e-12)  # Δ = 0
    np.testing.assert_allclose(oppo.step_times, intra.step_times, rtol=1e-12)
    # Δ > 0 with equal lengths only adds slots to prefill and decode.
    assert _one("inter", [n], b, delta=2, **kw).step_times.mean() > sync.step_times.mean()
    # Gantt events: score k on the scoring group starts after decode k ends.
    ev = intra.events[0]
    decodes = [e for e in ev if e.stage == "decode"]
    scores = [e for e in ev if e.stage == "score"]
    assert len(decodes) == len(scores) == n // c
    assert all(
        s.group == "scoring" and s.start >= d.end for d, s in zip(decodes, scores, strict=True)
    )


def test_colocated_intra_gains_nothing():
    b, n, c = 8, 64, 16
    kw = {"chunk_size": c, "prompt_len": 4, "placement": "colocated"}
    sync, intra = _one("sync", [n], b, **kw), _one("intra", [n], b, **kw)
    # One group, serial: the same work plus (K - 1) more calls of each scorer.
    extra = COST.n_scorers * COST.prefill_p0 * (n // c - 1)
    assert intra.step_times[0] - sync.step_times[0] == pytest.approx(extra, rel=1e-9)
    assert {e.group for e in intra.events[0]} == {"generation"}
    free = dataclasses.replace(COST, prefill_p0=0.0)
    same = [simulate(free, s, b, [37, 5, 64, 12], seed=None, steps=4, **kw).step_times
            for s in ("sync", "intra")]  # fmt: skip
    np.testing.assert_allclose(same[0], same[1], rtol=1e-12)


def test_straggler_is_carried_not_waited_for():
    b, c = 4, 8
    lengths = [10, 10, 10, 100] + [10] * 200
    sync = _one("sync", lengths, b, chunk_size=c)
    long_decode = _decode(COST, [10, 10, 10, 100], [0] * 4, 100)
    assert sync.records[0]["stage_time_s"]["decode"] == pytest.approx(long_decode, rel=1e-12)
    assert sync.records[0]["cut"] == 100 and sync.step_times[0] > long_decode

    kw = {"chunk_size": c, "delta": 1, "steps": 12, "max_deferrals": 100}
    inter = _one("inter", lengths, b, **kw)
    assert [r["cut"] for r in inter.records[:9]] == [10] * 9
    first = (
        COST.admit_s(0)
        + _decode(COST, [10, 10, 10, 100, 10], [0] * 5, 10)
        + COST.scorers_s(0)
        + COST.scorers_s(50)
        + COST.update_s(b, 40)
        + COST.copy_s
    )
    assert inter.step_times[0] == pytest.approx(first, rel=1e-12)
    # Step 1 re-prefills the straggler's 10 carried tokens (actor and scorers).
    second = (
        COST.admit_s(10)
        + _decode(COST, [90, 10, 10, 10, 10], [10, 0, 0, 0, 0], 10)
        + COST.scorers_s(10)
        + COST.scorers_s(50)
        + COST.update_s(b, 40)
        + COST.copy_s
    )
    assert inter.step_times[1] == pytest.approx(second, rel=1e-12)
    assert inter.step_times[1] < sync.step_times[0] / 3
    straggler = next(f for f in inter.finished if f["length"] == 100)
    assert (straggler["admitted"], straggler["finished"], straggler["deferrals"]) == (0, 9, 9)
    assert all(len([f for f in inter.finished if f["finished"] == s]) == b for s in range(12))

    # Carried once, it must finish in the next step: that step waits for it.
    capped = _one("oppo", lengths, b, chunk_size=c, delta=1, steps=3, max_deferrals=1)
    straggler = next(f for f in capped.finished if f["length"] == 100)
    assert (straggler["finished"], straggler["deferrals"]) == (1, 1)
    assert [r["cut"] for r in capped.records] == [10, 90, 10]
    assert capped.step_times[0] < sync.step_times[0] / 3


def _synthetic_records(cost):
    lengths = demo_lengths(400, seed=3)
    records = []
    for schedule, c, d, p in [("sync", 16, 0, 8), ("intra", 8, 0, 24), ("inter", 16, 2, 8),
                              ("oppo", 4, 3, 24), ("sync", 32, 0, 24)]:  # fmt: skip
        sim = simulate(cost, schedule, 8, lengths, c, d, "colocated", 12, seed=len(records),
                       max_deferrals=2, prompt_len=p)  # fmt: skip
        records += sim.records
    return records


def test_calibration_recovers_the_cost_model():
    fitted = calibrate(_synthetic_records(COST))
    for f in dataclasses.fields(CostModel):
        want = getattr(COST, f.name)
        if isinstance(want, float):
            assert getattr(fitted, f.name) == pytest.approx(want, rel=0.05), f.name
    assert fitted.n_scorers == 3 and fitted.label.startswith("calibrated")


def test_calibration_without_exact_counts():
    # Real metrics records carry no counts: N, Σ S and batch tokens are exact for sync records
    # (the cut is the longest response); Σ ctx is approximated, so this cost has c = 0.
    cost = dataclasses.replace(COST, decode_c=0.0)
    records = [{k: v for k, v in r.items() if k != "counts"} for r in _synthetic_records(cost)
               if not r["streamed"] and r["overcommit"] == 0]  # fmt: skip
    fitted = calibrate(records, streamed=False)
    for name in ("decode_a", "decode_b", "admit_p0", "admit_p1", "update_u0", "update_u1"):
        assert getattr(fitted, name) == pytest.approx(getattr(cost, name), rel=0.05), name
    assert fitted.decode_c < 1e-9
    # Stage names are lumped in the simulator (one "scorer"): the total cost is what matters.
    assert fitted.scorers_s(500) == pytest.approx(cost.scorers_s(500), rel=0.05)


def test_calibrate_from_bench_needs_stage_times():
    bench = {"workload": {"config": {"rollout": {"batch_size": 8, "max_prompt_len": 8}}},
             "schedules": {"sync": {"step_time_s": [[0.1, 0.2]]}}}  # fmt: skip
    with pytest.raises(ValueError, match="stage_time_s"):
        calibrate_from_bench(bench)
    bench["schedules"]["sync"]["records"] = [_synthetic_records(COST)]
    assert calibrate_from_bench(bench, padded_decode=False).decode_a == pytest.approx(1e-3, 0.05)


def test_roofline_projection():
    cost = project_cost_model("qwen2.5-7b:gh200", batch=8)
    assert cost.decode_step_s(1, 0) == pytest.approx(7.62e9 * 2 / 4.0e12, rel=1e-6)  # 3.8 ms
    assert cost.decode_step_s(1, 0) == pytest.approx(3.81e-3, rel=1e-3)
    assert cost.label.startswith("PROJECTION")
    # Past the ridge, decode is compute-bound: B · 2 · params / peak.
    big = roofline_cost_model(15.24e9, 2 * 7.62e9, 4.0e12, 989e12, batch=1024)
    assert big.decode_step_s(1024, 0) == pytest.approx(1024 * 2 * 7.62e9 / 989e12, rel=1e-9)
    assert big.update_s(1, 1000) == pytest.approx(3 * 1000 * 2 * 7.62e9 / (989e12 * 0.5))
    tpu = project_cost_model("qwen2.5-3b:tpu-v5p", batch=8)
    assert tpu.decode_step_s(1, 0) == pytest.approx(3.09e9 * 2 / 2.765e12, rel=1e-3)
    with pytest.raises(ValueError):
        project_cost_model("llama:gh200", 8)


def test_recommend_picks_from_the_candidates():
    rec = recommend(COST, demo_lengths(500, seed=1), 2, (8, 16, 32), (0, 1, 4, 16), steps=20)
    assert rec["chunk_size"] in (8, 16, 32) and 0 <= rec["delta"] <= 2
    assert rec["step_time_s"] == min(g["step_time_s"] for g in rec["grid"])
    assert {g["delta"] for g in rec["grid"]} == {0, 1}
    assert rec["speedup_vs_sync"] >= 1.0


def test_cli(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--project", "qwen2.5-3b:gh200", "--batch", "4", "--lengths", "demo", "--steps", "5",
            "--candidates-c", "8,16", "--candidates-delta", "0,2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "PROJECTION" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["projection"] and set(data["schedules"]) == {"sync", "intra", "inter", "oppo"}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in _synthetic_records(COST)))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5, 9 12\n40")
    assert main(["--metrics", str(metrics), "--batch", "8", "--lengths", str(lengths),
                 "--steps", "4", "--engine", "active"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "calibrated from" in printed and "PROJECTION" not in printed


def test_padded_decode_runs_whole_chunks_over_every_slot():
    # This project's JAX engine: fixed shapes, whole chunks, one chunk queued past the cut.
    cost = dataclasses.replace(COST, padded_decode=True)
    lengths, c, p = [20, 3, 3, 3], 8, 5
    sim = simulate(cost, "intra", 4, lengths, c, seed=None, steps=1, prompt_len=p)
    steps = (3 + 1) * c  # ceil(20 / 8) scored chunks + the look-ahead chunk
    want = sum(cost.decode_step_s(4, sum(p + min(t, n) for n in lengths) / 4) for t in range(steps))
    assert sim.records[0]["stage_time_s"]["decode"] == pytest.approx(want, rel=1e-12)
    assert [e.stage for e in sim.events[0]].count("score") == 3
    assert sim.records[0]["counts"]["scorer_tokens"] == 3 * (4 * p + 3 * 4 * c)
