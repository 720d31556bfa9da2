"""Δ, the overcommitment: fixed, or adapted to training progress (the paper's rule).

With R_t the mean reward of step t and w the window,
    s_t = (1/w) Σ_{i=t-w+1..t} (R_i − R_{i−1})
if s_t > 0 (reward still rising) Δ ← min(Δ_max, Δ + δ), else Δ ← max(Δ_min, Δ − δ),
with δ = max(1, ⌊Δ/4⌋). Deterministic given the rewards, so a resumed run agrees exactly.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class OvercommitController:
    """Chooses Δ for each step; its state is plain JSON for checkpoints."""

    delta: int  # Δ for the next step, sequences
    minimum: int = 0  # Δ_min
    maximum: int = 8  # Δ_max
    window: int = 3  # w, steps in the reward trend
    adaptive: bool = False  # False: Δ stays fixed
    rewards: list[float] = dataclasses.field(default_factory=list)  # last w + 1 mean rewards

    @property
    def slots_needed(self) -> int:
        """Extra slots to allocate so every Δ this controller can choose fits one shape."""
        return self.maximum if self.adaptive else self.delta

    def observe(self, mean_reward: float) -> None:
        """Record a step's mean reward and move Δ by the trend of the last ``window`` steps."""
        if not self.adaptive:
            return
        self.rewards = (self.rewards + [float(mean_reward)])[-(self.window + 1) :]
        if len(self.rewards) < self.window + 1:
            return
        trend = (self.rewards[-1] - self.rewards[0]) / self.window  # mean of the differences
        step = max(1, self.delta // 4)
        if trend > 0:
            self.delta = min(self.maximum, self.delta + step)
        else:
            self.delta = max(self.minimum, self.delta - step)

    def state(self) -> dict:
        return {"delta": self.delta, "rewards": list(self.rewards)}

    def restore(self, state: dict) -> None:
        self.delta, self.rewards = int(state["delta"]), [float(r) for r in state["rewards"]]
