"""Continuous refill on the host (issue 44): which samples take which decode rows at each refill
point, when the rollout may be cut, and which groups the batch takes.

The policy is the simulator's (``oppo_tools.sim.refill``), so its projections carry over and
its decisions are this module's oracle. S decode rows; a refill point every ``every`` decode
positions. At a refill point:

1. rows whose sample finished are harvested (their outputs leave to the host) and are free;
2. free rows take the waiting samples of admitted groups, the soonest-due group first (ties:
   admission order), then the G samples of new prompts' groups, each admitted whole, while
   fewer than (max_staleness + 1)·B/G groups are untrained (samples that find no row wait);
3. the rollout may be cut at the first position where B/G groups are complete (a group with
   its last sample) and, with ``on_stale`` finish, every group due this step is complete; the
   device stops there (``cut_rule``), inside the interval.

A group admitted in step v is due in step v + max_staleness. The batch at the cut: complete
groups by (due step, completion position, admission order), B/G of them. Groups left over
stay in the pool, in their rows; due ones the batch has no room for are dropped (counted).

Every decision is a function of the finish positions the device reports, the step and the
admission order: never of time. Nothing here touches a device (``pipeline.refill_loop``
dispatches), so its invariants are property-tested directly.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oppo_jax.base.shapes import refill_store_rows as store_rows

ON_STALE = ("finish", "drop")


@dataclasses.dataclass
class Sample:
    """One of a group's G samples: where it decodes, and its response so far."""

    index: int  # its sample index (its sampling keys' index)
    row: int | None = None  # the decode row it holds while it decodes
    finished_at: int | None = None  # position it finished at (its step's clock), once it has
    tokens: list[int] = dataclasses.field(default_factory=list)  # response so far
    behaviour: list[float] = dataclasses.field(default_factory=list)  # log-prob when sampled
    versions: list[int] = dataclasses.field(default_factory=list)  # step that sampled each token
    # this step's log-prob of each token (PPO's old log-probs) when ``scored_at`` is the step
    # training it: read from its row, where a replay computed the older tokens' too
    old: list[float] = dataclasses.field(default_factory=list)
    scored_at: int = -1  # the step whose weights computed ``old``

    @property
    def waiting(self) -> bool:
        return self.row is None and self.finished_at is None

    def read(self, step: int, tokens, logprobs, replayed: bool) -> None:
        """Its row's response (``tokens``, ``logprobs``: this step's arrays over its length)
        in step ``step``: the tokens past the last read were sampled in it, with those
        log-probs; ``replayed``: the row's earlier log-probs are this step's too."""
        n, seen = len(tokens), len(self.versions)
        self.tokens = [int(t) for t in tokens]
        self.behaviour += [float(x) for x in logprobs[seen:n]]
        self.versions += [step] * (n - seen)
        if replayed or seen == 0:
            self.old, self.scored_at = [float(x) for x in logprobs[:n]], step


@dataclasses.dataclass
class Group:
    """A prompt's G samples, admitted whole."""

    gid: int  # admission order, over the whole run
    prompt_id: int
    prompt: list[int]
    version: int  # the step that admitted it (its tokens' policy version)
    samples: list[Sample]
    completed_at: int | None = None  # position of its last sample's finish; -1: an earlier step

    @property
    def complete(self) -> bool:
        return all(s.finished_at is not None for s in self.samples)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)  # the samples too, as dicts

    @classmethod
    def from_json(cls, state: dict) -> Group:
        return cls(**{**state, "samples": [Sample(**s) for s in state["samples"]]})


@dataclasses.dataclass(frozen=True)
class Placement:
    """A sample taking a row at a refill point."""

    row: int
    gid: int
    sample_index: int


@dataclasses.dataclass(frozen=True)
class RefillRule:
    """The run's refill settings (static)."""

    rows: int  # S, decode rows
    every: int  # decode positions between refill points (``rollout.refill_every``)
    batch_groups: int  # B/G, groups each update takes
    group_size: int  # G
    max_staleness: int  # versions a trained token may lag its update
    on_stale: str = "finish"  # a due group: the cut waits for it (finish) or it is dropped

    def __post_init__(self):
        if self.rows < self.group_size or self.every < 1 or self.max_staleness < 0:
            raise ValueError(f"refill: need S >= G, every >= 1, max_staleness >= 0: {self}")
        if self.on_stale not in ON_STALE:
            raise ValueError(f"refill: on_stale {self.on_stale!r} not in {ON_STALE}")

    @property
    def store_rows(self) -> int:
        """Groups whose prompts one refill point prefills, at most, as a power of two (the
        prompt store's one shape): the one group that can wait with samples unplaced (a new
        group is admitted only while rows are free, so only the last one admitted can wait),
        and a group per G free rows, rounded up."""
        return store_rows(self.rows, self.group_size)

    @property
    def max_untrained(self) -> int:
        """Groups admitted and not yet trained, at most: the steps up to a new group's due
        step train no more."""
        return (self.max_staleness + 1) * self.batch_groups


@dataclasses.dataclass
class Pool:
    """The untrained groups of a refilling run, in admission order, and which row each decoding
    sample holds. Lives across steps: groups in flight at a cut decode on into the next."""

    rule: RefillRule
    groups: list[Group] = dataclasses.field(default_factory=list)
    next_gid: int = 0

    def due(self, group: Group) -> int:
        return group.version + self.rule.max_staleness

    def holder(self) -> dict[int, tuple[Group, Sample]]:
        """row -> (group, sample) decoding in it."""
        return {s.row: (g, s) for g in self.groups for s in g.samples if s.row is not None}

    def free_rows(self) -> list[int]:
        held = self.holder()
        return [r for r in range(self.rule.rows) if r not in held]

    def harvest(self, row: int, finished_at: int) -> None:
        """The sample in ``row`` finished at position ``finished_at`` (its response read
        already, ``Sample.read``): it leaves the row, which is free."""
        group, sample = self.holder()[row]
        sample.row, sample.finished_at = None, finished_at
        if group.complete and group.completed_at is None:
            group.completed_at = max(s.finished_at for s in group.samples)

    def refill(self, step: int, prompts) -> tuple[list[Placement], list[Group]]:
        """A refill point's decisions: (placements in row order, the groups admitted here,
        whose prompts are still to prefill). ``prompts.take(k)`` -> [(prompt_id, tokens)]."""
        free = self.free_rows()
        placed: list[Placement] = []
        for g in sorted(self.groups, key=lambda g: (self.due(g), g.gid)):
            for s in [s for s in g.samples if s.waiting]:
                if len(placed) == len(free):
                    break
                s.row = free[len(placed)]
                placed.append(Placement(s.row, g.gid, s.index))
        new: list[Group] = []
        while len(placed) < len(free) and len(self.groups) < self.rule.max_untrained:
            taken = prompts.take(1)
            if not taken:
                break
            (prompt_id, tokens), *_ = taken
            samples = [Sample(i) for i in range(self.rule.group_size)]
            g = Group(self.next_gid, int(prompt_id), [int(t) for t in tokens], step, samples)
            self.next_gid += 1
            self.groups.append(g)
            new.append(g)
            for s in samples[: len(free) - len(placed)]:
                s.row = free[len(placed)]
                placed.append(Placement(s.row, g.gid, s.index))
        return sorted(placed, key=lambda p: p.row), new

    def cut_ready(self, step: int) -> bool:
        """Whether the batch can be taken now: B/G complete groups, and (finish) every due one."""
        complete = sum(g.complete for g in self.groups)
        if complete < self.rule.batch_groups:
            return False
        due = [g for g in self.groups if self.due(g) <= step]
        return self.rule.on_stale == "drop" or all(g.complete for g in due)

    def cut_rule(self, step: int) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """The device's stop rule for the next interval (``rollout.decode.CutRule`` fields as
        host arrays: active [S], must_finish [S], target, group [S]): it holds at the first
        position where ``cut_ready`` would. A group with a waiting sample cannot complete
        before the next refill point: its rows do not count, and if it is due (finish) the
        target is out of reach. Complete groups with no row held count off the target."""
        s = self.rule.rows
        active, must = np.zeros(s, bool), np.zeros(s, bool)
        group = np.zeros(s, np.int32)
        target = self.rule.batch_groups
        finish = self.rule.on_stale == "finish"
        for g in self.groups:
            rows = [x.row for x in g.samples if x.row is not None]
            is_due = finish and self.due(g) <= step
            if not rows:
                target -= int(g.complete)
                if is_due and not g.complete:
                    target = s + 1  # its waiting samples need a refill point first
                continue
            if any(x.waiting for x in g.samples):
                if is_due:
                    target = s + 1
                continue
            active[rows], group[rows], must[rows] = True, rows[0], is_due
        return active, must, max(target, 0), group

    def state(self) -> dict:
        """The pool as plain JSON (checkpoints): every untrained group, its samples' rows and
        responses so far."""
        return {"next_gid": self.next_gid, "groups": [g.to_json() for g in self.groups]}

    @classmethod
    def from_state(cls, rule: RefillRule, state: dict) -> Pool:
        groups = [Group.from_json(g) for g in state["groups"]]
        return cls(rule, groups, int(state["next_gid"]))

    def take_batch(self, step: int) -> tuple[list[Group], list[Group]]:
        """At the cut: (the batch's B/G groups in batch order, the due groups dropped). The
        groups left stay in the pool; complete ones wait with their outputs."""
        complete = [g for g in self.groups if g.complete]
        complete.sort(key=lambda g: (self.due(g), g.completed_at, g.gid))
        batch = complete[: self.rule.batch_groups]
        taken = {g.gid for g in batch}
        dropped = [g for g in self.groups if g.gid not in taken and self.due(g) <= step]
        for g in dropped:  # a dropped group's rows are free for the next step
            for s in g.samples:
                s.row = None
        gone = taken | {g.gid for g in dropped}
        self.groups = [g for g in self.groups if g.gid not in gone]
        for g in self.groups:  # complete ones wait, in order, before those of the next step
            if g.completed_at is not None:
                g.completed_at = -1
            for x in g.samples:
                if x.finished_at is not None:
                    x.finished_at = -1
        return batch, dropped
