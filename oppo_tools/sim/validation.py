"""The simulator against a measured ``bench.json``: calibrate on some steps, predict others.

The measured steps are split into ``fit`` and ``test`` steps: even and odd steps
(``alternate``; the bench interleaves the schedules' steps, so both see the same spells of
machine load), or the first and second half of each seed's steps (``halves``; this also asks
the machine to keep its speed, which a shared one does not). The cost model is fitted to the
``fit`` steps of the chosen schedules only (leave one schedule out to predict it blind); then
each schedule is simulated with the bench's settings (B, C, Δ, P, R, placement, deferral
cap) on the engine that recorded the bench (``engines.recorded_engine``), its new prompts
taking the response lengths of that schedule's ``test`` batches in order (lengths are
correlated within a step: a policy that rambles does so for the whole batch, so they are
replayed, not resampled), twice over, the first pass warming the carry buffer; the simulated
median step time of the second pass is compared with the measured median of the ``test``
steps. Nothing of a ``test`` step's timing enters the fit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oppo_tools.sim.engines import Engine, recorded_engine
from oppo_tools.sim.events import SCHEDULES, Workload, simulate
from oppo_tools.sim.fitting import bench_records, calibrate_traces

SPLITS = ("alternate", "halves")


def split(records: list[dict], how: str = "alternate") -> tuple[list[dict], list[dict]]:
    """(fit, test) records: even and odd steps (``alternate``), or the first and the second
    half of each seed's steps (``halves``); records are in seed-major order."""
    if how not in SPLITS:
        raise ValueError(f"split {how!r}: expected one of {SPLITS}")
    if how == "alternate":
        return [r for r in records if r["step"] % 2 == 0], [r for r in records if r["step"] % 2]
    seeds, current = [], None
    for r in records:
        if current is None or r["step"] <= current[-1]["step"]:
            current = []
            seeds.append(current)
        current.append(r)
    halves = [(s[: len(s) // 2], s[len(s) // 2 :]) for s in seeds]
    return [r for a, _ in halves for r in a], [r for _, b in halves for r in b]


def settings(bench: dict) -> Workload:
    """The bench's workload (B, G, C, Δ, P, R, placement, deferral cap) for ``simulate``."""
    cfg = bench["workload"]["config"]
    rollout, pipe = cfg["rollout"], cfg["pipeline"]
    return Workload(
        batch=int(rollout["batch_size"]),
        chunk_size=int(pipe["chunk_size"]),
        delta=int(pipe["overcommit"]),
        prompt_len=int(rollout["max_prompt_len"]),
        capacity=int(rollout["max_response_len"]),
        placement=pipe["placement"],
        # rollout.max_staleness; pipeline.max_deferrals in benches run before the rename
        max_deferrals=int(rollout.get("max_staleness", pipe.get("max_deferrals"))),
        seed=None,  # the test steps' lengths, in order
        group_size=int(rollout.get("group_size", 1)),
    )


def validate(bench: dict, fit_schedules=tuple(SCHEDULES), how: str = "alternate") -> dict:
    """Held-out validation (module docstring): per schedule, predicted and measured median
    step time of the ``test`` steps and the relative error; the fitted cost model and the
    engine that recorded the bench (the one simulated). Any ``bench.json`` with traces."""
    by_name = {n: split(rs, how) for n, rs in bench_records(bench).items() if rs}
    if not by_name or not all("trace" in r for f, t in by_name.values() for r in f + t):
        raise ValueError("bench.json records lack timelines ('trace'): rerun `oppo-jax bench`")
    missing = sorted(set(fit_schedules) - set(by_name))
    if missing:
        raise ValueError(f"bench.json has no steps of {missing} to fit on")
    engine = recorded_engine([r["trace"] for f, t in by_name.values() for r in f + t])
    cost = calibrate_traces([r for n in fit_schedules for r in by_name[n][0]])
    workload = settings(bench)
    table = {}
    for name, (_, test) in by_name.items():
        lengths = [n for r in test for n in r["trace"]["lengths"]]
        w = dataclasses.replace(workload, steps=2 * len(test))
        sim = simulate(cost, name, w, lengths, engine)
        predicted = float(np.median(sim.step_times[len(test) :]))
        measured = float(np.median([r["step_time_s"] for r in test]))
        table[name] = {
            "predicted_s": predicted,
            "measured_s": measured,
            "error": predicted / measured - 1.0,
            "fit": name in fit_schedules,
            "test_steps": len(test),
        }
    return {
        "fit_schedules": list(fit_schedules),
        "split": how,
        "engine": engine.to_dict(),
        "cost_model": cost.to_dict(),
        "table": table,
    }


def format_table(result: dict) -> str:
    """The validation as text lines (speedups: sync's median over the schedule's)."""
    part = {"alternate": ("even", "odd"), "halves": ("first-half", "second-half")}
    fit, test = part[result["split"]]
    engine = Engine(**result["engine"]).describe()
    table, lines = (
        result["table"],
        [
            f"recorded by the {engine} engine; simulated as that engine",
            f"fitted on the {fit} steps of {', '.join(result['fit_schedules'])}; predicting the "
            f"{test} steps (held out)",
            f"{'schedule':>8}  {'predicted':>10}  {'measured':>10}  {'error':>7}  speedup vs sync "
            "predicted / measured",
        ],
    )
    sync = table.get("sync")
    for name, row in table.items():
        speed = ""
        if sync and name != "sync":
            speed = (
                f"{sync['predicted_s'] / row['predicted_s']:.2f}× / "
                f"{sync['measured_s'] / row['measured_s']:.2f}×"
            )
        times = f"{row['predicted_s'] * 1e3:>8.1f}ms  {row['measured_s'] * 1e3:>8.1f}ms"
        lines.append(f"{name:>8}  {times}  {row['error']:>+7.1%}  {speed}")
    return "\n".join(lines)
