"""The ideal bound and stage shares of a bench, on hand-made timelines with known answers."""

import pytest

from oppo_tools.bench_bounds import ideal_bound, stage_shares, step_costs

G, S = "generation", "scoring"


def _record(wall, cut, events):
    return {"step_time_s": wall, "trace": {"cut": cut, "events": events}}


# A sync step: prefill, decode 100 steps, then the scorers alone, then build and update.
SYNC = _record(10.0, 100, [
    ["prefill actor", G, 0.0, 0.5],
    ["decode", G, 0.5, 4.5],
    ["prefill reference", S, 4.6, 4.8],
    ["score reference", S, 4.8, 6.0],
    ["score reward", S, 6.0, 7.0],
    ["build batch", G, 4.7, 7.2],  # dispatched at 4.7, waits for the scores until 7.0
    ["update", G, 7.2, 9.9],
])  # fmt: skip

# An oppo step: the scorers stream under decode, one chunk left after it; 40 decode steps.
OPPO = _record(6.0, 40, [
    ["prefill actor", G, 0.0, 0.6],
    ["decode", G, 0.6, 2.2],
    ["score reference", S, 0.8, 2.0],
    ["score reference", S, 2.2, 2.6],
    ["build batch", G, 2.3, 2.7],
    ["update", G, 2.7, 5.9],
])  # fmt: skip


def test_step_costs_split_the_timeline():
    c = step_costs(SYNC)
    assert c["decode"] == pytest.approx(4.0) and c["update"] == pytest.approx(2.7)
    assert c["build_batch"] == pytest.approx(0.2)  # its wait for the scores is cut off
    assert c["scoring"] == pytest.approx(2.4)
    assert c["exposed_scoring"] == pytest.approx(2.4)  # nothing else ran meanwhile
    assert c["idle"] == pytest.approx(0.2)  # 4.5-4.6 and 9.9-10.0: neither group computed
    o = step_costs(OPPO)
    assert o["scoring"] == pytest.approx(1.6)
    assert o["exposed_scoring"] == pytest.approx(0.4)  # only the chunk after decode shows
    assert o["build_batch"] == pytest.approx(0.1) and o["idle"] == pytest.approx(0.1)
    assert o["cut"] == 40


def test_ideal_bound_uses_the_run_decode_cost_per_step():
    bound = ideal_bound([SYNC, OPPO])
    per_step = (4.0 + 1.6) / 140
    assert bound["decode_per_lockstep_step_s"] == pytest.approx(per_step)
    ideal_sync = 0.5 + per_step * 100 + 0.2 + 2.7
    ideal_oppo = 0.6 + per_step * 40 + 0.1 + 3.2
    assert bound["ideal_step_s"] == pytest.approx((ideal_sync + ideal_oppo) / 2)
    assert bound["measured_over_ideal"] == pytest.approx(8.0 / ((ideal_sync + ideal_oppo) / 2))
    alone = ideal_bound([OPPO])
    assert alone["ideal_step_s"] == pytest.approx(0.6 + 1.6 + 0.1 + 3.2)
    assert alone["measured_over_ideal"] == pytest.approx(6.0 / 5.5)
    assert alone["median_s"]["exposed_scoring"] == pytest.approx(0.4)


def test_sync_stage_shares_add_up():
    shares = stage_shares([SYNC])
    assert shares["decode"] == pytest.approx(0.4)
    assert shares["scoring"] == pytest.approx(0.24)
    assert shares["update"] == pytest.approx(0.27)
    assert shares["other"] == pytest.approx(0.09)  # actor prefill, build, idle
    assert shares["decode_plus_scoring"] == pytest.approx(0.64)
