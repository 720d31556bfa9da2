"""A step's timeline as data: stages on device groups, and the sums read from them.

Plain Python (no JAX), shared by the measured timeline (``pipeline.timeline``) and the
simulator (``oppo_tools.sim``), so both describe and sum a step the same way.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Event:
    """One stage on one device group, in seconds since the step began."""

    stage: str
    group: str
    start: float
    end: float


def busy_fraction(events: list[Event], wall: float) -> dict[str, float]:
    """Fraction of the step's wall time each device group spent running stages."""
    busy: dict[str, float] = {}
    for e in events:
        busy[e.group] = busy.get(e.group, 0.0) + max(e.end - e.start, 0.0)
    return {group: min(t / wall, 1.0) if wall > 0 else 0.0 for group, t in busy.items()}


def stage_times(events: list[Event]) -> dict[str, float]:
    """Total seconds per stage name (a stage can run many times, e.g. once per chunk)."""
    totals: dict[str, float] = {}
    for e in events:
        totals[e.stage] = totals.get(e.stage, 0.0) + max(e.end - e.start, 0.0)
    return totals
