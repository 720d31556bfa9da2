"""RunLog's writer thread: metrics.jsonl and TensorBoard hold the same records, in the same order,
as when written on the caller's thread, and every record of a run stopped by a signal or an
error is on disk when ``train`` returns or raises."""

import json
import math
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboardX import SummaryWriter
from tensorboardX.proto import event_pb2

import oppo_jax.train as train_module
from oppo_jax.base.errors import EXIT_PREEMPTED
from oppo_jax.cli import main
from oppo_jax.run.log import RunLog, _snapshot, read_metrics
from tests.run_fixtures import OPPO_WITH_CARRYING
from tests.test_run_dirs import TINY


def tensorboard_scalars(directory: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in the event files under ``directory``, in order
    (TFRecord framing: length, its CRC, the event, its CRC; wall times left out)."""
    scalars = []
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            scalars += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    return scalars


def _records(n: int) -> list[dict]:
    """Step records with what a real one holds: nested dicts, ints, a NaN, a skipped update."""
    return [
        {
            "step": i,
            "reward": 0.1 * i,
            "policy_loss": math.nan if i == 2 else -0.01 * i,
            "response_len_max": 7 + i,
            "stage_time_s": {"decode": 0.02, "update": 0.03 + i},
            "update_skipped": i == 2,
            "compile_time_s": 1.5 if i == 0 else 0.0,
        }
        for i in range(n)
    ]


def _written(out: Path, background: bool, mutate: bool) -> tuple[str, list]:
    out.mkdir()
    log = RunLog(out, total_steps=6, start_step=0, progress=False, background=background)
    for record in _records(6):
        log.write(record)
        if mutate:  # the loop's dict changed after the hand-over changes nothing written
            record["reward"] = -1.0
            record["stage_time_s"]["decode"] = -1.0
    log.close()
    return (out / "metrics.jsonl").read_text(), tensorboard_scalars(out / "tensorboard")


def _written_as_before(out: Path) -> list:
    """TensorBoard's scalars as RunLog wrote them before its writer thread: ``add_scalar``
    for each finite number but the step (one event each)."""
    tb = SummaryWriter(str(out / "tensorboard"))
    for record in _records(6):
        for tag, value in _scalars_of(record):
            if math.isfinite(value):
                tb.add_scalar(tag, value, record["step"])
    tb.close()
    return tensorboard_scalars(out / "tensorboard")


def test_the_writer_thread_writes_what_the_callers_thread_writes(tmp_path):
    lines, scalars = _written(tmp_path / "now", background=False, mutate=False)
    assert _written(tmp_path / "thread", background=True, mutate=True) == (lines, scalars)
    assert scalars == _written_as_before(tmp_path / "before")  # (step, tag, value), in order
    assert [r["step"] for r in read_metrics(tmp_path / "thread" / "metrics.jsonl")] == list(
        range(6)
    )
    assert read_metrics(tmp_path / "thread" / "metrics.jsonl")[2]["policy_loss"] is None
    assert (0, "stage_time_s/decode", pytest.approx(0.02)) in scalars
    assert not [s for s in scalars if s[1] == "policy_loss" and s[0] == 2]  # NaN left out


def test_a_failed_write_is_raised_in_the_callers_thread(tmp_path):
    log = RunLog(tmp_path, total_steps=2, start_step=0, progress=False)
    log._file.close()  # the next write fails in the writer thread
    log.write(_records(1)[0])
    with pytest.raises(ValueError, match="closed file"):
        log.flush()
    with pytest.raises(ValueError, match="closed file"):
        log.close()


def _scalars_of(record: dict, prefix: str = ""):
    """The numbers of a record, flattened as TensorBoard tags (the step and booleans left out)."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _scalars_of(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
            yield f"{prefix}{key}", float(value)


@pytest.mark.parametrize("stop", ["signal", "error"])
def test_every_record_of_a_stopped_run_is_written(tmp_path, monkeypatch, stop):
    real, calls = train_module.run_step, []

    def run_step(*args):  # the third step is stopped by a SIGTERM, or fails after its records
        calls.append(1)
        if len(calls) == 3:
            if stop == "error":
                raise RuntimeError("a crash in step 2")
            signal.raise_signal(signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(train_module, "run_step", run_step)
    out = tmp_path / "run"
    argv = ["train", "--quiet", "--out", str(out), "--set", *TINY, "train.steps=5"]
    if stop == "error":
        with pytest.raises(RuntimeError, match="a crash in step 2"):
            main(argv)
    else:
        assert main(argv) == EXIT_PREEMPTED
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == ([0, 1] if stop == "error" else [0, 1, 2])
    expected = sorted(  # the lines' keys are sorted; TensorBoard has each step's in its order
        (r["step"], tag.replace(" ", "_"), value)  # TensorBoard's tags have no spaces
        for r in records
        for tag, value in _scalars_of(r)
        if value is not None and math.isfinite(value)
    )
    got = tensorboard_scalars(out / "tensorboard")
    assert [s[0] for s in got] == sorted(s[0] for s in got)  # steps in order
    assert [s[:2] for s in sorted(got)] == [s[:2] for s in expected]
    assert [s[2] for s in sorted(got)] == pytest.approx([s[2] for s in expected], rel=1e-6)
    assert (
        json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        == (records[-1]["step"])
    )


def test_a_record_built_steps_later_on_the_writer_thread_is_the_one_handed_over(
    tmp_path, monkeypatch
):
    """The loop hands over a function that builds its record (``train.PendingRecord``); the
    writer thread, slowed here, builds it steps later. Its line and its TensorBoard scalars
    are those of the record built at the hand-over: nothing it reads (the step's metrics,
    slots, batch rows, work) is changed by the steps after it."""
    handed, behind, written = [], [], []
    real_write, real_emit = RunLog.write, RunLog._emit

    def write(log, record):
        handed.append(record())  # built at once, on the loop's thread
        behind.append(len(handed) - 1 - len(written))
        real_write(log, record)

    def emit(log, entry):
        time.sleep(0.3)
        real_emit(log, entry)
        written.append(1)

    monkeypatch.setattr(RunLog, "write", write)
    monkeypatch.setattr(RunLog, "_emit", emit)
    out = tmp_path / "run"
    sets = [*TINY, *OPPO_WITH_CARRYING, "train.steps=6", "train.checkpoint_every=0"]
    assert main(["train", "--quiet", "--out", str(out), "--set", *sets]) == 0
    assert max(behind) >= 2  # the writer was steps behind the loop
    assert any(r["carried"] for r in handed)  # sequences carried into later steps
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines == [_snapshot(r)[0] for r in handed]
    expected = [
        (r["step"], tag.replace(" ", "_"), float(np.float32(value)))
        for r in handed
        for tag, value in _scalars_of(r)
        if math.isfinite(value)
    ]
    assert tensorboard_scalars(out / "tensorboard") == expected
