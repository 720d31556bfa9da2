"""Discrete-event simulation of PPO-RLHF steps under the sync, intra, inter and oppo schedules.

Each step is a plan of stages on device groups (``oppo_jax.sim.engine``) in the dispatch
order of ``oppo_jax.pipeline.schedule``:

    streamed (intra, oppo):  prefill actor | prefill scorers | decode 0, score 0, decode 1, ...
    not streamed (sync, inter): prefill actor | decode 0..K-1 | prefill scorers, score (all)
    then: build batch (dispatched after the last decode; it gathers the last score) | update
          | copy

``score k`` needs ``decode k``. Colocated, both kinds of work queue on the "generation" group;
disaggregated, scoring runs on a "scoring" group, concurrently. Host delays (CostModel.host_*)
hold back the dispatches the host makes: the first decode, the scorers after the host read
that the rollout may stop (not streamed), the build and the update.

Lockstep decode and the cut (DESIGN.md §3): all slots advance together; slot i finishes at
decode position f_i (its remaining length). Without carrying (sync, intra: B slots) the cut is
max f_i; with carrying (inter, oppo: B+Δ slots) it is the B-th smallest f_i, or later if a
slot carried ``max_deferrals`` times is still running. The batch is B finished slots ordered by
(must-finish first, f_i, admission order); the others are carried (FIFO) with the tokens they
had at the cut, re-prefilled (actor and scorers) when next admitted. A padded engine decodes
whole chunks, one more than the cut needs (the host reads the cut one chunk late), over
caches P + R wide, and admits carried rows at a context width W rounded up like
``oppo_jax.pipeline.carry.prefix_bucket``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from oppo_jax.pipeline.carry import prefix_bucket, select_batch
from oppo_jax.pipeline.events import Event, busy_fraction, stage_times
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.sim.engine import Plan
from oppo_jax.sim.model import CostModel
from oppo_jax.sim.trace import forward_steps, split_rows

PLACEMENTS = ("colocated", "disaggregated")


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


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What a step's costs depend on besides the lengths."""

    batch: int  # B
    chunk: int  # C
    prompt_len: int  # P
    capacity: int  # R, response capacity (padded engine)
    streamed: bool
    carrying: bool


def _decode(cost: CostModel, f: np.ndarray, base: np.ndarray, cut: int, chunk: int, cache: int):
    """Per decode chunk: seconds; per scored chunk: tokens to score; and the finish list."""
    scored = math.ceil(cut / chunk)
    if cost.padded_decode:  # whole chunks, every slot; one chunk more than the host needed
        scored = max(1, scored)
        n = scored + 1
        finish = np.where(f > n * chunk, -1, f)
        per_step = cost.decode_step_s(f.size, cache)
        seconds = [cost.decode_chunk_s + k * per_step for k in forward_steps(finish, n, chunk)]
        return seconds, [f.size * chunk] * scored, finish
    # Active slots only, to the cut. O(steps + n log n): with f sorted, running slots are a suffix.
    order = np.argsort(f, kind="stable")
    fs, bs = f[order], base[order]
    t = np.arange(cut)
    done = np.searchsorted(fs, t, side="right")  # slots with f_i <= t
    running = f.size - done
    ctx = np.concatenate([np.cumsum(bs[::-1])[::-1], [0]])[done] + t * running
    per_step = cost.decode_a + cost.decode_b * running + cost.decode_c * ctx
    starts = np.arange(0, cut, chunk)
    seconds = np.add.reduceat(per_step, starts) if cut else np.zeros(0)
    tokens = np.add.reduceat(running, starts) if cut else np.zeros(0, int)
    finish = np.where(f > cut, -1, f)
    return [cost.decode_chunk_s + float(x) for x in seconds], [int(x) for x in tokens], finish


def _plan(cost: CostModel, shape: _Shape, admit: int, seconds, tokens, update_tokens: int,
          sync_tokens: int, disagg: bool) -> Plan:  # fmt: skip
    """The step's stages in dispatch order (see the module docstring)."""
    gen, sco = "generation", "scoring" if disagg else "generation"
    p, at = Plan(), cost.host_admit_s + cost.host_setup_s
    actor = p.add("prefill actor", gen, cost.admit_s(admit), at=cost.host_admit_s)
    scoring = None
    if shape.streamed:
        scoring = p.add("prefill scorers", sco, cost.scorers_s(admit), at=at)
        at += cost.host_stream_s
    decodes = []
    for k, dur in enumerate(seconds):
        decodes.append(p.add("decode", gen, dur, at=at))
        if shape.streamed and k < len(tokens):
            scoring = p.add("score", sco, cost.scorers_s(tokens[k]), [(decodes[-1], 0.0)])
    seen = decodes[len(tokens) - 1] if tokens else actor  # the host reads the cut after it
    host = [(decodes[-1] if decodes else actor, cost.host_finish_s)]
    if not shape.streamed:
        p.add("prefill scorers", sco, cost.scorers_s(admit), [(seen, cost.host_collect_s)])
        scoring = p.add("score", sco, cost.scorers_s(sync_tokens))
        host.append((seen, cost.host_dispatch_s + cost.host_finish_s))
    p.add("build batch", gen, cost.build_s, host, needs=[scoring])
    update_deps = [(i, offset + cost.host_update_s) for i, offset in host]
    p.add("update", gen, cost.update_s(shape.batch, update_tokens), update_deps)
    p.add("copy", gen, cost.copy_s)
    return p


def _step(cost: CostModel, seqs: list[_Seq], shape: _Shape, disagg: bool, max_deferrals: int):
    """One step: events, the batch's sequences, the carried ones, and a metrics record."""
    b, c, padded = shape.batch, shape.chunk, cost.padded_decode
    f = np.array([s.length - s.generated for s in seqs])
    prefix = np.array([s.generated for s in seqs])
    must = np.array([not shape.carrying or s.deferrals >= max_deferrals for s in seqs])
    # Every slot's finish position is known here, so the engine's own cut rule gives the cut
    # (the first position at which B have finished, must-finish ones included) and the batch.
    selection = select_batch(f, np.ones(f.size, bool), must, b)
    cut, batch = selection.cut, selection.batch.tolist()
    lengths = np.array([seqs[i].length for i in batch])
    bucket = prefix_bucket(int(prefix.max()), shape.capacity) if shape.carrying else 0
    width = shape.prompt_len + bucket  # the padded engine's admission context
    # The padded engine prefills its leading carried rows at W and the rest at P.
    carried_rows = (split_rows(prefix, f.size) if cost.split_admission else f.size) if bucket else 0
    admitted = carried_rows * width + (f.size - carried_rows) * shape.prompt_len
    admit = admitted if padded else int(prefix.sum()) + f.size * shape.prompt_len
    seconds, tokens, finish = _decode(cost, f, shape.prompt_len + prefix, cut, c,
                                      shape.prompt_len + shape.capacity)  # fmt: skip
    sync_tokens = f.size * shape.capacity if padded else sum(tokens)
    real = int(lengths.sum()) + b * shape.prompt_len
    update_tokens = b * (shape.prompt_len + shape.capacity) if padded else real
    plan = _plan(cost, shape, admit, seconds, tokens, update_tokens, sync_tokens, disagg)
    events = plan.run(dict.fromkeys(("generation", "scoring"), cost.overlap_rate))
    taken, carried = set(batch), []
    for i, s in enumerate(seqs):
        if i not in taken:  # keeps the tokens it had at the cut
            carried.append(dataclasses.replace(s, generated=s.generated + min(int(f[i]), cut),
                                               deferrals=s.deferrals + 1))  # fmt: skip
    trace = {
        "slots": f.size, "width": width, "prompt_width": shape.prompt_len,
        "carried_rows": carried_rows,
        "response_capacity": shape.capacity, "prefix": prefix.tolist(), "finish": finish.tolist(),
        "lengths": lengths.tolist(), "cut": cut, "n_scorers": cost.n_scorers,
        "events": [[e.stage, e.group, e.start, e.end] for e in events],
    }  # fmt: skip
    record = _record(events, shape, trace, len(seqs) - b, len(carried))
    record["stale_token_frac"] = float(prefix[batch].sum()) / max(int(lengths.sum()), 1)
    return events, [seqs[i] for i in batch], carried, record


def _record(events: list[Event], shape: _Shape, trace: dict, overcommit: int, carried: int):
    """A metrics-like record of one simulated step (as ``metrics.jsonl`` holds, plus trace)."""
    wall = max(e.end for e in events)
    lengths = trace["lengths"]
    return {
        "step_time_s": wall, "stage_time_s": stage_times(events),
        "busy_fraction": busy_fraction(events, wall),
        "response_len_mean": float(np.mean(lengths)), "response_len_max": int(max(lengths)),
        "chunk_size": shape.chunk, "overcommit": overcommit, "carried": carried,
        "batch_size": shape.batch, "prompt_len": shape.prompt_len, "streamed": shape.streamed,
        "cut": trace["cut"], "trace": trace,
    }  # fmt: skip


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

    def summary(self, skip: int = 0) -> dict:
        """Mean / median / p90 step time (after ``skip`` steps), busy fraction per group,
        carrying statistics."""
        t = self.step_times[skip:]
        total, busy = float(t.sum()), {}
        for step in self.events[skip:]:
            for e in step:
                busy[e.group] = busy.get(e.group, 0.0) + (e.end - e.start) / total
        return {
            "schedule": self.schedule, "placement": self.placement,
            "chunk_size": self.chunk_size, "delta": self.delta,
            "step_time_mean_s": float(t.mean()), "step_time_median_s": float(np.median(t)),
            "step_time_p90_s": float(np.percentile(t, 90)), "busy_fraction": busy,
            "carried_mean": float(np.mean([r["carried"] for r in self.records[skip:]])),
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
    capacity: int | None = None,
) -> SimResult:
    """Simulate ``steps`` steps; new prompts' lengths come from ``lengths`` (see LengthSource).

    ``capacity`` is the response capacity R (default: the longest length); a padded engine's
    caches, sync scoring call and update are that wide.
    """
    if schedule not in SCHEDULES or placement not in PLACEMENTS:
        raise ValueError(f"schedule {schedule!r} / placement {placement!r}: expected one of "
                         f"{sorted(SCHEDULES)} / {PLACEMENTS}")  # fmt: skip
    if batch < 1 or chunk_size < 1 or delta < 0:
        raise ValueError("need batch >= 1, chunk_size >= 1, delta >= 0")
    streamed, carrying = SCHEDULES[schedule].stream, SCHEDULES[schedule].carry
    delta = delta if carrying else 0  # Δ is an inter-step setting
    source, buffer, next_id = LengthSource(lengths, seed), [], 0
    capacity = int(capacity or source.lengths.max())
    if source.lengths.max() > capacity:
        raise ValueError(f"lengths up to {source.lengths.max()} exceed the capacity {capacity}")
    shape = _Shape(batch, chunk_size, prompt_len, capacity, streamed, carrying and delta > 0)
    records, events, finished = [], [], []
    for step in range(steps):
        seqs, buffer = buffer[: batch + delta], buffer[batch + delta :]  # carried first, FIFO
        while len(seqs) < batch + delta:
            seqs.append(_Seq(next_id, source.next(), step))
            next_id += 1
        ev, done, carried, record = _step(cost, seqs, shape, placement == "disaggregated",
                                          max_deferrals)  # fmt: skip
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
