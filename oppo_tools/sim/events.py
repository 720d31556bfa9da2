"""Discrete-event simulation of PPO-RLHF steps under the sync, intra, inter and oppo schedules.

Each step is a plan of stages on device groups (``oppo_tools.sim.engine``) in the dispatch
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
max f_i; with carrying (inter, oppo: B + Δ·G slots, Δ counting groups of G) it is the
(B/G)-th smallest group finish, a group finishing with its longest member, or later if a
group carried ``max_deferrals`` times is still running (``pipeline.carry.select_batch``, the
engine's own rule). The batch is B/G finished groups ordered by (must-finish first, finish,
admission order); the other groups are carried whole (FIFO), each member with the tokens it
had at the cut. G = 1 is PPO: every sequence its own group. A new prompt's G responses draw
their lengths independently (no correlation within a group: the widest spread). What each
stage computes (chunks, slots, widths, re-prefills) is the engine's (``engines``, ``work``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oppo_jax.pipeline.carry import prompt_sharing, select_batch
from oppo_jax.pipeline.events import Event, busy_fraction, stage_times
from oppo_jax.pipeline.schedule import SCHEDULES, Schedule
from oppo_tools.sim.engine import Plan
from oppo_tools.sim.engines import BUILT, Engine
from oppo_tools.sim.model import CostModel
from oppo_tools.sim.packing import UpdateGroups, prefix_bucket, split_rows
from oppo_tools.sim.work import StepFacts, Work, decode_chunks, step_work

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
            # = rng.choice(lengths), the same draw (choice's own index), 5x cheaper a call
            return int(self.lengths[self.rng.integers(0, self.lengths.size)])
        self.i += 1
        return int(self.lengths[(self.i - 1) % self.lengths.size])


@dataclasses.dataclass(frozen=True)
class Workload:
    """A simulated run's settings: everything but the costs, the engine, the schedule and the
    response lengths."""

    batch: int  # B, sequences per PPO batch
    chunk_size: int = 128  # C, tokens per decode chunk
    delta: int = 0  # Δ, groups of G sequences started beyond B (carrying schedules only)
    prompt_len: int = 0  # P, prompt width, tokens
    capacity: int | None = None  # R, response capacity, tokens (None: the longest length)
    placement: str = "disaggregated"  # colocated | disaggregated
    max_deferrals: int = 2  # steps a sequence may be carried before it must finish
    steps: int = 100  # simulated steps
    seed: int | None = 0  # sampling of new prompts' lengths; None: in order, cycled
    # the packed update's microbatches (PPO epochs, minibatches x accumulation, batch shards)
    update_groups: UpdateGroups = UpdateGroups()
    group_size: int = 1  # G, responses per prompt, admitted, cut and carried as one group

    @property
    def slots(self) -> int:
        """B + Δ·G: the sequences a carrying step starts."""
        return self.batch + self.delta * self.group_size

    def check(self) -> None:
        """Raise ValueError on settings no engine runs."""
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r}: expected one of {PLACEMENTS}")
        if self.batch < 1 or self.chunk_size < 1 or self.delta < 0 or self.steps < 1:
            raise ValueError("need batch >= 1, chunk_size >= 1, delta >= 0, steps >= 1")
        if self.group_size < 1 or self.batch % self.group_size:
            raise ValueError(f"batch {self.batch}: not a multiple of the group size G")
        if self.batch % self.update_groups.microbatches:
            raise ValueError(
                f"batch {self.batch} does not split into {self.update_groups.microbatches} "
                "update microbatches (ppo.num_minibatches x ppo.grad_accum_steps)"
            )


def _plan(cost: CostModel, work: Work, streamed: bool, disagg: bool) -> Plan:
    """The step's stages in dispatch order (see the module docstring)."""
    gen, sco = "generation", "scoring" if disagg else "generation"
    p, at = Plan(), cost.host_admit_s + cost.host_setup_s
    copies = cost.copy_kv_s(work.copied_positions)  # a shared prompt's K and V, to its slots
    actor = p.add(
        "prefill actor", gen, cost.admit_s(work.actor_tokens) + copies, at=cost.host_admit_s
    )
    scoring = None
    if streamed:
        scoring = p.add("prefill scorers", sco, cost.scoring_s(work.scorer_admit_tokens), at=at)
        at += cost.host_stream_s
    decodes = []
    for k, chunk in enumerate(work.decode):
        decodes.append(p.add("decode", gen, cost.decode_s(*chunk), at=at))
        if streamed and k < len(work.score_chunks):
            tokens = work.score_chunks[k]
            scoring = p.add("score", sco, cost.scoring_s(tokens), [(decodes[-1], 0.0)])
    scored = len(work.score_chunks)
    seen = decodes[scored - 1] if scored else actor  # the host reads the cut after it
    host = [(decodes[-1] if decodes else actor, cost.host_finish_s)]
    if not streamed:
        tokens = work.sync_admit_tokens
        tokens = work.scorer_admit_tokens if tokens is None else tokens
        deps = [(seen, cost.host_collect_s)]
        if work.sync_admit_tokens != 0:  # 0: the packed sync scoring has no admission prefill
            p.add("prefill scorers", sco, cost.scoring_s(tokens), deps)
            deps = ()  # the score call queues behind the admission on its group
        scoring = p.add("score", sco, cost.scoring_s(work.sync_score_tokens), deps)
        host.append((seen, cost.host_dispatch_s + cost.host_finish_s))
    p.add("build batch", gen, cost.build_s, host, needs=[scoring])
    update_deps = [(i, offset + cost.host_update_s) for i, offset in host]
    p.add("update", gen, cost.update_s(work.update_tokens, work.update_pairs), update_deps)
    p.add("copy", gen, cost.copy_s)
    return p


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every step of one simulation shares."""

    cost: CostModel
    engine: Engine
    schedule: Schedule
    workload: Workload
    capacity: int  # R, resolved
    carrying: bool  # B + Δ slots with Δ > 0


def _step(run: _Run, seqs: list[_Seq]):
    """One step: events, the batch's sequences, the carried ones, and a metrics record."""
    w, engine = run.workload, run.engine
    f = np.array([s.length - s.generated for s in seqs])
    prefix = np.array([s.generated for s in seqs])
    must = np.array([not run.carrying or s.deferrals >= w.max_deferrals for s in seqs])
    # Every slot's finish position is known here, so the engine's own cut rule gives the cut
    # (the first position at which B have finished, must-finish ones included) and the batch.
    selection = select_batch(f, np.ones(f.size, bool), must, w.batch, w.group_size)
    cut, batch = selection.cut, selection.batch.tolist()
    bucket = prefix_bucket(int(prefix.max()), run.capacity) if run.carrying else 0
    chunks = decode_chunks(engine, cut, w.chunk_size)
    # What the engine records as a finish: the padded engine decoded its whole chunks.
    decoded = cut if engine.decode_to_cut or engine.token_proportional else chunks * w.chunk_size
    facts = StepFacts(
        slots=f.size,
        prompt_len=w.prompt_len,
        capacity=run.capacity,
        chunk=w.chunk_size,
        width=w.prompt_len + bucket,
        # The split admission prefills its leading carried rows at W and the rest at P.
        carried_rows=split_rows(prefix, f.size) if bucket else 0,
        prefix=prefix,
        finish=np.where(f > decoded, -1, f),
        cut=cut,
        batch_lengths=np.array([seqs[i].length for i in batch]),
        chunks=chunks,
        update_groups=w.update_groups,
        shared_prompts=prompt_sharing(f.size, w.group_size),
        group_size=w.group_size,
    )
    work = step_work(engine, facts, run.cost.n_scorers, run.cost.trained_scorers)
    plan = _plan(run.cost, work, run.schedule.stream, w.placement == "disaggregated")
    events = plan.run(dict.fromkeys(("generation", "scoring"), run.cost.overlap_rate))
    taken, carried = set(batch), []
    for i, s in enumerate(seqs):
        if i not in taken:  # keeps the tokens it had at the cut
            made = s.generated + min(int(f[i]), cut)
            carried.append(dataclasses.replace(s, generated=made, deferrals=s.deferrals + 1))
    trace = {
        "slots": f.size,
        "width": facts.width,
        "prompt_width": w.prompt_len,
        "carried_rows": facts.carried_rows,
        "response_capacity": run.capacity,
        "prefix": prefix.tolist(),
        "shared_prompts": facts.shared_prompts,
        "finish": facts.finish.tolist(),
        "lengths": facts.batch_lengths.tolist(),
        "cut": cut,
        "n_scorers": run.cost.n_scorers,
        "trained_scorers": run.cost.trained_scorers,
        "events": [[e.stage, e.group, e.start, e.end] for e in events],
        "engine": engine.to_dict(),
    }
    record = _record(events, run, trace, len(seqs) - w.batch, len(carried))
    lengths = facts.batch_lengths
    record["stale_token_frac"] = float(prefix[batch].sum()) / max(int(lengths.sum()), 1)
    return events, [seqs[i] for i in batch], carried, record


def _record(events: list[Event], run: _Run, trace: dict, overcommit: int, carried: int):
    """A metrics-like record of one simulated step (as ``metrics.jsonl`` holds, plus trace)."""
    wall = max(e.end for e in events)
    lengths, w = trace["lengths"], run.workload
    return {
        "step_time_s": wall,
        "stage_time_s": stage_times(events),
        "busy_fraction": busy_fraction(events, wall),
        "response_len_mean": float(np.mean(lengths)),
        "response_len_max": int(max(lengths)),
        "chunk_size": w.chunk_size,
        "overcommit": overcommit,
        "carried": carried,
        "batch_size": w.batch,
        "prompt_len": w.prompt_len,
        "streamed": run.schedule.stream,
        "cut": trace["cut"],
        "trace": trace,
    }


@dataclasses.dataclass
class SimResult:
    """Simulated steps of one schedule: metrics-like records, events, finished sequences."""

    schedule: str
    engine: str
    workload: Workload
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
        w = self.workload
        return {
            "schedule": self.schedule,
            "engine": self.engine,
            "placement": w.placement,
            "chunk_size": w.chunk_size,
            "delta": w.delta,
            "step_time_mean_s": float(t.mean()),
            "step_time_median_s": float(np.median(t)),
            "step_time_p90_s": float(np.percentile(t, 90)),
            "busy_fraction": busy,
            "carried_mean": float(np.mean([r["carried"] for r in self.records[skip:]])),
            "deferrals_max": max((f["deferrals"] for f in self.finished), default=0),
        }


def simulate(
    cost: CostModel, schedule: str, workload: Workload, lengths, engine: Engine = BUILT
) -> SimResult:
    """Simulate ``workload.steps`` steps of ``schedule`` on ``engine`` priced by ``cost``;
    new prompts' response lengths come from ``lengths`` (see LengthSource).

    ``workload.capacity`` is the response capacity R (default: the longest length); a
    fixed-shape engine's caches, sync scoring call and update are that wide.
    """
    workload.check()
    plan = Schedule.named(schedule)
    w = workload if plan.carry else dataclasses.replace(workload, delta=0)  # Δ: inter-step
    source, buffer, next_id = LengthSource(lengths, w.seed), [], 0
    capacity = int(w.capacity or source.lengths.max())
    if source.lengths.max() > capacity:
        raise ValueError(f"lengths up to {source.lengths.max()} exceed the capacity {capacity}")
    run = _Run(cost, engine, plan, w, capacity, plan.carry and w.delta > 0)
    records, events, finished = [], [], []
    for step in range(w.steps):
        seqs, buffer = buffer[: w.slots], buffer[w.slots :]  # carried first, FIFO, whole groups
        while len(seqs) < w.slots:  # a new prompt's G responses, each its own length
            seqs.append(_Seq(next_id, source.next(), step))
            next_id += 1
        ev, done, carried, record = _step(run, seqs)
        buffer += carried
        records.append({"step": step, **record})
        events.append(ev)
        for s in done:
            finished.append(
                {
                    "seq_id": s.seq_id,
                    "length": s.length,
                    "admitted": s.admitted,
                    "finished": step,
                    "deferrals": s.deferrals,
                }
            )
    return SimResult(schedule, engine.name, w, records, events, finished)


def compare(cost: CostModel, workload: Workload, lengths, engine: Engine = BUILT) -> dict:
    """Simulate all four schedules (same prompts, same settings); summaries and speedups."""
    out = {n: simulate(cost, n, workload, lengths, engine).summary() for n in SCHEDULES}
    sync = out["sync"]["step_time_mean_s"]
    return {
        "schedules": out,
        "speedup_vs_sync": {n: sync / s["step_time_mean_s"] for n, s in out.items() if n != "sync"},
    }


def recommend(
    cost: CostModel,
    workload: Workload,
    lengths,
    engine: Engine = BUILT,
    candidates_c=(64, 128, 256, 512),
    candidates_delta=(0, 2, 4, 8, 16),
    schedule: str = "oppo",
) -> dict:
    """The (C, Δ) with the lowest simulated mean step time (Δ·G ≤ B; ties: smaller Δ, then C),
    the quantity ``compare`` reports as ``step_time_mean_s``. ``workload``'s own C and Δ are
    candidates too, so the best is never slower than the row ``compare`` gives for it (a
    recommendation of C=64 at 0.173 s stood beside C=16's 0.1695 s when C=16 was not tried).
    """
    groups = workload.batch // workload.group_size
    deltas = {*candidates_delta, workload.delta}
    deltas = sorted(d for d in deltas if 0 <= d <= groups) or [0]
    grid = []
    for d in deltas:
        for c in sorted({*candidates_c, workload.chunk_size}):
            w = dataclasses.replace(workload, chunk_size=c, delta=d)
            s = simulate(cost, schedule, w, lengths, engine).summary()
            grid.append({"chunk_size": c, "delta": d, "step_time_s": s["step_time_mean_s"]})
    best = min(grid, key=lambda g: g["step_time_s"])  # min keeps the first of equal ones
    w = dataclasses.replace(workload, chunk_size=best["chunk_size"], delta=0)
    sync_s = float(simulate(cost, "sync", w, lengths, engine).step_times.mean())
    return {
        **best,
        "schedule": schedule,
        "sync_step_time_s": sync_s,
        "speedup_vs_sync": sync_s / best["step_time_s"],
        "grid": grid,
    }
