"""Ctrl-C before step 0: in the warm-up, and while another process holds the demo models'
lock. Either stops at once with EXIT_PREEMPTED and one line (no traceback), says what it was
doing, and leaves the run directory as the printed command accepts."""

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import oppo_jax.train as train_module
from oppo_jax.base.errors import EXIT_PREEMPTED, Interrupted
from oppo_jax.cli import main
from oppo_jax.run.log import has_checkpoint, leave_as_found
from oppo_jax.run.preemption import StopOnSignal
from tests.test_run_dirs import TINY


def _sigint_in_the_warm_up(monkeypatch) -> list[str]:
    """Turn the warm-up on and make it receive a SIGINT; ``reached`` records whether the
    warm-up went on after the signal (it must not)."""
    reached: list[str] = []

    def warm_up(ctx, *args):
        signal.raise_signal(signal.SIGINT)
        reached.append("past the signal")  # a swallowed signal trains to the end
        return {}, ctx

    monkeypatch.setenv("OPPO_JAX_WARMUP", "on")
    monkeypatch.setattr(train_module, "warm_up", warm_up)
    return reached


def _train(out: Path, *flags: str, sets: tuple[str, ...] = ()) -> int:
    return main(["train", "--quiet", "--out", str(out), *flags, "--set", *TINY, *sets])


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "empty-out-overwrite"])
def test_sigint_in_the_warm_up_exits_75_in_one_line_and_the_command_starts_it_again(
    tmp_path, monkeypatch, capsys, existing
):
    reached = _sigint_in_the_warm_up(monkeypatch)
    out = tmp_path / "run"
    if existing:
        out.mkdir()
    assert _train(out, *(["--overwrite"] if existing else [])) == EXIT_PREEMPTED
    assert reached == []
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("oppo-jax: SIGINT received before step 0 (the warm-up")
    assert "nothing was trained; to start it again, run: " in lines[0]
    assert "Traceback" not in err and "--resume" not in lines[0]
    # left as found: absent, or (given) empty
    assert out.is_dir() == existing and (not existing or list(out.iterdir()) == [])
    monkeypatch.undo()  # the printed command, as typed, without a warm-up to be quick
    monkeypatch.setenv("OPPO_JAX_WARMUP", "off")
    words = shlex.split(lines[0].split("run: ", 1)[1])
    assert words[:4] == [sys.executable, "-m", "oppo_jax.cli", "train"]
    assert main(words[3:]) == 0
    assert has_checkpoint(out / "checkpoints")


def test_sigint_in_the_warm_up_of_a_resumed_run_keeps_it_resumable(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert _train(out) == 0  # one step, checkpointed
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    _sigint_in_the_warm_up(monkeypatch)
    assert _train(out, "--resume", sets=("train.steps=2",)) == EXIT_PREEMPTED
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("--resume") and "before step 0 (the warm-up" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert (out / "config.yaml").is_file() and (out / "metrics.jsonl").is_file()


def test_the_signal_before_start_raises_at_once_then_a_second_stops_without_a_checkpoint():
    with StopOnSignal(before_start="loading") as stop:
        with pytest.raises(Interrupted, match=r"SIGINT received before step 0 \(loading\)"):
            signal.raise_signal(signal.SIGINT)
        assert stop.received == "SIGINT" and stop.before_start is None
        with pytest.raises(KeyboardInterrupt, match="second stop signal"):
            signal.raise_signal(signal.SIGINT)


def test_leave_as_found_never_removes_a_checkpoint(tmp_path):
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    (ckpts / "3").mkdir(parents=True)
    (out / "config.yaml").write_text("seed: 0\n")
    (out / "notes.txt").write_text("mine")
    leave_as_found(out, ckpts, existed=False)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "notes.txt"]
    assert (ckpts / "3").is_dir()


@pytest.mark.slow  # a fresh `oppo-jax train` process (its imports take seconds)
def test_sigint_while_waiting_for_the_demo_lock_says_whom_for_and_exits_75(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    (cache / "demo").mkdir(parents=True)
    env = dict(os.environ, OPPO_JAX_CACHE=str(cache), OPPO_JAX_COMPILATION_CACHE="off")
    with open(cache / "demo" / ".lock", "w") as lock:  # held here, as a build in progress
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write(f"pid {os.getpid()} (a test)\n")
        lock.flush()
        command = [sys.executable, "-m", "oppo_jax.cli", "train", "--quiet", "--out", str(out)]
        child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        try:
            waiting = _line_with(child, "waiting for", deadline=time.monotonic() + 300)
            child.send_signal(signal.SIGINT)
            _, rest = child.communicate(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
    assert f"waiting for pid {os.getpid()} (a test) to finish" in waiting
    assert str(cache / "demo" / ".lock") in waiting
    assert child.returncode == EXIT_PREEMPTED, rest
    assert "Traceback" not in rest and "flock" not in rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("oppo-jax: SIGINT received before step 0 (loading the models")
    assert not out.exists()  # the same command starts it again


def _line_with(child: subprocess.Popen, text: str, deadline: float) -> str:
    """The first line of ``child``'s stderr holding ``text``."""
    for line in child.stderr:
        if text in line:
            return line
        assert time.monotonic() < deadline, f"no line with {text!r}"
    raise AssertionError(f"stderr ended without {text!r} (rc {child.wait()})")
