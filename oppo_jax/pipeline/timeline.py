"""When each stage ran on which device group, measured without host syncs in the hot loop.

The main thread only notes the dispatch time of a stage and hands a small array that the stage
produces (a "marker") to a watcher thread for the stage's device group. The watcher blocks on
the marker and notes when it became ready. A device group runs its work in dispatch order, so
a stage starts when it was dispatched or when the group's previous stage finished, whichever
is later. Busy fraction = Σ stage durations / step wall time, per group.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import jax

from oppo_jax.pipeline.events import Event, busy_fraction, stage_times

__all__ = ["Event", "Timeline", "TraceWriter", "busy_fraction", "stage_times"]


class Timeline:
    """Per-step stage timings from watcher threads (one per device group)."""

    def __init__(self):
        self._queues: dict[str, queue.Queue] = {}
        self._done: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def begin_step(self) -> None:
        """Start a new step: times are measured from now."""
        self.flush()
        with self._lock:
            self._done = []
        self._t0 = time.perf_counter()

    def track(self, stage: str, group: str, marker) -> None:
        """Note that ``stage`` was dispatched to ``group``; ``marker`` completes with it."""
        if group not in self._queues:
            self._queues[group] = queue.Queue()
            threading.Thread(target=self._watch, args=(group,), daemon=True).start()
        self._queues[group].put((stage, time.perf_counter(), marker))

    def _watch(self, group: str) -> None:
        q = self._queues[group]
        while True:
            stage, dispatched, marker = q.get()
            jax.block_until_ready(marker)
            with self._lock:
                self._done.append((stage, group, dispatched, time.perf_counter()))
            q.task_done()

    def flush(self) -> None:
        """Wait until every tracked stage has completed."""
        for q in list(self._queues.values()):
            q.join()

    def end_step(self) -> tuple[list[Event], float]:
        """The step's events (with inferred start times) and its wall time."""
        self.flush()
        wall = time.perf_counter() - self._t0
        events, free_at = [], {}
        with self._lock:
            done = sorted(self._done, key=lambda e: (e[1], e[2]))
        for stage, group, dispatched, finished in done:
            start = max(dispatched, free_at.get(group, self._t0))
            events.append(Event(stage, group, start - self._t0, finished - self._t0))
            free_at[group] = finished
        return events, wall


class TraceWriter:
    """Accumulates steps' events into one Chrome/Perfetto trace file (``chrome://tracing``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._events: list[dict] = []
        self._offset = 0.0
        self._groups: dict[str, int] = {}

    def add_step(self, step: int, events: list[Event], wall: float) -> None:
        for e in events:
            pid = self._groups.setdefault(e.group, len(self._groups))
            self._events.append(
                {
                    "name": e.stage,
                    "cat": f"step {step}",
                    "ph": "X",
                    "pid": pid,
                    "tid": 0,
                    "ts": (self._offset + e.start) * 1e6,
                    "dur": max(e.end - e.start, 0.0) * 1e6,
                    "args": {"step": step},
                }
            )
        self._offset += wall

    def write(self) -> None:
        names = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": group}}
            for group, pid in self._groups.items()
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": names + self._events}))
        tmp.replace(self.path)
