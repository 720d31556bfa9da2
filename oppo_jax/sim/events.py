"""Discrete-event simulation of PPO-RLHF steps under the sync, intra, inter and oppo schedules.

Each device group runs its stages in dispatch order (FIFO); a stage starts when its group is
free and its inputs exist. Dispatch order follows ``oppo_jax.pipeline.schedule``:

    streamed (intra, oppo):  prefill actor | prefill scorers | decode 0, score 0, decode 1, ...
    not streamed (sync, inter): prefill actor | decode 0..K-1 | prefill scorers, score (all)
    then: update (after the last decode and the last score) | copy

``score k`` needs ``decode k`` done. Colocated, both kinds of work queue on the "generation"
group (serial); disaggregated, scoring runs on a "scoring" group, concurrently.

Lockstep decode and the cut (DESIGN.md §3): all slots advance together; slot i finishes at
decode position f_i (its remaining length). Without carrying (sync, intra: B slots) the cut is
max f_i; with carrying (inter, oppo: B+Δ slots) it is the B-th smallest f_i, or later if a
slot carried ``max_deferrals`` times is still running. The batch is B finished slots ordered by
(must-finish first, f_i, admission order); the others are carried (FIFO) with the tokens they
had at the cut, re-prefilled (actor and scorers) when next admitted.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from oppo_jax.sim.model import CostModel

# name -> (scorers stream the actor's chunks, carry stragglers with B + Δ slots)
SCHEDULES = {"sync": (False, False), "intra": (True, False), "inter": (False, True),
             "oppo": (True, True)}  # fmt: skip
PLACEMENTS = ("colocated", "disaggregated")


@dataclasses.dataclass(frozen=True)
class Event:
    """One stage on one device group, seconds since the step began."""

    stage: str
    group: str
    start: float
    end: float


@dataclasses.dataclass
class _Seq:
    seq_id: int
    length: int  # full response length, tokens
    admitted: int  # step of first admission
    generated: int = 0  # tokens already generated (carried prefix)
    deferrals: int = 0


class LengthSource:
    """Response lengths of new prompts: ``lengths`` in order (cycled) or, with a seed, sampled."""

    def __init__(self, lengths, seed: int | None):
        self.lengths = np.asarray(lengths, dtype=np.int64).ravel()
        if self.lengths.size == 0 or self.lengths.min() < 1:
            raise ValueError("lengths: need at least one response length, all >= 1")
        self.rng = None if seed is None else np.random.default_rng(seed)
        self.i = 0

    def next(self) -> int:
        """The next new prompt's response length."""
        if self.rng is not None:
            return int(self.rng.choice(self.lengths))
        self.i += 1
        return int(self.lengths[(self.i - 1) % self.lengths.size])


class _Groups:
    """FIFO device groups: a stage starts when its group is free and its inputs are ready."""

    def __init__(self):
        self.free: dict[str, float] = {}
        self.events: list[Event] = []

    def run(self, stage: str, group: str, seconds: float, after: float = 0.0) -> float:
        start = max(self.free.get(group, 0.0), after)
        self.free[group] = start + seconds
        self.events.append(Event(stage, group, start, start + seconds))
        return start + seconds


def _decode(cost: CostModel, f: np.ndarray, base: np.ndarray, cut: int, chunk: int):
    """Per decode chunk: (seconds, tokens to score); plus slot-steps and context sums."""
    scored = max(1, math.ceil(cut / chunk)) if cost.padded_decode else math.ceil(cut / chunk)
    # A fixed-shape engine decodes whole chunks, and one more that was queued before the host
    # saw the cut; an active-slot engine stops at the cut.
    steps = (scored + 1) * chunk if cost.padded_decode else cut
    # O(steps + n log n): with f sorted, the slots still running at t are a suffix.
    order = np.argsort(f, kind="stable")
    fs, bs = f[order], base[order]
    t = np.arange(steps)
    done = np.searchsorted(fs, t, side="right")  # slots with f_i <= t
    running = f.size - done
    if cost.padded_decode:  # every slot costs; a finished one's context stops growing
        slots = np.full(steps, f.size)
        ctx = bs.sum() + np.concatenate([[0], np.cumsum(fs)])[done] + t * running
        tokens = np.full(scored, f.size * chunk)
    else:
        slots = running
        ctx = np.concatenate([np.cumsum(bs[::-1])[::-1], [0]])[done] + t * running
    per_step = cost.decode_a + cost.decode_b * slots + cost.decode_c * ctx
    starts = np.arange(0, steps, chunk)
    seconds = np.add.reduceat(per_step, starts) if steps else np.zeros(0)
    if not cost.padded_decode:
        tokens = np.add.reduceat(running, starts) if steps else np.zeros(0, int)
    counts = {"decode_steps": steps, "slot_steps": int(slots.sum()), "slot_ctx": float(ctx.sum())}
    return [float(x) for x in seconds], [int(x) for x in tokens], counts


def _step(cost, seqs, b, chunk, streamed, carrying, disagg, max_deferrals, prompt_len):
    """One step: events, the batch's sequences, the carried ones, and a metrics record."""
    f = np.array([s.length - s.generated for s in seqs])
    base = np.array([prompt_len + s.generated for s in seqs])
    must = np.array([not carrying or s.deferrals >= max_deferrals for s in seqs])
    cut = int(max(np.sort(f)[b - 1], f[must].max(initial=0)))
    order = np.lexsort((np.arange(f.size), f, ~must))
    batch = [i for i in order if f[i] <= cut][:b]
    g, gen, sco = _Groups(), "generation", "scoring" if disagg else "generation"
    admit_tokens = int(base.sum())
    g.run("prefill actor", gen, cost.admit_s(admit_tokens))
    seconds, tokens, counts = _decode(cost, f, base, cut, chunk)
    calls = [admit_tokens] + (tokens if streamed else [sum(tokens)])
    if streamed:
        g.run("prefill scorers", sco, cost.scorers_s(admit_tokens))
    ends = []
    for k, dur in enumerate(seconds):
        ends.append(g.run("decode", gen, dur))
        if streamed and k < len(tokens):
            ends.append(g.run("score", sco, cost.scorers_s(tokens[k]), after=ends[-1]))
    if not streamed:
        g.run("prefill scorers", sco, cost.scorers_s(admit_tokens), after=max(ends, default=0.0))
        ends.append(g.run("score", sco, cost.scorers_s(calls[1])))
    lengths = np.array([seqs[i].length for i in batch])
    batch_tokens = int(lengths.sum()) + b * prompt_len
    g.run("update", gen, cost.update_s(b, batch_tokens), after=max(ends, default=0.0))
    g.run("copy", gen, cost.copy_s)
    wall = max(e.end for e in g.events)
    taken, carried = set(batch), []
    for i, s in enumerate(seqs):
        if i not in taken:  # keeps the tokens it had at the cut
            carried.append(dataclasses.replace(s, generated=s.generated + min(int(f[i]), cut),
                                               deferrals=s.deferrals + 1))  # fmt: skip
    stage_time, busy = {}, {}
    for e in g.events:
        stage_time[e.stage] = stage_time.get(e.stage, 0.0) + e.end - e.start
        busy[e.group] = busy.get(e.group, 0.0) + e.end - e.start
    n = cost.n_scorers
    counts |= {"admit_tokens": admit_tokens, "scorer_calls": n * len(calls),
               "scorer_tokens": n * sum(calls), "batch_tokens": batch_tokens,
               "n_scorers": n}  # fmt: skip
    record = {
        "step_time_s": wall, "stage_time_s": stage_time,
        "busy_fraction": {k: v / wall if wall else 0.0 for k, v in busy.items()},
        "response_len_mean": float(lengths.mean()), "response_len_max": int(lengths.max()),
        "stale_token_frac": sum(seqs[i].generated for i in batch) / max(int(lengths.sum()), 1),
        "chunk_size": chunk, "overcommit": len(seqs) - b, "carried": len(carried),
        "batch_size": b, "prompt_len": prompt_len, "streamed": streamed, "cut": cut,
        "counts": counts,
    }  # fmt: skip
    return g.events, [seqs[i] for i in batch], carried, record


@dataclasses.dataclass
class SimResult:
    """Simulated steps of one schedule: metrics-like records, events, finished sequences."""

    schedule: str
    placement: str
    chunk_size: int
    delta: int
    records: list[dict]
    events: list[list[Event]]  # per step, for a Gantt chart
    finished: list[dict]  # seq_id, length, admitted, finished (step), deferrals

    @property
    def step_times(self) -> np.ndarray:
        return np.array([r["step_time_s"] for r in self.records])

    def summary(self) -> dict:
        """Mean / median / p90 step time, busy fraction per group, carrying statistics."""
        t, total = self.step_times, float(self.step_times.sum())
        busy: dict[str, float] = {}
        for step in self.events:
            for e in step:
                busy[e.group] = busy.get(e.group, 0.0) + (e.end - e.start) / total
        return {
            "schedule": self.schedule, "placement": self.placement,
            "chunk_size": self.chunk_size, "delta": self.delta,
            "step_time_mean_s": float(t.mean()), "step_time_median_s": float(np.median(t)),
            "step_time_p90_s": float(np.percentile(t, 90)), "busy_fraction": busy,
            "carried_mean": float(np.mean([r["carried"] for r in self.records])),
            "deferrals_max": max((f["deferrals"] for f in self.finished), default=0),
        }  # fmt: skip


def simulate(
    cost: CostModel,
    schedule: str,
    batch: int,
    lengths,
    chunk_size: int = 128,
    delta: int = 0,
    placement: str = "disaggregated",
    steps: int = 100,
    seed: int | None = 0,
    max_deferrals: int = 2,
    prompt_len: int = 0,
) -> SimResult:
    """Simulate ``steps`` steps; new prompts' lengths come from ``lengths`` (see LengthSource)."""
    if schedule not in SCHEDULES or placement not in PLACEMENTS:
        raise ValueError(f"schedule {schedule!r} / placement {placement!r}: expected one of "
                         f"{sorted(SCHEDULES)} / {PLACEMENTS}")  # fmt: skip
    if batch < 1 or chunk_size < 1 or delta < 0:
        raise ValueError("need batch >= 1, chunk_size >= 1, delta >= 0")
    streamed, carrying = SCHEDULES[schedule]
    delta = delta if carrying else 0  # Δ is an inter-step setting
    source, buffer, next_id = LengthSource(lengths, seed), [], 0
    records, events, finished = [], [], []
    for step in range(steps):
        seqs, buffer = buffer[: batch + delta], buffer[batch + delta :]  # carried first, FIFO
        while len(seqs) < batch + delta:
            seqs.append(_Seq(next_id, source.next(), step))
            next_id += 1
        ev, done, carried, record = _step(cost, seqs, batch, chunk_size, streamed, carrying,
                                          placement == "disaggregated", max_deferrals,
                                          prompt_len)  # fmt: skip
        buffer += carried
        records.append({"step": step, **record})
        events.append(ev)
        finished += [{"seq_id": s.seq_id, "length": s.length, "admitted": s.admitted,
                      "finished": step, "deferrals": s.deferrals} for s in done]  # fmt: skip
    return SimResult(schedule, placement, chunk_size, delta, records, events, finished)


def compare(cost: CostModel, lengths, batch: int, **kwargs) -> dict:
    """Simulate all four schedules (same prompts, same ``kwargs``); summaries and speedups."""
    out = {name: simulate(cost, name, batch, lengths, **kwargs).summary() for name in SCHEDULES}
    sync = out["sync"]["step_time_mean_s"]
    return {
        "schedules": out,
        "speedup_vs_sync": {n: sync / s["step_time_mean_s"] for n, s in out.items() if n != "sync"},
    }


def recommend(
    cost_model: CostModel,
    lengths,
    B: int,
    candidates_C=(64, 128, 256, 512),
    candidates_delta=(0, 2, 4, 8, 16),
    schedule: str = "oppo",
    **kwargs,
) -> dict:
    """The (C, Δ) with the lowest simulated mean step time (Δ ≤ B; ties: smaller Δ, then C)."""
    deltas = sorted(d for d in set(candidates_delta) if 0 <= d <= B) or [0]
    grid = []
    for d in deltas:
        for c in sorted(set(candidates_C)):
            s = simulate(cost_model, schedule, B, lengths, c, d, **kwargs).summary()
            grid.append({"chunk_size": c, "delta": d, "step_time_s": s["step_time_mean_s"]})
    best = min(grid, key=lambda g: g["step_time_s"])  # min keeps the first of equal ones
    sync = simulate(cost_model, "sync", B, lengths, best["chunk_size"], 0, **kwargs)
    sync_s = float(sync.step_times.mean())
    return {**best, "schedule": schedule, "sync_step_time_s": sync_s,
            "speedup_vs_sync": sync_s / best["step_time_s"], "grid": grid}  # fmt: skip
