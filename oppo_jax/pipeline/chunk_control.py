"""Chunk-size control: fixed, or tuned online by measured step time (the paper's rule).

Every ``every`` steps a tuning round tries each candidate size for one step, then keeps the
fastest until the next round. The chunk size changes timing only, never results (the sampled
tokens and scores do not depend on it), so tuning cannot perturb training.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ChunkSizeController:
    """Chooses the chunk size of each step; its state is plain JSON for checkpoints."""

    current: int  # C used outside tuning rounds, tokens
    candidates: tuple[int, ...] = ()  # sizes a tuning round tries, tokens
    every: int = 50  # steps between the starts of two tuning rounds
    tuning: bool = False  # False: always use ``current``
    trials: dict[str, float] = dataclasses.field(default_factory=dict)  # size -> step seconds

    def size_for(self, step: int) -> int:
        """The chunk size step ``step`` should use."""
        if not self.tuning or not self.candidates:
            return self.current
        offset = step % self.every
        if offset < len(self.candidates):
            return self.candidates[offset]
        return self.current

    def observe(self, step: int, chunk_size: int, step_time_s: float) -> None:
        """Record a step's time; at the end of a round, keep the fastest candidate."""
        if not self.tuning or not self.candidates:
            return
        offset = step % self.every
        if offset >= len(self.candidates):
            return
        self.trials[str(chunk_size)] = step_time_s
        if offset == len(self.candidates) - 1:
            self.current = int(min(self.trials, key=self.trials.get))
            self.trials = {}

    def state(self) -> dict:
        return {"current": self.current, "trials": dict(self.trials)}

    def restore(self, state: dict) -> None:
        self.current, self.trials = int(state["current"]), dict(state["trials"])
