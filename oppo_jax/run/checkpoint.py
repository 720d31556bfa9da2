"""Orbax checkpoints of a whole run: the train state (arrays) and the host state (JSON)."""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

ITEMS = ("train_state", "extra", "arrays")  # arrays: optional run-state arrays (kept caches)
QUARANTINE = "corrupt"  # sub-folder for unreadable steps; not a step name, so orbax ignores it


class CheckpointCorruptError(RuntimeError):
    """No checkpoint that was asked for could be restored."""


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """A ShapeDtypeStruct tree with the leaves' shapes, dtypes and shardings (or ``shardings``).

    A train state's ``frozen`` LoRA bases stay as they are: checkpoints do not hold them (they
    are the run's base checkpoints), and ``restore`` hands them back with the trained state.
    """
    frozen, tree = _detach_frozen(tree)
    if shardings is None:
        out = jax.tree.map(_as_abstract, tree)
    else:
        _, shardings = _detach_frozen(shardings)
        out = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings
        )
    return out if frozen is None else out.replace(frozen=frozen)


def _detach_frozen(tree: Any) -> tuple[Any, Any]:
    """(frozen bases or None, the tree without them)."""
    frozen = getattr(tree, "frozen", None)
    return frozen, (tree if frozen is None else tree.replace(frozen=None))


def _as_abstract(x: Any) -> jax.ShapeDtypeStruct:
    """One leaf as a ShapeDtypeStruct, keeping its sharding when it has one."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"train-state leaf of type {type(x).__name__} has no shape/dtype")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _check_json(value: Any, path: str = "extra") -> None:
    """Raise a TypeError naming ``path`` unless ``value`` round-trips through JSON unchanged."""
    # Strict on purpose: tuples, int keys and numpy scalars would come back as something else,
    # and a resumed run must see exactly the host state it saved.
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path} has a non-string key {key!r}; JSON keys are strings")
            _check_json(item, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{path} is {value}, which JSON cannot represent")
    elif not (value is None or isinstance(value, bool | int | str)):
        raise TypeError(
            f"{path} has type {type(value).__name__}; use dict/list/str/int/float/bool/None "
            "(convert arrays with .tolist() and numpy scalars with int()/float())"
        )


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """The committed steps of a checkpoint directory, ascending ([] when it is missing); reads
    only (opening a ``RunCheckpointer`` creates the directory)."""
    path = epath.Path(os.path.abspath(os.fspath(directory)))
    if not path.is_dir():
        return []
    return sorted(m.step for m in ocp.step.standard_name_format().find_all(path))


class RunCheckpointer:
    """An orbax ``CheckpointManager`` for (train state, JSON host state), with corruption fallback.

    Steps become visible only once orbax has committed them (renamed their temporary folder), so
    ``latest_step()`` never names a half-written save. An unreadable newest step is moved to
    ``<directory>/corrupt/`` (never deleted) when an older step restores in its place.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        max_to_keep: int = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        """Open (or create) the checkpoint directory."""
        for name, value in (
            ("max_to_keep", max_to_keep),
            ("save_interval_steps", save_interval_steps),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.directory = epath.Path(os.path.abspath(os.fspath(directory)))
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"checkpoint directory {self.directory} is a file")
        # One name format shared with the manager, so our on-disk listing matches its naming.
        self._name_format = ocp.step.standard_name_format()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            step_name_format=self._name_format,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def save(
        self, step: int, train_state: Any, extra: dict, force: bool = False, arrays: Any = None
    ) -> bool:
        """Start saving ``step``; False when orbax skips it (off-interval or not past latest).

        ``arrays``: an optional tree of arrays beside the train state (the frozen scorers' kept
        caches, ``scoring.carried``), read back with ``restore_arrays``."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
        step = int(step)  # numpy and 0-d integers are welcome; orbax wants a Python int
        if not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
        _check_json(extra)
        # A deep copy: the caller may mutate its buffers while the async write is in flight.
        extra = json.loads(json.dumps(extra))
        _, train_state = _detach_frozen(train_state)  # LoRA: adapters and moments only
        items = {
            "train_state": ocp.args.StandardSave(train_state),
            "extra": ocp.args.JsonSave(extra),
        }
        if arrays is not None:
            items["arrays"] = ocp.args.StandardSave(arrays)
        args = ocp.args.Composite(**items)
        try:
            return self._manager.save(step, args=args, force=force)
        except ocp.checkpoint_manager.StepAlreadyExistsError as e:
            raise ValueError(f"checkpoint step {step} already exists in {self.directory}") from e

    def restore_arrays(self, step: int) -> Any:
        """The ``arrays`` tree saved with ``step`` (as saved, on the default device), or None
        when that step has none."""
        self.wait()
        if not (self.directory / self._name_format.build_name(step) / "arrays").exists():
            return None
        args = ocp.args.Composite(arrays=ocp.args.StandardRestore())
        return self._manager.restore(step, args=args).arrays

    def wait(self) -> None:
        """Block until an in-flight async save has been committed (re-raises its error)."""
        self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        """Committed steps on disk, ascending."""
        # Read from disk, not the manager's cache: orbax lists a step as soon as its async save
        # starts, while the name format skips folders that are still temporary.
        return committed_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(
        self, step: int | None = None, abstract_train_state: Any = None
    ) -> tuple[Any, dict]:
        """Restore ``(train_state, extra)`` at ``step`` (latest readable when None).

        ``abstract_train_state`` is a tree of ``jax.ShapeDtypeStruct`` (see ``abstract_like``);
        each array comes back with its leaf's sharding.
        """
        if abstract_train_state is None:
            raise TypeError("restore needs abstract_train_state (e.g. abstract_like(train_state))")
        frozen, abstract_train_state = _detach_frozen(abstract_train_state)
        target = jax.tree.map(_as_abstract, abstract_train_state)
        self.wait()  # never reshuffle steps under a finalising save
        steps = self.all_steps()
        if frozen is not None:  # the bases come back with the restored trained state
            restored, extra = self.restore(step, target)
            return restored.replace(frozen=frozen), extra
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"no committed checkpoint for step {step} in {self.directory}; "
                    f"available: {steps}"
                )
            try:
                return self._restore_step(step, target)
            except Exception as e:
                raise CheckpointCorruptError(
                    f"checkpoint step {step} in {self.directory} could not be restored: "
                    f"{type(e).__name__}: {e}"
                ) from e
        if not steps:
            raise FileNotFoundError(f"no checkpoints in {self.directory}")
        return self._restore_latest_readable(steps, target)

    def _restore_latest_readable(self, steps: list[int], target: Any) -> tuple[Any, dict]:
        """Try steps newest first; set aside the unreadable ones only once an older one works."""
        failures = []
        for step in reversed(steps):
            try:
                result = self._restore_step(step, target)
            except Exception as e:  # tensorstore/JSON/metadata errors have no common base class
                failures.append((step, e))
                continue
            # The same target restored an older step, so the newer failures are damage, not a
            # wrong target: move them out of the step namespace so max_to_keep and re-saving
            # those step numbers work again.
            for bad, err in failures:
                moved = self._quarantine(bad)
                warnings.warn(
                    f"checkpoint step {bad} in {self.directory} is unreadable "
                    f"({type(err).__name__}: {err}); moved it to {moved} and restored step "
                    f"{step} instead",
                    stacklevel=3,
                )
            return result
        # Nothing on disk was touched: if every step fails alike, the target is the likely cause.
        details = "; ".join(f"step {s}: {type(e).__name__}: {e}" for s, e in failures)
        raise CheckpointCorruptError(
            f"no checkpoint in {self.directory} could be restored into the given target "
            f"(if every step fails alike, check abstract_train_state): {details}"
        )

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict]:
        """Restore one step with orbax; raises whatever orbax raises on damage."""
        args = ocp.args.Composite(
            train_state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore()
        )
        restored = self._manager.restore(step, args=args)
        if not isinstance(restored.extra, dict):
            raise ValueError(f"extra of step {step} is {type(restored.extra).__name__}, not dict")
        return restored.train_state, restored.extra

    def _quarantine(self, step: int) -> epath.Path:
        """Move an unreadable step folder to ``corrupt/`` and refresh the manager's step list."""
        name = self._name_format.build_name(step)
        dest_dir = self.directory / QUARANTINE
        dest, n = dest_dir / name, 1
        while dest.exists():  # the same step number may go bad twice
            dest, n = dest_dir / f"{name}-{n}", n + 1
        if jax.process_index() == 0:  # one host moves; the barrier keeps the others behind it
            dest_dir.mkdir(parents=True, exist_ok=True)
            (self.directory / name).rename(dest)
        ocp.multihost.sync_global_processes(f"RunCheckpointer_quarantine_{step}")
        self._manager.reload()  # orbax's cached list drives max_to_keep and "step exists" checks
        return dest

    def close(self) -> None:
        """Wait for in-flight saves and release orbax's resources."""
        self._manager.close()

    def __enter__(self) -> RunCheckpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
