"""The event engine: stages on device groups, run in dispatch order, sharing one machine.

Each group runs its stages one at a time, in the order they were added (dispatch order). A
stage starts once its group is free and it is ready: ``ready = max(at, end(dep) + offset)``
over its dependencies, which may be stages of the other group (score chunk k waits for
decode chunk k) or host delays after one (the host dispatches the build only after it read
the last chunk). A stage may also ``need`` others: it holds its group from its start but
does its work only once they ended (the build, dispatched before the scores it gathers are
in; a timeline counts that wait in the stage, as ``oppo_jax.pipeline.timeline`` does).
While both groups work, each progresses at its ``overlap_rate`` (1: separate hardware;
below 1: the groups share cores, as two fake devices on one CPU do).
"""

from __future__ import annotations

import dataclasses
import math

from oppo_jax.pipeline.events import Event


@dataclasses.dataclass
class Stage:
    """A unit of work: ``work`` seconds when it has its group to itself."""

    name: str
    group: str
    work: float
    deps: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (stage, offset s)
    at: float = 0.0  # not before this time (a host dispatch), seconds since the step began
    needs: list[int] = dataclasses.field(default_factory=list)  # works only once these ended


class Plan:
    """A step's stages in dispatch order; ``add`` returns the index later stages depend on."""

    def __init__(self):
        self.stages: list[Stage] = []

    def add(self, name: str, group: str, work: float, deps=(), at: float = 0.0, needs=()) -> int:
        self.stages.append(Stage(name, group, max(float(work), 0.0), list(deps), at, list(needs)))
        return len(self.stages) - 1

    def run(self, overlap_rate: dict[str, float] | None = None) -> list[Event]:
        """Execute the plan; ``overlap_rate[group]`` is that group's speed while both run."""
        return _run(self.stages, overlap_rate or {})


def _ready(stage: Stage, end: list[float | None]) -> float | None:
    """When ``stage`` may start, or None while a dependency has not finished."""
    times = [stage.at]
    for dep, offset in stage.deps:
        if end[dep] is None:
            return None
        times.append(end[dep] + offset)
    return max(times)


def _run(stages: list[Stage], rates: dict[str, float]) -> list[Event]:
    queues: dict[str, list[int]] = {}
    for i, s in enumerate(stages):
        queues.setdefault(s.group, []).append(i)
    head = dict.fromkeys(queues, 0)
    start: list[float | None] = [None] * len(stages)
    end: list[float | None] = [None] * len(stages)
    left = [s.work for s in stages]
    now = 0.0
    while any(head[g] < len(q) for g, q in queues.items()):
        running, wake = {}, math.inf
        for g, q in queues.items():
            if head[g] < len(q):
                i = q[head[g]]
                ready = _ready(stages[i], end)
                if ready is not None and ready <= now:
                    start[i] = now if start[i] is None else start[i]
                    if all(end[j] is not None for j in stages[i].needs):
                        running[g] = i
                elif ready is not None:
                    wake = min(wake, ready)
        if not running:
            if math.isinf(wake):
                raise RuntimeError("the plan deadlocks: a stage waits on one queued after it")
            now = wake
            continue
        speed = {g: rates.get(g, 1.0) if len(running) > 1 else 1.0 for g in running}
        done_at = min(now + left[i] / speed[g] for g, i in running.items())
        step_end = min(done_at, wake)
        for g, i in running.items():
            left[i] = (
                0.0
                if now + left[i] / speed[g] <= step_end
                else left[i] - (step_end - now) * speed[g]
            )
            if left[i] == 0.0:
                end[i] = step_end
                head[g] += 1
        now = step_end
    return [Event(s.name, s.group, start[i], end[i]) for i, s in enumerate(stages)]
