"""Response-length distributions for the simulator: the demo's mixture, log-normal long tails,
a bench's measured batches, or a file."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

Z99 = 2.3263478740408408  # 99th percentile of the standard normal


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """Log-normal response lengths, rounded and clipped to [1, cap] tokens."""

    median: int | float  # tokens
    sigma: float = 0.94  # σ of the log; 0.94 puts p99 at 8.9 × the median
    cap: int = 1024  # R, the response capacity: longer responses end here

    @classmethod
    def from_p99(cls, median: int | float, p99: int | float, cap: int) -> LogNormal:
        """The distribution with this median and 99th percentile (as ``rollout.length_p99``)."""
        return cls(median, math.log(p99 / median) / Z99, cap)

    def sample(self, n: int = 10_000, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        draws = np.round(rng.lognormal(math.log(self.median), self.sigma, n))
        return np.clip(draws, 1, self.cap).astype(np.int64)

    def describe(self) -> str:
        p99 = min(self.median * math.exp(Z99 * self.sigma), self.cap)
        return (
            f"log-normal, median {self.median:g}, σ {self.sigma:.2f} (p99 ≈ {p99:.0f}), "
            f"capped at {self.cap}"
        )


# The projections' default: median 103 and σ 0.94 (p99 ≈ 920), capped at 1024 tokens.
LONGTAIL = LogNormal(103.0, 0.94, 1024)


def demo_lengths(n: int = 10_000, seed: int = 0, cap: int = 64) -> np.ndarray:
    """Response lengths like the demo task's: 85% geometric(0.12), 15% geometric(0.05), ≤ cap."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.15
    words = np.minimum(rng.geometric(np.where(long, 0.05, 0.12)), cap - 1)
    return words + 1  # the closing <eos> is a token too


def longtail_lengths(n: int = 10_000, seed: int = 0, cap: int = 1024) -> np.ndarray:
    """Log-normal response lengths, median 103 and σ 0.94 (p99 ≈ 920), capped at ``cap``."""
    return dataclasses.replace(LONGTAIL, cap=cap).sample(n, seed)


def read_lengths(spec: str, seed: int = 0, records: list[dict] | None = None) -> np.ndarray:
    """``demo``, ``longtail``, ``bench`` (the response lengths of ``records``' batches, in
    order) or a file of response lengths (a JSON list, or numbers separated by spaces, commas
    or newlines)."""
    if spec == "demo":
        return demo_lengths(seed=seed)
    if spec == "longtail":
        return longtail_lengths(seed=seed)
    if spec == "bench":
        if records is None:
            raise ValueError("--lengths bench needs --bench")
        return np.asarray([n for r in records for n in r.get("trace", {}).get("lengths", [])])
    text = Path(spec).read_text()
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        values = text.replace(",", " ").split()
    return np.asarray([int(v) for v in values], np.int64)


def describe(lengths: np.ndarray) -> str:
    """n, mean, median, p99 and max of measured or drawn lengths."""
    return (
        f"n={lengths.size} mean={lengths.mean():.1f} median={np.median(lengths):g} "
        f"p99={np.percentile(lengths, 99):g} max={lengths.max()}"
    )
