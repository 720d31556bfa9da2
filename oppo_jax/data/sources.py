"""Record sources behind ``data.prompts``: JSONL and parquet files, directories saved by
Hugging Face ``datasets`` (``save_to_disk``), datasets already in the local Hub cache, and the
built-in addition task (``arith``).

Every source streams: ``records()`` yields one record (a dict) at a time and ``record(i)`` reads
record ``i`` alone (a byte offset into a JSONL file, a row group of a parquet file, a row of a
memory-mapped Arrow table), so no source is ever read whole into memory. Nothing is
downloaded: a Hub name that is not in the local cache is an error saying what to fetch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from oppo_jax.base.errors import PromptError
from oppo_jax.data.arith_task import ARITH_SOURCE, ArithRecords, ArithSpec
from oppo_jax.data.word_problems import WORD_PROBLEMS_SOURCE, WordProblemRecords, WordProblemSpec

PARQUET_SUFFIXES = (".parquet", ".pq")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "org/name"
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq", ".txt", ".csv")


class JsonlRecords:
    """A JSONL file: one object per non-blank line, located by a byte-offset index built in
    one streaming pass (8 bytes per record in memory, not the text)."""

    def __init__(self, path: str):
        self.name = path
        offsets, lines, at = [], [], 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    offsets.append(at)
                    lines.append(lineno)
                at += len(raw)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lines = np.asarray(lines, dtype=np.int64)  # for error messages

    def __len__(self) -> int:
        return len(self._offsets)

    def _parse(self, raw: bytes, i: int) -> dict:
        where = self.where(i)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PromptError(f"{where} is not UTF-8 (at byte {e.start} of the line)") from None
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise PromptError(f"{where} is not valid JSON ({why})") from None
        if not isinstance(record, dict):
            raise PromptError(f"{where} is not a JSON object")
        return record

    def where(self, i: int) -> str:
        return f"{self.name}: line {int(self._lines[i])}"

    def record(self, i: int) -> dict:
        with open(self.name, "rb") as f:
            f.seek(int(self._offsets[i]))
            return self._parse(f.readline(), i)

    def records(self) -> Iterator[dict]:
        with open(self.name, "rb") as f:
            for i, at in enumerate(self._offsets):
                f.seek(int(at))
                yield self._parse(f.readline(), i)


class ParquetRecords:
    """A parquet file, read one row group at a time (needs pyarrow)."""

    def __init__(self, path: str):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow: `pip install pyarrow`") from e
        self.name = path
        try:
            self._file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow's ArrowInvalid and friends
            raise PromptError(f"{path}: not a readable parquet file ({e})") from None
        meta = self._file.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._starts = np.cumsum([0, *sizes])
        self._cached = (-1, [])

    @property
    def columns(self) -> list[str]:
        return self._file.schema_arrow.names

    def __len__(self) -> int:
        return int(self._starts[-1])

    def where(self, i: int) -> str:
        return f"{self.name}: row {i}"

    def record(self, i: int) -> dict:
        group = int(np.searchsorted(self._starts, i, side="right") - 1)
        if self._cached[0] != group:
            self._cached = (group, self._file.read_row_group(group).to_pylist())
        return self._cached[1][i - int(self._starts[group])]

    def records(self) -> Iterator[dict]:
        for batch in self._file.iter_batches(batch_size=1024):
            yield from batch.to_pylist()


class ArrowRecords:
    """One split of a Hugging Face ``datasets.Dataset`` (memory-mapped Arrow files)."""

    def __init__(self, dataset, name: str):
        self._ds, self.name = dataset, name

    @property
    def columns(self) -> list[str]:
        return list(self._ds.column_names)

    def __len__(self) -> int:
        return len(self._ds)

    def where(self, i: int) -> str:
        return f"{self.name}: row {i}"

    def record(self, i: int) -> dict:
        return self._ds[int(i)]

    def records(self) -> Iterator[dict]:
        if not len(self._ds):  # datasets' batch iterator fails on an empty table
            return
        for batch in self._ds.iter(batch_size=1024):
            keys, columns = list(batch), list(batch.values())
            for row in range(len(columns[0]) if columns else 0):
                yield {k: c[row] for k, c in zip(keys, columns, strict=True)}


def _pick_split(loaded, split: str | None, name: str):
    """The ``split`` of a DatasetDict (its only split when ``split`` is None), or a Dataset."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            raise PromptError(
                f"{name}: no split {split!r} (data.split; the splits are {', '.join(splits)})"
            )
        return loaded[split], f"{name}[{split}]"
    if split is not None and str(loaded.split) != split:
        raise PromptError(
            f"{name}: holds one dataset (split {loaded.split}), not a split {split!r} (data.split)"
        )
    return loaded, name


def _saved_dataset(path: str, split: str | None) -> ArrowRecords:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise PromptError(f"{path}: not a dataset saved by `datasets` ({e})") from None
    except IndexError:  # datasets 5 cannot load back a saved dataset of no shards (no rows)
        raise PromptError(f"{path}: no prompts found (the source is empty; data.prompts)") from None
    return ArrowRecords(*_pick_split(loaded, split, path))


def hub_snapshot(name: str) -> Path | None:
    """The local Hub-cache snapshot of dataset ``name`` (its ``main`` ref), or None."""
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        return snapshot if snapshot.is_dir() else None
    snapshots = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    return snapshots[-1] if len(snapshots) == 1 else None


def _hub_dataset(name: str, split: str | None) -> ArrowRecords:
    """Dataset ``name`` from the local Hugging Face Hub cache, never from the network."""
    import datasets

    snapshot = hub_snapshot(name)
    if snapshot is None:
        raise PromptError(
            f"data.prompts={name!r}: not a file or directory, and no dataset {name!r} is in the "
            f"local Hugging Face cache (HF_HUB_CACHE). Nothing is downloaded: fetch it where "
            f"there is network with `huggingface-cli download --repo-type dataset {name}` (and "
            "copy the cache here), or save it with `datasets.load_dataset(...).save_to_disk(DIR)`"
            " and set data.prompts=DIR"
        )
    try:  # the snapshot's data files, read by datasets' packaged builders (json, parquet, csv)
        loaded = datasets.load_dataset(str(snapshot), split=split)
    except ValueError as e:  # e.g. an unknown split
        raise PromptError(f"data.prompts={name!r} (data.split={split!r}): {e}") from None
    return ArrowRecords(*_pick_split(loaded, split, name))


def open_source(spec: str, split: str | None = None):
    """The record source named by ``data.prompts`` (a file, a saved dataset, a Hub name, or
    the built-in ``arith`` task's ``split``)."""
    path = os.fspath(spec)
    if path == ARITH_SOURCE:
        return ArithRecords(ArithSpec(), split)
    if path == WORD_PROBLEMS_SOURCE:
        return WordProblemRecords(WordProblemSpec(), split)
    if os.path.isdir(path):
        return _saved_dataset(path, split)
    if os.path.isfile(path):
        return ParquetRecords(path) if path.endswith(PARQUET_SUFFIXES) else JsonlRecords(path)
    if _HUB_NAME.match(path) and not path.endswith(_FILE_SUFFIXES):
        return _hub_dataset(path, split)
    raise PromptError(f"{path}: prompt file does not exist (data.prompts)")
