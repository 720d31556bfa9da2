"""Every row busy (issue 44), priced: continuous refill under group-atomic carry.

The engine refills by this policy (docs/REFILL.md); this prices what each mechanism buys. A
refilling step decodes S fixed rows. When a sequence ends, its row is free at the next refill
point (every ``every`` tokens, a multiple of C) and takes a sample of an admitted group, or of a
new prompt's group admitted there (its G samples take free rows; the ones that find none wait,
first in line at the next refill point). The step's rollout ends at the cut: the decode position
where B/G groups are complete (a group with its last member) and, with ``on_stale="finish"``,
every group due this step too. The batch: complete groups by (due step, completion, admission),
B/G of them; every other group decodes on into the next step, in its rows.

- **Shared prompt prefill**: a group's prompt is prefilled once, at admission, and its KV copied
  into each sample's row (2·P KV positions moved); off, each sample's prompt is prefilled when
  it takes a row. The same for every scorer that admits prompts.
- **carry_kv**: at a step's start the rows in flight hold KV of older weights. ``replay``
  re-prefills each live row's prompt and prefix under the new weights (today's exact path; the
  prompt once per group when shared), in the actor and a trained scorer (the critic); ``keep``
  keeps the stale KV (no cost). Frozen scorers keep theirs either way.
- **Staleness** in policy versions: a token sampled in step v and trained in step k is k - v
  stale. A group admitted in step v is due in step v + ``max_staleness``: the cut waits for it
  (``finish``) or it is dropped there unfinished (``drop``); a due group the batch has no room
  for is dropped (counted; none at the settings projected). New groups are admitted only while
  fewer than (max_staleness + 1)·B/G groups are untrained: the steps up to a new group's due
  step train no more. ``max_staleness = 0`` is ``sync``: B/G groups a step, all due in it.
- **Costs** (``CostModel``): a decode position where any row runs costs a + b·rows + c·Σ
  contexts (a fixed-shape engine computes all S rows; the token-proportional one its running
  rows; a ragged engine reads each running row's own context in whole key blocks), admissions
  and replays q0 + q1·tokens per call, scorers p0 + p1·tokens per call (one per refill interval,
  streamed), the update as ``work.update_work`` prices the batch. Colocated: all of it in turn
  on one group; disaggregated: the scorers on their own, the last interval's scoring after the
  cut. Host delays and per-chunk dispatch costs are left out (0 in every roofline model).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from oppo_tools.sim.engines import Engine
from oppo_tools.sim.events import LengthSource, Workload
from oppo_tools.sim.model import CostModel
from oppo_tools.sim.packing import REPLAY_CHUNK
from oppo_tools.sim.work import update_work

CARRY_KV = ("replay", "keep")  # a carried prefix under new weights: re-prefilled, or stale KV
ON_STALE = ("finish", "drop")  # a group due this step: the cut waits for it, or it is dropped


@dataclasses.dataclass(frozen=True)
class Refill:
    """The settings of continuous refill (module docstring; ``oppo-jax sim --refill-every/
    --slots/--shared-prefill/--carry-kv/--max-staleness/--on-stale``; the engine's
    ``rollout.refill_every``, docs/REFILL.md)."""

    every: int = 32  # tokens between refill points, a multiple of C
    slots: int | None = None  # S, rows decoded; None: B + Δ·G (the carrying schedule's)
    shared_prefill: bool = True  # a prompt prefilled once per group, its KV copied to G rows
    carry_kv: str = "replay"  # replay | keep: rows in flight when the weights change
    max_staleness: int = 2  # policy versions a trained token may lag its update
    on_stale: str = "finish"  # finish | drop: a group due this step and not complete

    def rows(self, workload: Workload) -> int:
        """S for ``workload``."""
        return self.slots or workload.slots

    def check(self, workload: Workload) -> None:
        """Raise ValueError on settings no refilling engine could run."""
        c = workload.chunk_size
        if self.every < c or self.every % c:
            raise ValueError(f"refill every {self.every} tokens: not a multiple of C = {c}")
        if self.rows(workload) < 1 or self.max_staleness < 0:
            raise ValueError("refill: need slots >= 1 and max_staleness >= 0")
        if self.carry_kv not in CARRY_KV or self.on_stale not in ON_STALE:
            raise ValueError(f"refill: carry_kv in {CARRY_KV}, on_stale in {ON_STALE}")

    def describe(self, workload: Workload) -> str:
        """One line: every setting."""
        prefill = "once per group" if self.shared_prefill else "once per sample"
        return (
            f"refill every {self.every} tokens, S = {self.rows(workload)} rows, prompt prefilled "
            f"{prefill}, carry_kv {self.carry_kv}, max staleness {self.max_staleness} "
            f"version(s) ({self.on_stale} when due)"
        )


@dataclasses.dataclass
class _Sample:
    length: int  # response tokens in all
    made: int = 0  # tokens generated so far
    row: bool = False  # holds a row (started, not finished)
    versions: Counter = dataclasses.field(default_factory=Counter)  # tokens per sampling step


@dataclasses.dataclass
class _Group:
    gid: int
    version: int  # the step that admitted it
    samples: list[_Sample]
    done: int | None = None  # position it completed at this step (-1: before this step)

    @property
    def pending(self) -> list[_Sample]:
        return [s for s in self.samples if not s.row and s.made < s.length]


@dataclasses.dataclass
class _Ledger:
    """One step's work in seconds, per device group and stage."""

    gen: Counter = dataclasses.field(default_factory=Counter)
    sco: Counter = dataclasses.field(default_factory=Counter)
    last_score: float = 0.0  # the last interval's scoring (after the cut when disaggregated)
    steps: int = 0  # decode positions that ran
    real: int = 0  # tokens decoded
    prompt_tokens: int = 0  # prompt tokens the actor's admissions prefilled


@dataclasses.dataclass
class _Run:
    cost: CostModel
    engine: Engine
    w: Workload
    refill: Refill
    capacity: int
    source: LengthSource
    groups: list[_Group] = dataclasses.field(default_factory=list)  # untrained, admission order
    next_gid: int = 0

    @property
    def per_batch(self) -> int:
        return self.w.batch // self.w.group_size


def _due(run: _Run, g: _Group) -> int:
    return g.version + run.refill.max_staleness


def _prefill(run: _Run, led: _Ledger, tokens: int | float, stage: str, scorers: int) -> None:
    """An actor call of ``tokens`` and the same in ``scorers`` scorers' calls."""
    if tokens:
        led.gen[stage] += run.cost.admit_s(tokens)
        if scorers:
            led.sco[stage] += run.cost.scoring_s(scorers * tokens)


def _replay(run: _Run, led: _Ledger) -> None:
    """carry_kv replay: each live row's prompt and prefix re-prefilled under the new weights."""
    p, tokens = run.w.prompt_len, 0
    for g in run.groups:
        live = [s for s in g.samples if s.row]
        prompts = (1 if live or g.pending else 0) if run.refill.shared_prefill else len(live)
        tokens += p * prompts + sum(-(-s.made // REPLAY_CHUNK) * REPLAY_CHUNK for s in live)
    _prefill(run, led, tokens, "replay", run.cost.trained_scorers)


def _admit(run: _Run, led: _Ledger, step: int) -> None:
    """A refill point: free rows take waiting samples (due first), then new groups' samples."""
    w, r = run.w, run.refill
    free = r.rows(w) - sum(s.row for g in run.groups for s in g.samples)
    started, new_groups = 0, 0
    for g in sorted(run.groups, key=lambda g: (_due(run, g), g.gid)):
        for s in g.pending[: max(free, 0)]:
            s.row, free, started = True, free - 1, started + 1
    cap = (r.max_staleness + 1) * run.per_batch
    while free > 0 and len(run.groups) < cap:
        samples = [_Sample(run.source.next()) for _ in range(w.group_size)]
        for s in samples[:free]:
            s.row = True
        run.groups.append(_Group(run.next_gid, step, samples))
        run.next_gid += 1
        took = min(free, w.group_size)
        free, started, new_groups = free - took, started + took, new_groups + 1
    prompts = new_groups if r.shared_prefill else started
    led.prompt_tokens += w.prompt_len * prompts
    _prefill(run, led, w.prompt_len * prompts, "admit", run.cost.n_scorers)
    if r.shared_prefill and started and w.group_size > 1:  # each row copies the group's KV
        led.gen["admit"] += run.cost.copy_kv_s(w.prompt_len * started)


def _completion(g: _Group, t: int) -> int | float:
    """The position ``g`` completes at if every member runs on from ``t`` (inf: one waits)."""
    if g.done is not None:
        return g.done
    if g.pending:
        return np.inf
    return t + max((s.length - s.made for s in g.samples if s.row), default=0)


def _cut(run: _Run, t: int, end: int, step: int) -> int | None:
    """The first position in [t, end] where the batch can be taken, or None."""
    finish = [_completion(g, t) for g in run.groups]
    if len(finish) < run.per_batch:
        return None
    at = sorted(finish)[run.per_batch - 1]
    if run.refill.on_stale == "finish":
        due = [f for f, g in zip(finish, run.groups, strict=True) if _due(run, g) <= step]
        at = max([at, *due])
    return int(max(at, t)) if at <= end else None


def _decode(run: _Run, led: _Ledger, t: int, stop: int, step: int) -> None:
    """Decode positions [t, stop): every row runs until its sample ends."""
    cost, e, s_rows = run.cost, run.engine, run.refill.rows(run.w)
    live = [(g, s) for g in run.groups for s in g.samples if s.row]
    if not live or stop <= t:
        return
    left = np.array([s.length - s.made for _, s in live])
    ran = np.minimum(left, stop - t)
    ctx = np.array([run.w.prompt_len + s.made for _, s in live])
    steps = int(ran.max())
    reads = float((ran * ctx + ran * (ran - 1) / 2).sum())
    if e.ragged_decode and not e.token_proportional:
        reads += float(ran.sum()) * e.ragged_key_block / 2
    elif not e.token_proportional:  # every row reads the whole cache
        reads = float(steps * s_rows * (run.w.prompt_len + run.capacity))
    rows = float(ran.sum()) if e.token_proportional else float(steps * s_rows)
    led.gen["decode"] += cost.decode_s(steps, rows, reads)
    led.steps, led.real = led.steps + steps, led.real + int(ran.sum())
    if cost.n_scorers:
        led.last_score = cost.scoring_s(cost.n_scorers * float(ran.sum()))
        led.sco["score"] += led.last_score
    ended: dict[int, int] = {}  # group -> position of its last sample to end in the interval
    for (g, s), n in zip(live, ran.tolist(), strict=True):
        s.made += n
        s.versions[step] += n
        if s.made == s.length:
            s.row = False
            ended[g.gid] = max(ended.get(g.gid, t), t + n)
    for g, _ in live:  # a group completes with its last sample, whatever the rows' order
        if g.done is None and g.gid in ended and not any(x.made < x.length for x in g.samples):
            g.done = ended[g.gid]


def _take(run: _Run, step: int) -> tuple[list[_Group], int]:
    """The batch at the cut, and the groups dropped (due and not taken)."""
    complete = [g for g in run.groups if g.done is not None]
    complete.sort(key=lambda g: (_due(run, g), g.done, g.gid))
    batch = complete[: run.per_batch]
    taken = {g.gid for g in batch}
    dropped = [g for g in run.groups if g.gid not in taken and _due(run, g) <= step]
    gone = taken | {g.gid for g in dropped}
    run.groups = [g for g in run.groups if g.gid not in gone]
    for g in run.groups:  # complete ones wait with their scores
        g.done = -1 if g.done is not None else None
    return batch, len(dropped)


def _rollout(run: _Run, step: int) -> _Ledger:
    """Refill points and decode until the cut."""
    led, t, every = _Ledger(), 0, run.refill.every
    if step and run.refill.carry_kv == "replay":
        _replay(run, led)
    while True:
        cut = _cut(run, t, t, step)
        if cut is not None:
            return led
        _admit(run, led, step)
        end = t + every
        cut = _cut(run, t, end, step)
        stop = end if cut is None else cut
        if not any(s.row for g in run.groups for s in g.samples) and cut is None:
            raise RuntimeError("refill: no row runs and the batch cannot be taken")
        _decode(run, led, t, stop, step)
        if cut is not None:
            return led
        t = end


def _step(run: _Run, step: int) -> dict:
    """One step: the rollout, the batch, the update; a metrics-like record."""
    led = _rollout(run, step)
    batch, dropped = _take(run, step)
    lengths = np.array([s.length for g in batch for s in g.samples])
    w = run.w
    tokens, pairs = update_work(
        run.engine, w.prompt_len, run.capacity, lengths, w.update_groups, w.group_size
    )
    gen, sco = sum(led.gen.values()), sum(led.sco.values())
    if w.placement == "disaggregated":
        rollout = max(gen, sco - led.last_score) + led.last_score
    else:
        rollout = gen + sco
    update = run.cost.update_s(tokens, pairs)
    stale = Counter()
    for g in batch:
        for s in g.samples:
            for v, n in s.versions.items():
                stale[step - v] += n
    rows = run.refill.rows(w)
    return {
        "step_time_s": rollout + update + run.cost.copy_s,
        "stage_time_s": {
            **led.gen,
            **{f"{k} (scorers)": v for k, v in led.sco.items()},
            "update": update,
            "copy": run.cost.copy_s,
        },  # fmt: skip
        "decode_steps": led.steps,
        "decode_efficiency": led.real / max(led.steps * rows, 1),
        "decode_tokens": led.real,
        "decode_row_steps": led.steps * rows,
        "staleness": dict(sorted(stale.items())),
        "dropped_groups": dropped,
        "admitted_prompt_tokens": led.prompt_tokens,
        "in_flight_groups": len(run.groups),
        "admitted_groups": run.next_gid,  # since the run began
        "response_len_mean": float(lengths.mean()),
        "batch_size": int(lengths.size),
    }


def simulate_refill(
    cost: CostModel, workload: Workload, lengths, engine: Engine, refill: Refill = Refill()
) -> list[dict]:
    """``workload.steps`` refilling steps priced by ``cost`` on ``engine``: a record each
    (step time, stage times, decode efficiency, the batch's tokens per staleness, drops)."""
    workload.check()
    refill.check(workload)
    source = LengthSource(lengths, workload.seed)
    capacity = int(workload.capacity or source.lengths.max())
    run = _Run(cost, engine, workload, refill, capacity, source)
    return [{"step": k, **_step(run, k)} for k in range(workload.steps)]


def summary(records: list[dict], skip: int = 0) -> dict:
    """Mean step time and stages, decode efficiency, the staleness histogram (token
    fractions), drops, after the first ``skip`` steps (a run starts with no group in flight:
    its first batches are the short groups, its long ones still decoding)."""
    records = records[skip:] if len(records) > 2 * skip else records
    stale = Counter()
    for r in records:
        stale.update({int(k): v for k, v in r["staleness"].items()})
    total = max(sum(stale.values()), 1)
    stages = Counter()
    for r in records:
        stages.update(r["stage_time_s"])
    n = len(records)
    return {
        "step_time_mean_s": float(np.mean([r["step_time_s"] for r in records])),
        "stage_time_mean_s": {k: v / n for k, v in stages.items()},
        # tokens decoded over rows × decode steps, over the whole run
        "decode_efficiency": sum(r["decode_tokens"] for r in records)
        / max(sum(r["decode_row_steps"] for r in records), 1),
        "staleness": {k: stale[k] / total for k in sorted(stale)},
        "dropped_groups": int(sum(r["dropped_groups"] for r in records)),
    }
