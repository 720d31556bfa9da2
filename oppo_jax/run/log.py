"""A run's directory: the checks that keep it to one run, and where its step metrics go
(metrics.jsonl, TensorBoard events and the progress bar)."""

from __future__ import annotations

import functools
import json
import math
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from oppo_jax.base.errors import InputError
from oppo_jax.config import Config, to_dict
from oppo_jax.config.load import migrate_flat

# Shown in the progress bar, in this order.
_BAR_KEYS = ("reward", "gold", "kl", "response_len_mean", "step_time_s")
_QUEUED = 8  # records handed to the writer thread and not yet written, at most


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
    """Appends one JSON object per step and mirrors the numbers to TensorBoard and a bar.

    The caller's thread only copies a record, or hands over the function that builds it; a
    writer thread builds it, and does the JSON, TensorBoard (each step's scalars in one event),
    the bar and the I/O, in order, off the step's critical path (7-13 ms a step on the tiny
    GRPO run: BENCHMARKS.md, "Host work between steps"). ``close`` (in the training loop's
    ``finally``: the end, a preemption, a crash alike) writes every record handed over before
    it returns; a write that failed is raised by the next ``write`` or by ``close``.
    ``background=False`` writes on the caller's thread (the benchmark's "before").
    """

    def __init__(
        self,
        out_dir: Path,
        total_steps: int,
        start_step: int,
        progress: bool = True,
        background: bool = True,
    ):
        self.path = out_dir / "metrics.jsonl"
        self._truncate_after(start_step)
        self._file = self.path.open("a")
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        except ImportError:  # optional: the run does not depend on it
            self._tb = None
        # smoothing=0: the ETA is the mean pace since the start, which ``write`` moves forward
        # by each step's compile time, so a step that compiled does not inflate it
        self._bar = tqdm(
            total=total_steps, initial=start_step, disable=not progress, unit="step", smoothing=0
        )
        self._error: BaseException | None = None
        # bounded: a writer that falls behind holds the loop back, not the steps' results
        self._queue: queue.Queue | None = queue.Queue(_QUEUED) if background else None
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._drain, name="RunLog", daemon=True)
            self._thread.start()

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

    def write(self, record: dict | Callable[[], dict]) -> None:
        """Record one step (``record["step"]`` is required), as it is now: a later change to
        ``record`` changes nothing written. ``record`` may be a function that builds it (the
        loop's ``PendingRecord``): the writer thread calls it, in turn."""
        if self._error is not None:
            raise self._error
        entry = record if callable(record) else _copy(record)
        if self._queue is None:
            self._emit(entry)
        else:
            self._queue.put(entry)

    def flush(self) -> None:
        """Wait until every record handed to ``write`` is written."""
        if self._queue is not None:
            self._queue.join()
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        """The writer thread: entries in order until the ``None`` that ``close`` sends."""
        while (entry := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._emit(entry)
            except BaseException as e:  # kept for the caller's thread to raise
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _emit(self, entry: dict | Callable[[], dict]) -> None:
        """Write one record: its line, its TensorBoard scalars, the bar."""
        record = entry() if callable(entry) else entry
        line, step, scalars, shown, compile_time_s = _snapshot(record)
        self._file.write(line + "\n")
        self._file.flush()
        if self._tb is not None:  # the step's scalars in one event: 53 add_scalar calls took 3 ms
            self._tb.file_writer.add_summary(_summary(scalars), step)
        self._bar.set_postfix(shown, refresh=False)
        if compile_time_s and hasattr(self._bar, "start_t"):
            self._bar.start_t += compile_time_s  # ETAs exclude compile time
        self._bar.update(1)

    def close(self) -> None:
        """Write what is still queued, then close the file, TensorBoard and the bar."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._error is not None:
            raise self._error


@functools.cache
def _tag(name: str) -> str:
    """``name`` as ``add_scalar`` writes it (tensorboardX's cleaning: no spaces, ...), found
    once per name: the run's tags are the same each step."""
    from tensorboardX.summary import scalar

    return scalar(name, 0.0).value[0].tag


def _summary(scalars: list[tuple[str, float]]):
    """One TensorBoard summary holding each (tag, value) as ``add_scalar`` writes it (the
    same cleaned tag, the value stored as the proto's float32), built directly: through
    tensorboardX's ``scalar`` (a NaN check and a numpy array per value) it took 0.25 ms."""
    from tensorboardX.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=_tag(t), simple_value=v) for t, v in scalars])


def _copy(record: dict) -> dict:
    """``record`` with its nested dicts copied (its values are numbers, strings, None)."""
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in record.items()}


def _snapshot(record: dict) -> tuple:
    """What ``RunLog`` writes of ``record``: (metrics.jsonl line, step, TensorBoard scalars,
    the bar's fields, compile seconds). NaN/Inf (a skipped update's losses) become null in
    the line, so metrics.jsonl stays strict JSON, and are left out of TensorBoard."""
    line = json.dumps(_finite_or_null(record), sort_keys=True, allow_nan=False)
    scalars = [
        (tag, value) for tag, value in _scalars(record) if tag != "step" and math.isfinite(value)
    ]
    shown = {k: record[k] for k in _BAR_KEYS if isinstance(record.get(k), int | float)}
    if record.get("update_skipped"):
        shown["skipped"] = record.get("nonfinite_total", 1)
    shown = {k: f"{v:.3g}" for k, v in shown.items()}
    return line, record["step"], scalars, shown, record.get("compile_time_s")


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# What a run writes into its directory; --overwrite clears only directories holding no more.
RUN_ENTRIES = frozenset(
    {
        "config.yaml",
        "metrics.jsonl",
        "metrics.tmp",
        "trace.json",
        "checkpoints",
        "tensorboard",
        "processes",
        "plots",
        "warmup.json",
    }
)
# Keys a resumed run may change: none alters the steps already taken.
RESUMABLE_KEYS = frozenset(
    {
        "train.steps",
        "train.checkpoint_every",
        "train.max_to_keep",
        "train.log_every",
        "train.max_nonfinite_in_a_row",
    }
)


def _flat(tree: dict, prefix: str = "") -> dict:
    """Dotted keys of a nested dict: {"a": {"b": 1}} -> {"a.b": 1}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# What a LoRA run did before these keys existed, where their default now does otherwise.
_LORA_BEFORE_THE_KEY = {"model.lora_train_head": False, "optim.lora_lr_scale": 1.0}


def config_differences(stored_yaml: str, cfg: Config) -> list[str]:
    """Dotted keys whose value in ``stored_yaml`` (a run's config.yaml) differs from ``cfg``,
    leaving out the ``RESUMABLE_KEYS``. A key the stored file lacks (one added to the config
    after the run started) differs only where ``cfg`` moves it off its default: a new key's
    default keeps what the run did before it existed, but for the LoRA keys whose default
    changed what LoRA does (``_LORA_BEFORE_THE_KEY``: a LoRA run resumes with them set so).
    A key renamed since (``config.load.RENAMED``) is compared under its new name."""
    stored = migrate_flat(_flat(yaml.safe_load(stored_yaml) or {}))
    current = _flat(to_dict(cfg))
    if stored.get("model.lora_rank"):
        for key, value in _LORA_BEFORE_THE_KEY.items():
            stored.setdefault(key, value)
    defaults = _flat(to_dict(Config()))
    for key in current.keys() - stored.keys():
        if key in defaults:
            stored[key] = defaults[key]
    keys = sorted((stored.keys() | current.keys()) - RESUMABLE_KEYS)
    return [k for k in keys if stored.get(k, "<missing>") != current.get(k, "<missing>")]


def check_run_dir(out: str | Path, cfg: Config, resume: bool, overwrite: bool) -> None:
    """Refuse a run directory that would mix two runs; reads only, so nothing changes.

    A non-empty ``out`` needs ``resume`` (its config.yaml must match ``cfg`` but for
    ``RESUMABLE_KEYS``, and it must hold a checkpoint) or ``overwrite`` (it must hold only
    run files); ``resume`` needs a non-empty ``out``. Raises ``InputError`` naming ``out``.
    """
    out = Path(out)
    if resume and overwrite:
        raise InputError(
            "--resume and --overwrite exclude each other: continue a run or replace it"
        )
    if out.exists() and not out.is_dir():
        raise InputError(f"run directory {out} is a file")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if resume:
        _check_resumable(out, entries, cfg)
    elif overwrite:
        foreign = [e for e in entries if e not in RUN_ENTRIES]
        if foreign:
            raise InputError(
                f"--overwrite: {out} holds files no run writes ({', '.join(foreign[:5])}); "
                "not clearing it, choose another --out"
            )
    elif entries:
        raise InputError(
            f"run directory {out} is not empty (holds {', '.join(entries[:5])}); pass --resume "
            "to continue that run, --overwrite to replace it, or choose another --out"
        )


def _check_resumable(out: Path, entries: list[str], cfg: Config) -> None:
    if not entries:
        raise InputError(f"--resume: run directory {out} is missing or empty; nothing to resume")
    stored = out / "config.yaml"
    if not stored.is_file():
        raise InputError(f"--resume: {out} holds no config.yaml, so it is not a run directory")
    differ = config_differences(stored.read_text(), cfg)
    if differ:
        raise InputError(
            f"--resume: the config differs from {stored} in {', '.join(differ)}; resume with "
            "the same config, or start a new run with another --out"
        )
    ckpts = out / "checkpoints"
    if not (ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())):
        raise InputError(
            f"--resume: {out} holds no checkpoint to continue from; --overwrite starts it again"
        )


def clear_run_dir(out: str | Path) -> None:
    """Delete what a run wrote into ``out`` (after ``check_run_dir`` with ``overwrite``)."""
    out = Path(out)
    if not out.exists():
        return
    for entry in out.iterdir():
        if entry.name in RUN_ENTRIES:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def has_checkpoint(ckpt_dir: Path) -> bool:
    """Whether ``ckpt_dir`` holds a saved step (a directory named by its number)."""
    return ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())


def leave_as_found(out: Path, ckpt_dir: Path, existed: bool) -> None:
    """Undo what a run that stopped before step 0, with no checkpoint, wrote: its run files in
    ``out`` and ``ckpt_dir`` (a checkpoint never: one there is left with its directory), and
    ``out`` itself when it did not exist before. The command that started it starts it again,
    without ``--overwrite``."""
    if not has_checkpoint(ckpt_dir):
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    for name in RUN_ENTRIES - {"checkpoints"}:
        entry = out / name
        if entry.is_dir():
            shutil.rmtree(entry)
        elif entry.exists():
            entry.unlink()
    if not existed and out.is_dir() and not any(out.iterdir()):
        out.rmdir()
