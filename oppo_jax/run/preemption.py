"""Stopping a run cleanly on SIGTERM/SIGINT (preemptible TPU/GPU capacity, Ctrl-C).

The first signal only raises a flag; the training loop reads it between steps, saves a
checkpoint (carried sequences included) and exits with ``EXIT_PREEMPTED``. The step in
flight is finished, not abandoned: its prompts were already taken from the stream, so
finishing it is the only way to checkpoint a consistent state. A second signal stops at once
(``KeyboardInterrupt``); checkpoints already on disk are complete either way, because orbax
commits a step atomically. Before step 0 there is no step to finish and nothing to save, so
while ``StopOnSignal.before_start`` names what the run is doing, the first signal stops it at
once (``Interrupted``); the caller then leaves the run directory as a rerun accepts.
``resume_command`` spells out the command that continues the run,
with the program as it was invoked (``invoked_program``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from oppo_jax.base.errors import Interrupted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """Context manager that turns the first stop signal into ``self.received`` (its name), or,
    while ``before_start`` names what the run does before step 0, into ``Interrupted``."""

    def __init__(
        self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS, before_start: str | None = None
    ):
        self.signals = signals
        self.received: str | None = None
        self.before_start = before_start  # e.g. "the warm-up"; None from step 0 on
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
        if self.before_start is not None:
            during, self.before_start = self.before_start, None  # a second signal: at once
            self.received = name
            raise Interrupted(name, during)
        if self.received is not None:
            raise KeyboardInterrupt(f"second stop signal ({name}): stopping without a checkpoint")
        self.received = name
        print(
            f"\noppo-jax: {name} received; finishing this step, then saving a checkpoint "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )


def invoked_program(
    argv0: str | None = None,
    orig_argv: Sequence[str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> list[str]:
    """The words that started this ``oppo-jax`` (defaults: ``sys.argv[0]``, ``sys.orig_argv``),
    so that a printed command runs as typed: a bare ``oppo-jax`` only when that is the one on
    ``PATH``, a venv's ``.venv/bin/oppo-jax`` when typed so, ``python -m oppo_jax.cli`` as run.

    Examples: ``.venv/bin/oppo-jax`` gives ``[".venv/bin/oppo-jax"]``; ``/usr/bin/oppo-jax``
    (the shell found it on PATH) gives ``["oppo-jax"]``; ``python3 -m oppo_jax.cli`` gives
    ``["python3", "-m", "oppo_jax.cli"]``; a call of ``cli.main`` from Python (a notebook, a
    test) gives ``[sys.executable, "-m", "oppo_jax.cli"]``, which runs from any shell.
    """
    argv0 = sys.argv[0] if argv0 is None else argv0
    orig = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    if "-m" in orig[1:]:
        at = orig.index("-m", 1)
        if orig[at + 1 : at + 2] == ["oppo_jax.cli"]:  # the interpreter's own options kept
            return orig[: at + 2]
    if os.path.basename(argv0) == "oppo-jax":  # the console script
        on_path = which("oppo-jax")  # a shell's PATH lookup hands Python the full path
        if os.sep not in argv0 or (on_path and _same(on_path, argv0)):
            return ["oppo-jax"]
        return [argv0]
    return [sys.executable, "-m", "oppo_jax.cli"]


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def resume_command(
    config: str | None,
    overrides: Sequence[str],
    out: str,
    options: Sequence[str] = (),
    program: Sequence[str] | None = None,
    resume: bool = True,
) -> str:
    """The command that continues a stopped run, shell-quoted, from what it was started with
    (``resume`` False: the one that starts it again, for a run stopped before step 0).

    Example: ``resume_command("demo_cpu", ["seed=1"], "runs/demo_cpu-20261206-101500",
    program=[".venv/bin/oppo-jax"])`` is ``.venv/bin/oppo-jax train demo_cpu --set seed=1
    --out runs/demo_cpu-20261206-101500 --resume``. ``options`` are further flags given to the
    first run (``--quiet``, ``--no-warmup``); ``program`` defaults to ``invoked_program()``.
    """
    words = [*(invoked_program() if program is None else program), "train"]
    words += [config] if config is not None else []
    words += ["--set", *overrides] if overrides else []
    words += [*options, "--out", out] + (["--resume"] if resume else [])
    return shlex.join(words)
