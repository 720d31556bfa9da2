"""The four schedules: which of OPPO's two overlaps a run uses.

Two switches make them: ``stream`` (intra-step overlap: the scorers prefill each chunk the actor
decodes, instead of whole responses after generation) and ``carry`` (inter-step overlap: B + Δ
sequences start, the first B finished train, the rest are carried into the next step).
``sync`` is TRL's pipeline; ``oppo`` is both. Training, the benchmark and the simulator all use
this one table.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One combination of the two overlaps."""

    stream: bool  # scorers consume the actor's chunks as they are decoded
    carry: bool  # B + Δ slots; stragglers are carried with their work kept

    @property
    def name(self) -> str:
        return next(n for n, s in SCHEDULES.items() if s == self)

    @classmethod
    def named(cls, name: str) -> Schedule:
        """The schedule called ``name`` (sync | intra | inter | oppo)."""
        if name not in SCHEDULES:
            raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
        return SCHEDULES[name]


SCHEDULES: dict[str, Schedule] = {
    "sync": Schedule(stream=False, carry=False),
    "intra": Schedule(stream=True, carry=False),
    "inter": Schedule(stream=False, carry=True),
    "oppo": Schedule(stream=True, carry=True),
}
