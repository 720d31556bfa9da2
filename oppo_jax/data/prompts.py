"""Prompt sources for user data: JSONL/parquet loading, tokenization and a resumable iterator."""

import json
import os
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from oppo_jax.base.errors import PromptError

PARQUET_SUFFIXES = (".parquet", ".pq")


def _load_jsonl(path: str, field: str) -> list[str]:
    """Texts under ``field`` of each non-blank JSONL line; errors name file and line."""
    texts = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PromptError(
                    f"{path}: line {lineno} is not UTF-8 (at byte {e.start} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
                raise PromptError(f"{path}: line {lineno} is not valid JSON ({why})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise PromptError(
                    f"{path}: line {lineno} is not a JSON object with a string field {field!r}"
                )
            texts.append(record[field])
    return texts


def _load_parquet(path: str, field: str) -> list[str]:
    """Texts in column ``field`` of a parquet file (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {path} needs pyarrow; install it with `pip install pyarrow`"
        ) from e
    table = pq.read_table(path)
    if field not in table.column_names:
        raise PromptError(f"{path}: no column {field!r} (columns: {table.column_names})")
    texts = table.column(field).to_pylist()
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise PromptError(f"{path}: row {row} of column {field!r} is not a string: {text!r}")
    return texts


def load_prompt_file(path: str | os.PathLike, field: str = "prompt") -> list[str]:
    """Read prompt texts from a JSONL file (one object per line) or a parquet file.

    Args:
        path: a ``.jsonl``/``.json`` file (any suffix but ``.parquet``/``.pq`` is read as
            JSONL) or a parquet file.
        field: the key (JSONL) or column (parquet) holding the prompt text.

    Returns:
        The prompt texts in file order.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PromptError(f"{path}: prompt file does not exist (data.prompts)")
    if path.endswith(PARQUET_SUFFIXES):
        texts = _load_parquet(path, field)
    else:
        texts = _load_jsonl(path, field)
    if not texts:
        raise PromptError(f"{path}: no prompts found (the source is empty)")
    return texts


def _encode(tokenizer: Tokenizer | PreTrainedTokenizerBase, text: str, special: bool) -> list:
    """Token ids of ``text`` with either a ``tokenizers`` or a transformers tokenizer."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special_tokens=special).ids
    return tokenizer.encode(text, add_special_tokens=special)


def tokenize_prompts(
    texts: Sequence[str],
    tokenizer: Tokenizer | PreTrainedTokenizerBase,
    max_prompt_len: int,
    on_too_long: Literal["truncate", "reject"] = "truncate",
    add_special_tokens: bool = False,
    source: str = "prompts",
) -> tuple[list[np.ndarray], int]:
    """Tokenize prompts, truncating (with a warning) or rejecting those over ``max_prompt_len``.

    Prompt texts are expected to carry their own special tokens (e.g. from a chat template),
    so ``add_special_tokens`` is off by default. Truncation keeps the *last* tokens: the end
    of a prompt (the separator or assistant header) is what the response follows.

    Errors name ``source`` (the prompt file) and the prompt's index in it.

    Returns:
        (token arrays as int32, number of prompts truncated).
    """
    if on_too_long not in ("truncate", "reject"):
        raise ValueError(f"on_too_long must be 'truncate' or 'reject', got {on_too_long!r}")
    out, truncated = [], 0
    for i, text in enumerate(texts):
        try:
            ids = _encode(tokenizer, text, add_special_tokens)
        except Exception as e:  # the Rust tokenizers raise bare Exceptions (e.g. unknown word)
            raise PromptError(
                f"{source}: prompt {i} ({text[:40]!r}) cannot be tokenized: {e}"
            ) from None
        if not ids:
            raise PromptError(f"{source}: prompt {i} ({text[:40]!r}) tokenizes to no tokens")
        if len(ids) > max_prompt_len:
            if on_too_long == "reject":
                raise PromptError(
                    f"{source}: prompt {i} has {len(ids)} tokens, more than "
                    f"rollout.max_prompt_len={max_prompt_len} (rollout.prompt_too_long=reject)"
                )
            ids, truncated = ids[-max_prompt_len:], truncated + 1
        out.append(np.asarray(ids, dtype=np.int32))
    if truncated:
        warnings.warn(
            f"{source}: truncated {truncated} of {len(out)} prompts to their last "
            f"{max_prompt_len} tokens (rollout.max_prompt_len)",
            stacklevel=2,
        )
    return out, truncated


class PromptIterator:
    """Endless, deterministic, checkpointable iterator of ``(prompt_id, tokens)``.

    Epoch ``e`` visits every prompt once, in the permutation drawn from
    ``np.random.default_rng([seed, e])``. ``prompt_id = epoch * num_prompts + index`` where
    ``index`` is the prompt's position in the dataset, so ids are unique across the whole run
    and ``prompt_id % num_prompts`` recovers the dataset index. The full state is
    ``{"epoch": int, "position": int}``: position is how many prompts of the epoch were taken.
    """

    def __init__(self, prompts: Sequence[np.ndarray], seed: int, epoch: int = 0, position: int = 0):
        # A PromptSet (flat tokens) is used as it is: copying it into a list would hold one
        # array object per prompt.
        self._prompts = prompts if hasattr(prompts, "__getitem__") else list(prompts)
        if not len(self._prompts):
            raise ValueError("PromptIterator needs at least one prompt")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self._seed = seed
        self._epoch, self._position = epoch, position
        self._order_epoch, self._order = -1, np.zeros(0, dtype=np.int64)
        self._validate()

    def _validate(self) -> None:
        """Check epoch/position and move past a finished epoch."""
        if self._epoch < 0:
            raise ValueError(f"state key 'epoch' must be >= 0, got {self._epoch}")
        if not 0 <= self._position <= self.num_prompts:
            raise ValueError(
                f"state key 'position' must be in [0, {self.num_prompts}], got {self._position}"
            )
        if self._position == self.num_prompts:
            self._epoch, self._position = self._epoch + 1, 0

    @property
    def num_prompts(self) -> int:
        """Prompts per epoch."""
        return len(self._prompts)

    def state(self) -> dict[str, int]:
        """The full iterator state, small enough to store in a checkpoint."""
        return {"epoch": self._epoch, "position": self._position}

    @classmethod
    def from_state(
        cls, prompts: Sequence[np.ndarray], seed: int, state: dict[str, int]
    ) -> "PromptIterator":
        """Rebuild an iterator that continues exactly where ``state`` was taken."""
        if set(state) != {"epoch", "position"}:
            raise ValueError(f"state must have keys 'epoch' and 'position', got {sorted(state)}")
        return cls(prompts, seed, epoch=int(state["epoch"]), position=int(state["position"]))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        return np.random.default_rng([self._seed, epoch]).permutation(self.num_prompts)

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> tuple[int, np.ndarray]:
        if self._order_epoch != self._epoch:
            self._order_epoch, self._order = self._epoch, self.epoch_order(self._epoch)
        index = int(self._order[self._position])
        prompt_id = self._epoch * self.num_prompts + index
        self._position += 1
        self._validate()
        return prompt_id, self._prompts[index]

    def take(self, k: int) -> list[tuple[int, np.ndarray]]:
        """The next ``k`` (prompt_id, tokens) pairs."""
        return [next(self) for _ in range(k)]
