"""What every row busy buys (issue 44), projected: the mechanisms one by one, their bound, and
the regime maps with and without refill.

``bound`` is the step no schedule beats on the cost model: the batch's B sequences decoded in
S rows that are never idle (B·mean length / S decode steps, each reading the weights once and
each token its own context), each prompt prefilled once per group (or once per sample), the
scorers over the batch's tokens, and the update ``sync`` pays for the same batch. It leaves out
the refill points' idle rows, the cut's wait for whole groups, the staleness bound and replays.
``mechanisms`` runs sync, oppo without refill and refill with its mechanisms switched on one
at a time (shared prefill, ``keep``, S = 2B) and a staleness sweep, each beside its bound, at
the projection's lengths and at a second median. ``refill_map`` is the regime map (Δ groups or
PPO epochs × median) of oppo without and with refill.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

from oppo_tools.sim.events import simulate
from oppo_tools.sim.project import EPOCHS, MEDIANS
from oppo_tools.sim.refill import CARRY_KV, ON_STALE, Refill, simulate_refill, summary


def bound(projection, lengths, rows: int, shared: bool, update_s: float) -> float:
    """The step time with every row busy (module docstring), in seconds."""
    cost, w, engine = projection.cost_model(), projection.workload, projection.built_engine
    lengths = np.asarray(lengths, float)
    b, p, mean = w.batch, w.prompt_len, float(lengths.mean())
    tokens = b * mean
    steps = tokens / rows
    per_token_ctx = float((lengths * p + lengths * (lengths - 1) / 2).mean()) * b
    if engine.ragged_decode:
        per_token_ctx += tokens * engine.ragged_key_block / 2
    computed = tokens if engine.token_proportional else steps * rows
    decode = cost.decode_s(steps, computed, per_token_ctx)
    prompts = b // w.group_size if shared else b
    gen = decode + cost.admit_p1 * p * prompts
    sco = cost.prefill_p1 * cost.n_scorers * (tokens + p * prompts)
    rollout = max(gen, sco) if w.placement == "disaggregated" else gen + sco
    return rollout + update_s + cost.copy_s


def _sync(projection, lengths) -> tuple[float, float]:
    """sync's mean step time and mean update stage on the projection's built engine."""
    cost, w, engine = projection.cost_model(), projection.workload, projection.built_engine
    result = simulate(cost, "sync", w, lengths, engine)
    update = float(np.mean([r["stage_time_s"].get("update", 0.0) for r in result.records]))
    return float(result.step_times.mean()), update


def _oppo(projection, lengths) -> float:
    """oppo without refill (the projection's Δ) on the built engine: mean step time."""
    cost, w, engine = projection.cost_model(), projection.workload, projection.built_engine
    return float(simulate(cost, "oppo", w, lengths, engine).step_times.mean())


def _refill_row(projection, lengths, refill: Refill, sync: float, update: float) -> dict:
    cost, w = projection.cost_model(), projection.workload
    # C only has to divide refill_every (no per-chunk cost in a roofline model)
    w = dataclasses.replace(w, chunk_size=math.gcd(w.chunk_size, refill.every))
    records = simulate_refill(cost, w, lengths, projection.built_engine, refill)
    s = summary(records, skip=refill.max_staleness + 1)  # the warm-up: nothing in flight
    rows = refill.rows(w)
    limit = bound(projection, lengths, rows, refill.shared_prefill, update)
    stale = s["staleness"]
    return {
        "step_s": s["step_time_mean_s"],
        "speedup": sync / s["step_time_mean_s"],
        "bound": sync / limit,
        "decode_efficiency": s["decode_efficiency"],
        "staleness_mean": float(sum(k * v for k, v in stale.items())),
        "staleness": stale,
        "dropped_groups": s["dropped_groups"],
        "stages": s["stage_time_mean_s"],
    }


def variants(projection, refill: Refill, staleness=(1, 2, 4, 8)) -> list[tuple[str, Refill]]:
    """The table's refill rows: the mechanisms one at a time, then the staleness sweep."""
    b = projection.workload.batch
    alone = dataclasses.replace(refill, slots=b, shared_prefill=False, carry_kv="replay")
    shared = dataclasses.replace(alone, shared_prefill=True)
    keep = dataclasses.replace(shared, carry_kv="keep")
    wide = dataclasses.replace(keep, slots=2 * b)
    rows = [
        ("refill (S = B, prompt per sample, replay)", alone),
        ("+ shared prompt prefill", shared),
        ("+ carry_kv keep", keep),
        ("+ S = 2B rows", wide),
    ]
    rows += [
        (f"all three, S = B, max staleness {s}", dataclasses.replace(keep, max_staleness=s))
        for s in staleness
        if s != refill.max_staleness
    ]
    return rows


def mechanisms(projection, refill: Refill, second_median: int = 512, progress=None) -> dict:
    """The table of what each mechanism buys (module docstring), at the projection's lengths
    and at log-normal lengths of ``second_median`` (R = 8 × the median)."""
    w = projection.workload
    second = projection.with_regime(projection.train.ppo_epochs, second_median)
    columns = []
    for label, proj in (("config lengths", projection), (f"median {second_median}", second)):
        if progress:
            progress(f"refill table: {label}")
        lengths = proj.lengths.sample(seed=w.seed or 0)
        sync, update = _sync(proj, lengths)
        oppo = _oppo(proj, lengths)
        rows = {"sync": {"step_s": sync, "speedup": 1.0}}
        rows["oppo, no refill"] = {"step_s": oppo, "speedup": sync / oppo}
        for name, r in variants(proj, refill):
            rows[name] = _refill_row(proj, lengths, r, sync, update)
        columns.append({"label": label, "lengths": proj.lengths.describe(),
                        "sync_update_s": update, "rows": rows})  # fmt: skip
    return {"refill": dataclasses.asdict(refill), "columns": columns}


def format_mechanisms(table: dict) -> list[str]:
    """The table as text: per row and column, s/step, ×sync, [bound ×], decode efficiency,
    mean staleness and drops."""
    cols = table["columns"]
    r = table["refill"]
    lines = ["PROJECTION every row busy (refill): s/step, speedup over sync [bound], decode "
             "efficiency, mean staleness (versions), groups dropped; refill rows every "
             f"{r['every']} tokens, max staleness {r['max_staleness']} ({r['on_stale']}) unless "
             "named, S = B unless named"]  # fmt: skip
    for c in cols:
        lines.append(f"  {c['label']}: {c['lengths']}; sync's update {c['sync_update_s']:.1f} s")
    lines.append(f"{'':<44}" + "".join(f"  {c['label']:<52}" for c in cols))
    for name in cols[0]["rows"]:
        cells = "".join(_cell(c["rows"][name]) for c in cols)
        lines.append(f"{name:<44}{cells}")
    return lines


def _cell(r: dict) -> str:
    text = f"{r['step_s']:6.2f} s {r['speedup']:5.2f}×"
    if "bound" in r:
        text += f" [{r['bound']:4.2f}×] eff {r['decode_efficiency']:.2f} "
        text += f"st {r['staleness_mean']:.1f} drop {r['dropped_groups']}"
    return f"  {text:<52}"


def refill_map(projection, refill: Refill, medians=MEDIANS, epochs=EPOCHS, progress=None):
    """OPPO's speedup over sync without and with refill (all mechanisms at ``refill``'s
    settings; S = B + Δ·G unless it gives S), and the bound: Δ groups fixed at the
    projection's, over the medians, per PPO epochs for PPO (G = 1), at the projection's epochs
    for a run of groups."""
    w = projection.workload
    rows = [projection.train.ppo_epochs] if w.group_size > 1 else list(epochs)
    cells = []
    for n in rows:
        row = []
        for m in medians:
            if progress:
                progress(f"refill map: {n} epoch(s), median {m}")
            proj = projection.with_regime(n, m)
            lengths = proj.lengths.sample(seed=w.seed or 0)
            sync, update = _sync(proj, lengths)
            r = _refill_row(proj, lengths, refill, sync, update)
            row.append({"sync_s": sync, "oppo": sync / _oppo(proj, lengths),
                        "refill": r["speedup"], "bound": r["bound"]})  # fmt: skip
        cells.append(row)
    return {"epochs": rows, "medians": list(medians), "group_size": w.group_size,
            "refill": dataclasses.asdict(refill), "cells": cells}  # fmt: skip


def format_refill_map(result: dict) -> list[str]:
    """The map as text: oppo without / with refill [bound] over sync (sync s/step)."""
    r = result["refill"]
    head = "".join(f"{'median ' + str(m):>34}" for m in result["medians"])
    lines = [
        f"PROJECTION refill map, G = {result['group_size']}: oppo without refill / with "
        f"refill [bound] over sync (sync s/step); refill every {r['every']}, S = "
        f"{r['slots'] or 'B + Δ·G'}, shared prefill {r['shared_prefill']}, carry_kv "
        f"{r['carry_kv']}, max staleness {r['max_staleness']} ({r['on_stale']})",
        f"{'':<12}{head}",
    ]
    for n, row in zip(result["epochs"], result["cells"], strict=True):
        cells = "".join(
            f"{c['oppo']:>9.2f} / {c['refill']:.2f}× [{c['bound']:.2f}×] ({c['sync_s']:6.1f} s)"
            for c in row
        )
        lines.append(f"{f'  {n} epoch(s)':<12}{cells}")
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    """``oppo-jax sim``'s refill options (the engine's rollout.refill_every and its settings)."""
    g = parser.add_argument_group("every row busy (refill, --project)")
    g.add_argument("--no-refill", action="store_true", help="skip the refill table and map")
    g.add_argument("--refill-every", type=int, default=None, help="tokens between refill points")
    g.add_argument("--slots", type=int, default=None, help="S, rows decoded (default B)")
    g.add_argument("--shared-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="a prompt prefilled once per group (default) or per sample")  # fmt: skip
    g.add_argument("--carry-kv", choices=CARRY_KV, default=None, help="rows in flight (keep)")
    g.add_argument("--max-staleness", type=int, default=None, help="policy versions (4)")
    g.add_argument("--on-stale", choices=ON_STALE, default=None, help="a due group (finish)")


# The refill settings the projection uses when neither a flag nor the config gives them.
DEFAULT = Refill(every=32, slots=None, shared_prefill=True, carry_kv="keep", max_staleness=4)
# Config keys (rollout.*), taken when a config has them (the engine reads refill_every,
# carry_kv, max_staleness and on_stale; the others are the simulator's); flags win.
_KEYS = {
    "every": "refill_every",
    "shared_prefill": "shared_prefill",
    "carry_kv": "carry_kv",
    "max_staleness": "max_staleness",
    "on_stale": "on_stale",
    "slots": "refill_slots",
}
# The flag (argparse dest) of each setting.
_FLAGS = {"every": "refill_every", "slots": "slots"} | {
    k: k for k in ("shared_prefill", "carry_kv", "max_staleness", "on_stale")
}


def settings(args, projection, config_rollout=None) -> tuple[Refill, dict]:
    """The refill settings: flags, else the config's ``rollout`` keys where it has them, else
    ``DEFAULT`` (S = B); and where each came from."""
    values, sources = {}, {}
    for field in _FLAGS:
        flag = getattr(args, _FLAGS[field], None)
        key = _KEYS[field]
        if flag is not None:
            values[field], sources[field] = flag, "flag"
        elif config_rollout is not None and getattr(config_rollout, key, None) not in (None, 0):
            # (rollout.refill_every 0 is "off": the projection prices the default then)
            values[field], sources[field] = getattr(config_rollout, key), f"rollout.{key}"
        else:
            values[field], sources[field] = getattr(DEFAULT, field), "default"
    if values["slots"] is None:
        values["slots"] = projection.workload.batch
    return Refill(**values), sources


def report(args, projection, progress=None) -> dict:
    """Print the refill settings, the mechanisms table and (unless --no-regime-map) the refill
    map; return them."""
    rollout = None
    if args.config is not None:
        from oppo_jax.config import load_config

        rollout = load_config(args.config, list(args.set)).rollout
    refill, sources = settings(args, projection, rollout)
    refill.check(dataclasses.replace(projection.workload, chunk_size=refill.every))
    w = projection.workload
    print("PROJECTION refill settings (each with where it came from):")
    print(f"  {refill.describe(w)}; C = {math.gcd(w.chunk_size, refill.every)} in refill rows"
          " (a divisor of refill_every)")  # fmt: skip
    print("  from: " + ", ".join(f"{k} {v}" for k, v in sources.items()))
    table = mechanisms(projection, refill, progress=progress)
    print("\n".join(format_mechanisms(table)))
    out = {"settings": dataclasses.asdict(refill), "sources": sources, "table": table}
    if not args.no_regime_map:
        out["map"] = refill_map(projection, refill, progress=progress)
        print("\n".join(format_refill_map(out["map"])))
    return out
