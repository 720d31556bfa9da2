"""User prompts: a record source (``data.sources``) streamed once through the actor's tokenizer
into one flat token array, with each prompt's text built from a field or a chat conversation.

The source stays open beside the tokens, so a reward function can be handed the dataset record
of any prompt (``PromptSet.record``) without the dataset ever being held in memory.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from oppo_jax.base.errors import PromptError
from oppo_jax.data.sources import open_source


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a record becomes prompt text (the ``data.*`` keys)."""

    prompt_field: str = "prompt"  # data.prompt_field: the record's prompt text
    messages_field: str | None = None  # data.messages_field: chat messages instead of text
    chat_template: bool = False  # data.chat_template: apply the tokenizer's chat template


class PromptSet(Sequence):
    """Tokenized prompts as one flat int32 array plus offsets: a ``Sequence`` of token arrays.

    Example: prompts [5, 6] and [7] are stored as tokens [5, 6, 7] and offsets [0, 2, 3].
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, source=None):
        self._tokens, self._offsets, self.source = tokens, offsets, source

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"prompt {i} of {len(self)}")
        i = i % len(self)
        return self._tokens[self._offsets[i] : self._offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def record(self, i: int) -> dict:
        """The dataset record of prompt ``i`` (read from the source on demand)."""
        return {} if self.source is None else self.source.record(i)


def _check_template(tokenizer, fmt: PromptFormat) -> None:
    if fmt.messages_field is not None and not fmt.chat_template:
        raise PromptError(
            f"data.messages_field={fmt.messages_field!r} needs data.chat_template=true "
            "(chat messages become text only through the tokenizer's chat template)"
        )
    if fmt.chat_template and not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "data.chat_template=true, but the actor's tokenizer has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
        )


def _messages(value, where: str, key: str) -> list[dict]:
    """Chat messages: a non-empty list of {"role": str, "content": str}."""
    ok = isinstance(value, list) and value
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise PromptError(
            f"{where}: field {key!r} (data.messages_field) must be a non-empty list of "
            f'{{"role": ..., "content": ...}} messages, got {str(value)[:60]}'
        )
    return value


def prompt_text(record: dict, where: str, fmt: PromptFormat, tokenizer) -> str:
    """The text of one record's prompt; a chat conversation is rendered by the chat template
    with the generation prompt (the assistant header the response follows)."""
    key = fmt.messages_field or fmt.prompt_field
    if key not in record:
        which = "data.messages_field" if fmt.messages_field else "data.prompt_field"
        raise PromptError(
            f"{where}: no field {key!r} ({which}; the record has {', '.join(map(str, record))})"
        )
    value = record[key]
    if fmt.messages_field is not None:
        messages = _messages(value, where, key)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(value, str):
        raise PromptError(
            f"{where}: field {key!r} (data.prompt_field) is {type(value).__name__}, not a string"
        )
    if fmt.chat_template:  # a plain prompt as one user turn
        messages = [{"role": "user", "content": value}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return value


def _ids(tokenizer, text: str, where: str) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception as e:  # the Rust tokenizers raise bare Exceptions (e.g. an unknown word)
        raise PromptError(f"{where}: prompt {text[:40]!r} cannot be tokenized: {e}") from None
    if not ids:
        raise PromptError(f"{where}: prompt {text[:40]!r} tokenizes to no tokens")
    return ids


def load_prompt_set(
    spec: str,
    tokenizer,
    max_prompt_len: int,
    on_too_long: str = "truncate",
    fmt: PromptFormat = PromptFormat(),
    split: str | None = None,
) -> tuple[PromptSet, int]:
    """Stream ``data.prompts`` through the tokenizer; returns (prompts, how many were truncated).

    Truncation keeps a prompt's *last* tokens (what the response follows). Every problem is a
    ``PromptError`` naming the source, the record and the config key.
    """
    _check_template(tokenizer, fmt)
    source = open_source(spec, split)
    pieces, lengths, truncated = [], [], 0
    for i, record in enumerate(source.records()):
        where = source.where(i)
        ids = _ids(tokenizer, prompt_text(record, where, fmt, tokenizer), where)
        if len(ids) > max_prompt_len:
            if on_too_long == "reject":
                raise PromptError(
                    f"{source.name}: prompt {i} has {len(ids)} tokens, more than "
                    f"rollout.max_prompt_len={max_prompt_len} (rollout.prompt_too_long=reject)"
                )
            ids, truncated = ids[-max_prompt_len:], truncated + 1
        pieces.append(np.asarray(ids, dtype=np.int32))
        lengths.append(len(ids))
    if not pieces:
        raise PromptError(f"{source.name}: no prompts found (the source is empty; data.prompts)")
    if truncated:
        warnings.warn(
            f"{source.name}: truncated {truncated} of {len(pieces)} prompts to their last "
            f"{max_prompt_len} tokens (rollout.max_prompt_len)",
            stacklevel=2,
        )
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return PromptSet(np.concatenate(pieces), offsets, source), truncated
