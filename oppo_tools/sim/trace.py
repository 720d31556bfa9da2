"""Per-step traces: what the simulator needs of a step, measured (``step_trace``) or simulated.

A trace is plain JSON: the step's shapes (slots S, prompt width P, response capacity R; traces
of the split admission before the replay also W and K, its carried rows' width and rows),
each slot's carried-in prefix and finish position, the batch's response lengths, the
timeline as ``[stage, group, start, end]`` rows (seconds since the step began), and the
engine that ran it (``engine``; older traces have none, see ``engines.recorded_engine``).
``observe`` turns a trace into what calibration fits: per stage kind, the time it ran alone
and the time it shared the machine with the other group (the build counts as busy only after
the scores it waits for arrived), and the times of the stages the host's delays show in.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oppo_tools.sim.engines import BUILT

GENERATION = "generation"


def step_trace(
    result,
    carried_in: list[int],
    prompt_width: int,
    compacted: int = 0,
    shared_prompts: int = 1,
) -> dict:
    """The trace of one measured step (a ``StepResult``); ``carried_in`` are the response
    lengths of the carried sequences it admitted first (the carry buffer before the step).
    ``engine`` stamps the engine that ran it (``engines.BUILT``, with ``compacted``: the
    smallest slot bucket its decode compacted into, 0 when it did not: what the calibration
    fits); ``shared_prompts``: slots sharing each prompt's prefill
    (``SlotBatch.shared_prompts``)."""
    finish = np.asarray(result.rollout.finish_step)
    slots, capacity = finish.size, int(np.asarray(result.rollout.tokens).shape[1])
    prefix = [int(n) for n in carried_in[:slots]]
    prefix += [0] * (slots - len(prefix))
    return {
        "slots": slots,
        "prompt_width": prompt_width,
        "response_capacity": capacity,
        "prefix": prefix,
        "shared_prompts": shared_prompts,
        "finish": finish.tolist(),
        "lengths": [int(n) for n in result.response_len],
        "cut": int(result.selection.cut),
        "events": [[e.stage, e.group, round(e.start, 7), round(e.end, 7)] for e in result.events],
        "engine": dataclasses.replace(
            BUILT,
            compact_slots=bool(compacted),
            compact_min_slots=max(compacted, 1),
        ).to_dict(),
    }


def forward_steps(finish, chunks: int, chunk: int, cut: int | None = None) -> list[int]:
    """Lockstep steps per decode chunk that run the model (a slot finishing at position f
    feeds f - 1 tokens; -1: still running). Once every slot is done the forward is skipped;
    with ``cut`` (the built engine's while_loop) no step runs at or past the cut.

    Example: finish [3, 10], 2 chunks of 8 -> [8, 1] (positions 0..8 feed; 9 samples EOS);
    finish [3, -1], cut 3, 2 chunks of 8 -> [3, 0] (the second chunk runs no step).
    """
    f = np.asarray(finish)
    last = chunks * chunk if (f < 0).any() else max(int(f.max(initial=0)) - 1, 0)
    if cut is not None:
        last = min(last, cut)
    return [int(np.clip(last - j * chunk, 0, chunk)) for j in range(chunks)]


def kind(stage: str) -> str:
    """Stage kind: the actor's prefill, decode, scorer, build, update, copy (or other)."""
    if stage in ("prefill actor", "decode", "build batch", "update", "copy"):
        return stage
    return "scorer" if stage.startswith(("prefill ", "score")) else "other"


def scorer_names(trace: dict) -> set[str]:
    """The scorers named in a measured timeline ("prefill critic" -> critic)."""
    return {s.split(" ", 1)[1] for s, *_ in trace["events"] if kind(s) == "scorer" and " " in s}


def _overlap(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    return sum((max(0.0, min(b, e) - max(a, s)) for s, e in spans), 0.0)


def observe(trace: dict) -> dict:
    """``solo`` / ``shared`` seconds per stage kind; ``first`` and ``last`` (start, end) per
    kind; ``decode`` (start, end) per chunk; the end of the scorers' work."""
    ev = [(kind(s), g == GENERATION, float(a), float(b)) for s, g, a, b in trace["events"]]
    scoring_end = max((b for k, _, _, b in ev if k == "scorer"), default=0.0)
    spans = [(max(a, min(b, scoring_end)) if k == "build batch" else a, b) for k, _, a, b in ev]
    busy = {g: [sp for sp, e in zip(spans, ev, strict=True) if e[1] == g] for g in (True, False)}
    out: dict = {"solo": {}, "shared": {}, "first": {}, "last": {}, "scoring_end": scoring_end}
    for (k, gen, a, b), (a2, b2) in zip(ev, spans, strict=True):
        shared = _overlap(a2, b2, busy[not gen])
        out["solo"][k] = out["solo"].get(k, 0.0) + (b2 - a2) - shared
        out["shared"][k] = out["shared"].get(k, 0.0) + shared
        out["first"].setdefault(k, (a, b))
        out["last"][k] = (a, b)
    out["decode"] = [(a, b) for k, _, a, b in ev if k == "decode"]
    return out
