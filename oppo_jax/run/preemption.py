"""Stopping a run cleanly on SIGTERM/SIGINT (preemptible TPU/GPU capacity, Ctrl-C).

The first signal only raises a flag; the training loop reads it between steps, saves a
checkpoint (carried sequences included) and exits with ``EXIT_PREEMPTED``. The step in
flight is finished, not abandoned: its prompts were already taken from the stream, so
finishing it is the only way to checkpoint a consistent state. A second signal stops at once
(``KeyboardInterrupt``); checkpoints already on disk are complete either way, because orbax
commits a step atomically. ``resume_command`` spells out the command that continues the run.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from collections.abc import Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """Context manager that turns the first stop signal into ``self.received`` (its name)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopOnSignal:
        # Python only delivers signals to the main thread; elsewhere (a notebook's worker
        # thread, a test runner's thread) the run simply keeps the default behaviour.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            raise KeyboardInterrupt(f"second stop signal ({name}): stopping without a checkpoint")
        self.received = name
        print(
            f"\noppo-jax: {name} received; finishing this step, then saving a checkpoint "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )


def resume_command(
    config: str | None, overrides: Sequence[str], out: str, options: Sequence[str] = ()
) -> str:
    """The command that continues a stopped run, shell-quoted, from what it was started with.

    Example: ``resume_command("demo_cpu", ["seed=1"], "runs/demo_cpu-20261206-101500")`` is
    ``oppo-jax train demo_cpu --set seed=1 --out runs/demo_cpu-20261206-101500 --resume``.
    ``options`` are further flags given to the first run (``--quiet``, ``--no-warmup``).
    """
    words = ["oppo-jax", "train"] + ([config] if config is not None else [])
    words += ["--set", *overrides] if overrides else []
    words += [*options, "--out", out, "--resume"]
    return shlex.join(words)
