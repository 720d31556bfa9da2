"""The group regime map: where the overlaps pay for a run of groups (the GRPO family), projected
over Δ (groups) × median response length.

With G responses per prompt a batch is B/G groups, and the cut waits for whole groups: a group
finishes with its longest member, so what the cut sees of a prompt is the longest of G draws
of the length distribution (drawn independently: ``events``). Each cell holds the projection's
settings (B, G, P, PPO epochs, the trained model and the scorers, C, placement) except two: Δ,
the groups started beyond B (rows), and the lengths, log-normal with the column's median, σ
0.94, capped at R = 8 × the median (``project.Projection.with_regime``). A cell gives the
speedup over ``sync`` of ``intra``, ``inter`` and ``oppo`` and sync's seconds per step; sync and
intra start B sequences whatever Δ is, so they are simulated once per column.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oppo_tools.sim.engines import ACTIVE
from oppo_tools.sim.events import simulate
from oppo_tools.sim.project import CAP_RATIO, MEDIANS, SIGMA

DELTAS = (1, 2, 4, 8)  # Δ, groups started beyond B (at most B/G)
SCHEDULES = ("intra", "inter", "oppo")  # compared with sync


def _column(projection, engine, median, deltas) -> list[dict]:
    """One median's cells, one per Δ: the schedules' speedups over sync."""
    p = projection.with_regime(projection.train.ppo_epochs, median)
    cost, w = p.cost_model(), p.workload
    lengths = p.lengths.sample(seed=w.seed or 0)

    def mean_step(schedule: str, workload) -> float:
        return float(simulate(cost, schedule, workload, lengths, engine).step_times.mean())

    sync, intra = mean_step("sync", w), mean_step("intra", w)
    cells = []
    for d in deltas:
        carrying = dataclasses.replace(w, delta=d)
        inter, oppo = mean_step("inter", carrying), mean_step("oppo", carrying)
        cells.append({"sync_s": sync, "intra": sync / intra, "inter": sync / inter,
                      "oppo": sync / oppo})  # fmt: skip
    return cells


def group_length_median(projection, median: int | float, draws: int = 20_000) -> float:
    """Median over prompts of a group's length (the longest of its G responses) when responses
    have log-normal lengths of ``median`` (the regime's σ and cap)."""
    g = projection.workload.group_size
    lengths = projection.with_regime(1, median).lengths.sample(draws - draws % g, seed=0)
    return float(np.median(lengths.reshape(-1, g).max(axis=1)))


def group_regime_map(
    projection, engines=None, deltas=DELTAS, medians=MEDIANS, progress=None
) -> dict:
    """The speedups over sync of intra, inter and oppo per engine (default: as built on the
    projection's hardware, and active), Δ (rows) and median length (columns), everything
    else as ``projection`` says. ``progress`` (a callable) hears of each column as it starts."""
    engines = engines or (projection.built_engine, ACTIVE)
    w = projection.workload
    deltas = [d for d in deltas if d * w.group_size <= w.batch]
    cells, total, done = {}, len(engines) * len(medians), 0
    for engine in engines:
        columns = []
        for m in medians:
            done += 1
            if progress:
                progress(f"group regime map, engine {engine.name}: median {m} ({done}/{total})")
            columns.append(_column(projection, engine, m, deltas))
        cells[engine.name] = [list(row) for row in zip(*columns, strict=True)]
    return {
        "kind": "groups",
        "group_size": w.group_size,
        "batch": w.batch,
        "epochs": projection.train.ppo_epochs,
        "deltas": list(deltas),
        "medians": list(medians),
        "group_medians": [group_length_median(projection, m) for m in medians],
        "sigma": SIGMA,
        "cap_ratio": CAP_RATIO,
        "cells": cells,
    }


def format_group_map(result: dict) -> list[str]:
    """The group regime map as text lines: intra / inter / oppo over sync, sync's s/step."""
    g, b = result["group_size"], result["batch"]
    head = "".join(
        f"{f'median {m} (group {gm:.0f})':>34}"
        for m, gm in zip(result["medians"], result["group_medians"], strict=True)
    )
    lines = [
        f"PROJECTION group regime map: B = {b} = {b // g} prompts × G = {g}, "
        f"{result['epochs']} epoch(s); intra / inter / oppo speedup over sync (sync s/step); "
        f"lengths log-normal σ {result['sigma']}, R = {result['cap_ratio']} × median, drawn "
        "independently per response; (group N): the median group's longest response",
        f"{'':<14}{head}",
    ]
    for engine, rows in result["cells"].items():
        lines.append(f"engine {engine}")
        for d, row in zip(result["deltas"], rows, strict=True):
            cells = "".join(
                f"{' / '.join(f'{c[s]:.2f}' for s in SCHEDULES) + 'x':>22} ({c['sync_s']:>7.1f} s)"
                for c in row
            )
            lines.append(f"{f'  Δ = {d} group' + 's' * (d > 1):<14}{cells}")
    return lines
