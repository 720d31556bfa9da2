"""What a bench run's own timelines say: the ideal bound of each schedule and where its time
goes, and the share of each stage in ``sync``.

Read from the per-step traces that ``oppo-jax bench`` records (``trace`` in each record of
``bench.json``: the step's events as [stage, group, start, end] and its cut position), so the
numbers can be recomputed from a saved bench.json.

**Ideal bound** of a schedule: the step time if every scorer call hid under decode and the
rollout ended at the B-th completion, with nothing else changed. From the run's own measured
costs, per step:

    ideal = actor admission prefill + c * cut + build + update

where c is the run's decode cost per lockstep step (its summed decode time over its summed
decode steps), ``cut`` the lockstep position of the step's B-th completion (where every
schedule's rollout ends: the last of B in ``sync``/``intra``, the B-th of B + Δ in
``inter``/``oppo``), ``build`` the experience kernel's own time (after the scores it waits
for arrived) and ``update`` as measured. Measured / ideal says how much of the step is
exposed scoring and host time; ``exposed_scoring_s`` and ``idle_s`` say which.
"""

from __future__ import annotations

import statistics

GENERATION = "generation"
_GENERATION_KINDS = ("prefill actor", "decode", "build batch", "update")


def is_scorer(stage: str) -> bool:
    """A reference, critic or reward-model call ("prefill critic", "score reward", ...)."""
    return stage.startswith(("score ", "prefill ")) and stage != "prefill actor"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans) -> float:
    return sum(b - a for a, b in _union(spans))


def _outside(spans, cover) -> float:
    """Seconds of ``spans`` not covered by ``cover``."""
    cover = _union(cover)
    total = 0.0
    for a, b in _union(spans):
        inside = sum(max(0.0, min(b, e) - max(a, s)) for s, e in cover)
        total += (b - a) - inside
    return total


def step_costs(record: dict) -> dict:
    """Seconds per stage kind of one measured step, from its trace.

    ``build`` is the experience kernel's own time: its event starts at dispatch and ends when
    the scores it waits for have arrived and the batch is built, so the wait is cut off.
    """
    events = [(s, g, float(a), float(b)) for s, g, a, b in record["trace"]["events"]]
    scoring = [(a, b) for s, _, a, b in events if is_scorer(s)]
    scoring_end = max((b for _, b in scoring), default=0.0)
    costs = dict.fromkeys(_GENERATION_KINDS, 0.0)
    generation = []  # spans in which the actor's device group computes
    for stage, _, a, b in events:
        if stage == "build batch":
            a = max(a, min(b, scoring_end))
        if stage in costs:
            costs[stage] += b - a
            generation.append((a, b))
    wall = float(record["step_time_s"])
    busy = generation + scoring
    return {
        **{k.replace(" ", "_"): v for k, v in costs.items()},
        "scoring": sum(b - a for a, b in scoring),
        # scorer time during which the actor's group computed nothing (with colocated
        # placement the scorers run on the actor's group, so all of it)
        "exposed_scoring": _outside(scoring, generation),
        "idle": max(wall - _length(busy), 0.0),  # neither group computing: host time, waits
        "cut": int(record["trace"]["cut"]),
        "wall": wall,
    }


def ideal_bound(records: list[dict]) -> dict:
    """The schedule's ideal step time (module docstring) and its measured / ideal ratio,
    with the medians of the stage costs it is made of and of the time it leaves out."""
    costs = [step_costs(r) for r in records]
    steps = sum(c["cut"] for c in costs)
    per_step = sum(c["decode"] for c in costs) / steps if steps else 0.0
    ideals = [
        c["prefill_actor"] + per_step * c["cut"] + c["build_batch"] + c["update"] for c in costs
    ]
    measured = statistics.median(c["wall"] for c in costs)
    ideal = statistics.median(ideals)
    parts = ("prefill_actor", "decode", "build_batch", "update", "exposed_scoring", "idle")
    return {
        "ideal_step_s": ideal,
        "measured_step_s": measured,
        "measured_over_ideal": measured / ideal if ideal > 0 else None,
        "decode_per_lockstep_step_s": per_step,
        "cut_median": statistics.median(c["cut"] for c in costs),
        "median_s": {k: statistics.median(c[k] for c in costs) for k in parts},
    }


def stage_shares(records: list[dict]) -> dict:
    """Share of the summed step time spent in decode, scoring, update and the rest (host,
    actor admission, batch build), over the given steps (``sync``'s: there every stage runs
    alone, so the shares add up to one)."""
    costs = [step_costs(r) for r in records]
    wall = sum(c["wall"] for c in costs)
    shares = {k: sum(c[k] for c in costs) / wall for k in ("decode", "scoring", "update")}
    shares["other"] = 1.0 - sum(shares.values())
    shares["decode_plus_scoring"] = shares["decode"] + shares["scoring"]
    return shares


def pooled_efficiency(records: list[dict]) -> dict:
    """Per stage over a schedule's records: Σ tokens real / Σ tokens computed (the ledger of
    ``pipeline.accounting``, in each record), and both sums. Records without a ledger (older
    runs) are left out; {} when none has one."""
    computed: dict[str, int] = {}
    real: dict[str, int] = {}
    for r in records:
        for stage, n in r.get("tokens_computed", {}).items():
            computed[stage] = computed.get(stage, 0) + n
            real[stage] = real.get(stage, 0) + r["tokens_real"][stage]
    return {
        stage: {
            "tokens_computed": n,
            "tokens_real": real[stage],
            "efficiency": real[stage] / n if n else None,
        }
        for stage, n in computed.items()
    }
