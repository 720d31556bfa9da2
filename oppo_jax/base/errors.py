"""The errors a user can meet, and the exit codes the ``oppo-jax`` command maps them to.

Everything a user can get wrong (a config, a prompt file, a model directory) raises an
``InputError`` whose message names the file, key or value; the command prints it without a
traceback. ``InputError`` subclasses ``ValueError`` so library callers can catch either.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2  # a config, prompt file or model directory was rejected; nothing ran
EXIT_NONFINITE = 3  # too many non-finite updates in a row; the last good checkpoint is kept
EXIT_HOST_LIMIT = 4  # the host cannot hold the run's compiled programs (oppo_jax.base.host_maps)
# SIGTERM/SIGINT: a checkpoint was saved (or, before step 0, nothing was trained and the run
# directory starts again as it was); the message says how to continue
EXIT_PREEMPTED = 75


class InputError(ValueError):
    """Bad user input: the message names the file, key or value and what is wrong with it."""


class ConfigError(InputError):
    """A configuration problem; the message names the file and/or the dotted key and value."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


class PromptError(InputError):
    """A prompt source that cannot be used (unreadable, empty, or a prompt over the limit)."""


class NonFiniteError(RuntimeError):
    """``train.max_nonfinite_in_a_row`` updates in a row were skipped for NaN/Inf values."""


class HostLimitError(RuntimeError):
    """The host cannot hold what the run would compile (``oppo_jax.base.host_maps``); the message
    names the limit and the fix."""


class Preempted(Exception):  # noqa: N818 (a stop request, not a failure)
    """The run stopped on a signal after saving a checkpoint at ``step``; ``command``, when
    given, is the exact command that continues it (``preemption.resume_command``)."""

    def __init__(self, step: int, signal_name: str, checkpoint_dir: str, command: str = ""):
        # Steps count from 0: ``step`` steps are done and the run continues at step ``step``.
        done = "no step was done" if step == 0 else f"steps 0-{step - 1} are done"
        how = f"rerun with --resume to continue at step {step}"
        if command:
            how = f"to continue at step {step}, run:\n  {command}"
        super().__init__(
            f"{signal_name} received: {done} and saved in {checkpoint_dir}/{step}; {how}"
        )
        self.step, self.signal_name, self.checkpoint_dir = step, signal_name, checkpoint_dir

    def with_command(self, command: str) -> Preempted:
        """The same stop, its message ending with ``command``, the one that continues the run."""
        return Preempted(self.step, self.signal_name, self.checkpoint_dir, command)


class Interrupted(BaseException):  # noqa: N818 (a stop request, not a failure)
    """A stop signal before step 0 (loading the models, waiting for or building the demo's
    models, the warm-up): nothing was trained, so nothing is saved, and the run directory is
    left as a rerun accepts. ``during`` says what the run was doing. A ``BaseException``, as
    ``KeyboardInterrupt`` is, so that no ``except Exception`` on the way swallows the stop."""

    def __init__(self, signal_name: str, during: str, how: str = ""):
        how = how or "rerun the same command to start it again"
        super().__init__(
            f"{signal_name} received before step 0 ({during}): nothing was trained; {how}"
        )
        self.signal_name, self.during = signal_name, during

    def with_command(self, command: str) -> Interrupted:
        """The same stop, its message ending with ``command``, the one that starts the run."""
        return Interrupted(self.signal_name, self.during, f"to start it again, run: {command}")
