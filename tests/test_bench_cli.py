"""`oppo-jax bench` as a user meets it: counts it cannot run are refused in one line before
anything is built, the summary reads as aligned text (not Python dicts), and each warm-up bar
sits under a line naming its schedule."""

import sys
from types import SimpleNamespace

import pytest

import oppo_tools.bench as bench
from oppo_jax.base.errors import EXIT_BAD_INPUT
from oppo_jax.cli import main
from oppo_jax.pipeline.schedule import SCHEDULES


def _never(*args, **kwargs):
    raise AssertionError("the bench started although its counts were refused")


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--steps", "0"], "--steps 0"), (["--steps", "-3"], "--steps -3"),
     (["--seeds", "0"], "--seeds 0"), (["--warmup", "-1"], "--warmup -1")],
)  # fmt: skip
def test_counts_a_bench_cannot_run_are_refused_before_it_starts(
    tmp_path, monkeypatch, capsys, flags, says
):
    # --steps 0 ran the config's train.steps (0 was read as "not given")
    monkeypatch.setattr(bench, "prepare_run", _never)
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), *flags]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "must be an integer >=" in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("names", "says"),
    [("oppo", "sync included"), ("sync,opo", "unknown: opo"), ("sync,oppo,sync", "at most once")],
)
def test_schedules_a_bench_cannot_run_are_refused_before_it_starts(
    tmp_path, monkeypatch, capsys, names, says
):
    monkeypatch.setattr(bench, "prepare_run", _never)
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), "--schedules", names]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--schedules {names}" in err and says in err, err
    assert not out.exists()
    assert bench.check_schedules(["oppo", "sync"]) == ("sync", "oppo")  # the schedules' order


def _result(paired_oppo: float | None) -> dict:
    bound = {"ideal_step_s": 0.08, "measured_over_ideal": 1.25}
    schedule = {"step_time_median_s": 0.1, "final_gold": None, "final_gold_spread": None,
                "time_to_target_s": None, "ideal_bound": bound}  # fmt: skip
    names = ("intra", "inter", "oppo")
    return {
        "workload": {"no_gold": None},
        "schedules": {n: schedule for n in ("sync", *names)},
        "speedup_vs_sync": {"intra": 1.1, "inter": 0.864, "oppo": 1.234},
        "speedup_vs_sync_paired": {"intra": 1.05, "inter": 0.9, "oppo": paired_oppo},
        "time_to_target_speedup_vs_sync": dict.fromkeys(names),
        "sync_stage_shares": {
            "decode": 0.4,
            "scoring": 0.1,
            "update": 0.45,
            "other": 0.05,
            "decode_plus_scoring": 0.5,
        },
    }


def test_the_speedups_print_as_an_aligned_table_not_as_dicts():
    lines = bench.bench_summary_lines(_result(1.2))
    assert not any("{" in line or "'" in line for line in lines), lines
    head = next(i for i, line in enumerate(lines) if "speedup vs sync:" in line)
    table = lines[head : head + 4]
    assert table[0].split(":")[1].split() == ["median", "step", "per-round", "ratio", "time",
                                              "to", "target"]  # fmt: skip
    assert table[3].split() == ["oppo:", "1.23x", "sync", "1.20x", "sync", "-"]
    assert table[2].split() == ["inter:", "0.86x", "sync", "0.90x", "sync", "-"]
    # aligned: every row's colon and each column's right edge line up with the heading
    assert len({line.index(":") for line in table}) == 1
    assert len({len(line) for line in table}) == 1
    assert lines[-1] == (
        "  sync stage shares: decode 40.0%, scoring 10.0%, update 45.0%, other 5.0%, "
        "decode + scoring 50.0%"
    )
    assert bench.bench_summary_lines(_result(None))[head + 3].split()[3] == "-"


def test_each_warm_up_bar_is_labelled_with_its_schedule(monkeypatch, capsys):
    seen = []

    def warm_up(ctx, schedule, host, state, progress):
        print("warm-up (compiling): 100%", file=sys.stderr)  # the bar
        seen.append(schedule.name)
        return {}, ctx + 1  # the context with its registry

    monkeypatch.setattr(bench.warm, "warm_up", warm_up)
    lanes = [SimpleNamespace(schedule=s, ctx=0, host=None, state=None) for s in SCHEDULES.values()]
    bench._warm_up(lanes, progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0::2] == [f"warm-up of {n} ({i}/4):" for i, n in enumerate(seen, 1)]
    assert seen == ["sync", "intra", "inter", "oppo"] and [ln.ctx for ln in lanes] == [1] * 4
    bench._warm_up(lanes, progress=False)
    assert capsys.readouterr().err.count("warm-up of") == 0
