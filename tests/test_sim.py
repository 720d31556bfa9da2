"""The pipeline simulator (oppo_jax.sim) on hand-made cases with numbers worked out by hand,
and against the recorded CPU benchmark (docs/benchmarks/bench.json)."""

import dataclasses
import json
from pathlib import Path

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
    validate,
)
from oppo_jax.sim.cli import demo_lengths, longtail_lengths, main
from oppo_jax.sim.engine import Plan
from oppo_jax.sim.fitting import _km_median
from oppo_jax.sim.trace import forward_steps, observe

BENCH = Path(__file__).parent.parent / "docs" / "benchmarks" / "bench.json"
COST = CostModel(
    decode_a=1e-3, decode_b=1e-4, decode_c=1e-6, prefill_p0=2e-4, prefill_p1=1e-5, n_scorers=3,
    admit_p0=5e-4, admit_p1=2e-5, update_u0=1e-2, update_u1=1e-5, copy_s=3e-3,
)  # fmt: skip
# A padded engine on a shared machine: host delays, and both groups slowed while both work.
PADDED = CostModel(
    decode_a=2e-4, decode_b=1e-5, decode_c=1e-7, decode_chunk_s=5e-4, prefill_p0=1e-3,
    prefill_p1=8e-6, n_scorers=3, admit_p0=3e-4, admit_p1=1.5e-5, build_s=5e-4, update_u0=0.02,
    update_u1=2e-6, copy_s=1e-4, host_admit_s=2e-3, host_setup_s=5e-3, host_stream_s=4e-3,
    host_collect_s=3e-3, host_dispatch_s=8e-3, host_finish_s=2e-3, host_update_s=0.012,
    overlap_rate=0.6, padded_decode=True,
)  # fmt: skip


def _decode(cost, lengths, base, cut):
    """Σ over lockstep positions t < cut of a + b·S_t + c·Σ ctx, by brute force."""
    total = 0.0
    for t in range(cut):
        running = [i for i, n in enumerate(lengths) if n > t]
        ctx = sum(base[i] + t for i in running)
        total += cost.decode_a + cost.decode_b * len(running) + cost.decode_c * ctx
    return total


def _one(schedule, lengths, b, cost=COST, **kw):
    kw = {"seed": None, "steps": 1, **kw}
    return simulate(cost, schedule, b, lengths, **kw)


def test_engine_shares_the_machine_and_waits_for_dependencies():
    p = Plan()
    a = p.add("a", "generation", 1.0)
    b = p.add("b", "scoring", 2.0)
    # Both at half speed until a ends at 2.0 (b has done 1.0), then b alone: ends at 3.0.
    c = p.add("c", "generation", 0.5, deps=[(b, 0.25)])  # ready at 3.25
    d = p.add("d", "scoring", 1.0, at=1.0)  # queued behind b; alone from 3.0 until c starts
    ev = p.run({"generation": 0.5, "scoring": 0.5})
    assert [(e.start, e.end) for e in ev] == [(0.0, 2.0), (0.0, 3.0), (3.25, 4.25), (3.0, 4.5)]
    # d: 0.25 alone (3.0-3.25), 0.5 at half speed beside c until c ends, 0.25 alone again.
    assert (a, c, d) == (0, 2, 3)
    # A stage that needs another holds its group from its start but works only after it.
    q = Plan()
    first = q.add("score", "scoring", 2.0)
    q.add("build", "generation", 0.5, needs=[first])
    q.add("update", "generation", 1.0)
    assert [(e.start, e.end) for e in q.run()] == [(0.0, 2.0), (0.0, 2.5), (2.5, 3.5)]
    stuck = Plan()
    stuck.add("x", "generation", 1.0, deps=[(1, 0.0)])
    stuck.add("y", "generation", 1.0)
    with pytest.raises(RuntimeError, match="deadlock"):
        stuck.run()


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


def test_equal_lengths_padded_engine_with_host_delays():
    # The padded engine, worked by hand: 4 slots of 20 tokens, C = 8, P = 4, R = 32.
    cost = dataclasses.replace(PADDED, overlap_rate=1.0)
    b, n, c, p, r = 4, 20, 8, 4, 32
    kw = {"chunk_size": c, "prompt_len": p, "capacity": r}
    sync, oppo = _one("sync", [n], b, cost, **kw), _one("oppo", [n], b, cost, **kw)
    step = cost.decode_step_s(b, p + r)  # every slot, the whole cache, every step
    chunks = [cost.decode_chunk_s + k * step for k in (8, 8, 3, 0)]  # 19 feeds; one look-ahead
    actor_end = cost.host_admit_s + cost.admit_s(b * p)
    start = max(actor_end, cost.host_admit_s + cost.host_setup_s)
    seen = start + sum(chunks[:3])  # the host reads the cut after chunk 2
    scored = seen + cost.host_collect_s + cost.scorers_s(b * p) + cost.scorers_s(b * r)
    dispatched = max(seen + cost.host_dispatch_s, start + sum(chunks)) + cost.host_finish_s
    update_at = max(dispatched + cost.host_update_s, scored + cost.build_s)
    tail = cost.update_s(b, b * (p + r)) + cost.copy_s
    assert sync.step_times[0] == pytest.approx(update_at + tail, rel=1e-12)
    # Streaming: the scorers' admission waits for the setup, the first decode for its dispatch.
    start = max(actor_end, cost.host_admit_s + cost.host_setup_s + cost.host_stream_s)
    last_score = start + sum(chunks[:3]) + cost.scorers_s(b * c)  # chunk 2's, after decode 2
    ready = max(start + sum(chunks) + cost.host_finish_s, last_score) + cost.build_s
    update_at = max(ready, start + sum(chunks) + cost.host_finish_s + cost.host_update_s)
    assert oppo.step_times[0] == pytest.approx(update_at + tail, rel=1e-12)
    assert [e.stage for e in oppo.events[0]].count("score") == 3


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


def test_padded_straggler_costs_every_slot_and_a_wider_admission():
    cost = dataclasses.replace(PADDED, overlap_rate=1.0)
    kw = {"chunk_size": 8, "prompt_len": 4, "capacity": 64, "steps": 2}
    lengths = [10, 10, 10, 60] + [10] * 50
    sync, oppo = _one("sync", lengths, 4, cost, **kw), _one("oppo", lengths, 4, cost, delta=1,
                                                              **kw)  # fmt: skip
    # Sync decodes 8 chunks (cut 60) and the look-ahead over all 4 slots; 59 steps feed.
    assert sync.records[0]["trace"]["finish"] == [10, 10, 10, 60]
    assert [e.stage for e in sync.events[0]].count("decode") == 9
    want = 9 * cost.decode_chunk_s + 59 * cost.decode_step_s(4, 4 + 64)
    assert sync.records[0]["stage_time_s"]["decode"] == pytest.approx(want, rel=1e-12)
    # Oppo cuts at 10: 2 chunks and the look-ahead, all 24 steps feeding the straggler; it
    # is readmitted next step with 16 carried tokens: a context 4 + 16 wide for the carried
    # rows' bucket (1 row -> 4), the prompt width 4 for the fifth slot.
    t0, t1 = oppo.records[0]["trace"], oppo.records[1]["trace"]
    assert (t0["cut"], t0["finish"][3], t0["width"]) == (10, -1, 4)
    assert (t1["prefix"], t1["width"]) == ([10, 0, 0, 0, 0], 4 + 16)
    want = 3 * cost.decode_chunk_s + 24 * cost.decode_step_s(5, 4 + 64)
    assert oppo.records[0]["stage_time_s"]["decode"] == pytest.approx(want, rel=1e-12)
    assert t1["carried_rows"] == 4
    admit = [e.end - e.start for e in oppo.events[1] if e.stage == "prefill actor"]
    assert admit == [pytest.approx(cost.admit_s(4 * 20 + 1 * 4), rel=1e-12)]
    # The engine before the split admission prefilled every slot at the wide context.
    unsplit = dataclasses.replace(cost, split_admission=False)
    old = _one("oppo", lengths, 4, unsplit, delta=1, **kw)
    admit = [e.end - e.start for e in old.events[1] if e.stage == "prefill actor"]
    assert admit == [pytest.approx(cost.admit_s(5 * 20), rel=1e-12)]


def test_trace_helpers():
    assert forward_steps([3, 10], 2, 8) == [8, 1]
    assert forward_steps([3, -1], 2, 8) == [8, 8]
    assert forward_steps([0, 0], 2, 8) == [0, 0]
    trace = {"events": [
        ["prefill actor", "generation", 0.0, 1.0], ["decode", "generation", 1.0, 3.0],
        ["prefill critic", "scoring", 2.0, 4.0], ["build batch", "generation", 3.5, 5.0],
        ["update", "generation", 5.0, 6.0],
    ]}  # fmt: skip
    obs = observe(trace)
    # The build waits for the scorer until 4.0: busy 4.0-5.0 only, so it shares nothing.
    assert obs["solo"] == {"prefill actor": 1.0, "decode": 1.0, "scorer": 1.0,
                           "build batch": 1.0, "update": 1.0}  # fmt: skip
    assert obs["shared"]["decode"] == obs["shared"]["scorer"] == 1.0
    assert obs["scoring_end"] == 4.0 and obs["decode"] == [(1.0, 3.0)]
    # Delays seen exactly, or only as upper bounds (False): the median of the exact ones
    # where the bounds say nothing else.
    assert _km_median([1.0, 2.0, 3.0], [True] * 3) == 2.0
    assert _km_median([1.0, 5.0, 6.0, 7.0], [True, False, False, False]) == 1.0
    assert _km_median([5.0, 6.0], [False, False]) == 0.0


def _synthetic_records(cost, placement="colocated"):
    lengths = demo_lengths(400, seed=3)
    records = []
    for schedule, c, d, p in [("sync", 16, 0, 8), ("intra", 8, 0, 24), ("inter", 16, 2, 8),
                              ("oppo", 4, 3, 24), ("sync", 32, 0, 24)]:  # fmt: skip
        sim = simulate(cost, schedule, 8, lengths, c, d, placement, 12, seed=len(records),
                       max_deferrals=2, prompt_len=p, capacity=64)  # fmt: skip
        records += sim.records
    return records


def test_calibration_from_timelines_recovers_the_cost_model():
    fitted = calibrate(_synthetic_records(PADDED, "disaggregated"))
    for f in dataclasses.fields(CostModel):
        want = getattr(PADDED, f.name)
        if isinstance(want, float):
            assert getattr(fitted, f.name) == pytest.approx(want, rel=1e-6, abs=1e-12), f.name
    assert fitted.n_scorers == 3 and fitted.padded_decode and "timelines" in fitted.label


def test_calibration_without_timelines():
    # A run's metrics.jsonl has stage sums only: N, Σ S and batch tokens are exact for sync
    # records (the cut is the longest response); Σ ctx is approximated, so this cost has c = 0.
    cost = dataclasses.replace(COST, decode_c=0.0)
    records = [{k: v for k, v in r.items() if k != "trace"} for r in _synthetic_records(cost)
               if not r["streamed"] and r["overcommit"] == 0]  # fmt: skip
    fitted = calibrate(records, streamed=False)
    for name in ("decode_a", "decode_b", "admit_p0", "admit_p1", "update_u0", "update_u1",
                 "copy_s"):  # fmt: skip
        assert getattr(fitted, name) == pytest.approx(getattr(cost, name), rel=0.05), name
    assert fitted.decode_c < 1e-9 and "sums" in fitted.label
    # Stage names are lumped in the simulator (one "scorer"): the total cost is what matters.
    assert fitted.scorers_s(500) == pytest.approx(cost.scorers_s(500), rel=0.05)


def test_calibrate_from_bench_needs_stage_times():
    bench = {"workload": {"config": {"rollout": {"batch_size": 8, "max_prompt_len": 8}}},
             "schedules": {"sync": {"step_time_s": [[0.1, 0.2]]}}}  # fmt: skip
    with pytest.raises(ValueError, match="stage_time_s"):
        calibrate_from_bench(bench)
    bench["schedules"]["sync"]["records"] = [_synthetic_records(PADDED, "disaggregated")]
    assert calibrate_from_bench(bench).decode_a == pytest.approx(PADDED.decode_a, rel=1e-6)


def test_simulator_predicts_the_recorded_cpu_bench_within_15_percent():
    # A check of the model against recorded data (deterministic), not a timing test: fitted on
    # the first half of each schedule's measured steps, it predicts the second half; then each
    # schedule is predicted from a fit that never saw it (in time or in schedule).
    bench = json.loads(BENCH.read_text())
    table = validate(bench)["table"]
    assert set(table) == {"sync", "intra", "inter", "oppo"}
    for name, row in table.items():
        assert abs(row["error"]) <= 0.15, (name, row)
    for name in table:
        others = tuple(n for n in table if n != name)
        row = validate(bench, others)["table"][name]
        assert not row["fit"] and abs(row["error"]) <= 0.15, (name, row)


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
    lengths = longtail_lengths()
    assert np.median(lengths) == pytest.approx(103, abs=3) and lengths.max() <= 1024


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
    assert main(["--bench", str(BENCH), "--validate", "--fit-schedules", "sync,intra"]) == 0
    assert "held out" in capsys.readouterr().out
    assert main(["--bench", str(BENCH), "--steps", "6", "--candidates-c", "8",
                 "--candidates-delta", "8"]) == 0  # fmt: skip
    assert "B=16, prompt 16 tokens, disaggregated, C=8, Δ=8" in capsys.readouterr().out
    assert main(["--validate", "--fit-schedules", "sync"]) == 2
