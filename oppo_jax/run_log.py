"""Where a run's step metrics go: metrics.jsonl, TensorBoard events and the progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm.auto import tqdm

# Shown in the progress bar, in this order.
_BAR_KEYS = ("reward", "gold", "kl", "response_len_mean", "step_time_s")


def _scalars(record: dict, prefix: str = ""):
    """Flatten nested dicts of numbers into (tag, value) pairs for TensorBoard."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield f"{prefix}{key}", float(value)


def _finite_or_null(value):
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLog:
    """Appends one JSON object per step and mirrors the numbers to TensorBoard and a bar."""

    def __init__(self, out_dir: Path, total_steps: int, start_step: int, progress: bool = True):
        self.path = out_dir / "metrics.jsonl"
        self._truncate_after(start_step)
        self._file = self.path.open("a")
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        except ImportError:  # optional: the run does not depend on it
            self._tb = None
        self._bar = tqdm(total=total_steps, initial=start_step, disable=not progress, unit="step")

    def _truncate_after(self, step: int) -> None:
        """Keep only records of steps < ``step`` (a resume rewrites what came after)."""
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] < step
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def write(self, record: dict) -> None:
        """Record one step (``record["step"]`` is required)."""
        # NaN/Inf (a skipped update's losses) become null: metrics.jsonl stays strict JSON.
        line = json.dumps(_finite_or_null(record), sort_keys=True, allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()
        if self._tb is not None:
            for tag, value in _scalars(record):
                if tag != "step" and math.isfinite(value):
                    self._tb.add_scalar(tag, value, record["step"])
        shown = {k: record[k] for k in _BAR_KEYS if isinstance(record.get(k), int | float)}
        if record.get("update_skipped"):
            shown["skipped"] = record.get("nonfinite_total", 1)
        self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
