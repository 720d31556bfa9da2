"""User prompts: a record source (``data.sources``) streamed once through the actor's tokenizer
into one flat token array, with each prompt's text built from a field or a chat conversation
(with the tokenizer's chat template, after an optional system prompt).

The source stays open beside the tokens, so a reward function can be handed the dataset record
of any prompt (``PromptSet.record``) without the dataset ever being held in memory; only each
record's reference answer (``data.answer_field``), extracted once at load, is kept.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from oppo_jax.base.errors import PromptError
from oppo_jax.data.answers import reference_answer
from oppo_jax.data.sources import open_source

REFERENCE = "reference"  # the record key a reward function finds the bare reference answer at


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a record becomes prompt text (the ``data.*`` keys)."""

    prompt_field: str = "prompt"  # data.prompt_field: the record's prompt text
    messages_field: str | None = None  # data.messages_field: chat messages instead of text
    chat_template: bool = False  # data.chat_template: apply the tokenizer's chat template
    system_prompt: str | None = None  # data.system_prompt: a system turn before each prompt
    answer_field: str | None = None  # data.answer_field: the record's reference answer


class PromptSet(Sequence):
    """Tokenized prompts as one flat int32 array plus offsets: a ``Sequence`` of token arrays.

    Example: prompts [5, 6] and [7] are stored as tokens [5, 6, 7] and offsets [0, 2, 3].
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, source=None, references=None):
        self._tokens, self._offsets, self.source = tokens, offsets, source
        self.references = references  # each prompt's bare reference answer, or None

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
        """The dataset record of prompt ``i`` (read from the source on demand), with its
        reference answer under ``"reference"`` when ``data.answer_field`` is set."""
        record = {} if self.source is None else dict(self.source.record(i))
        if self.references is not None:
            record[REFERENCE] = self.references[i]
        return record


def _check_template(tokenizer, fmt: PromptFormat) -> None:
    if fmt.messages_field is not None and not fmt.chat_template:
        raise PromptError(
            f"data.messages_field={fmt.messages_field!r} needs data.chat_template=true "
            "(chat messages become text only through the tokenizer's chat template)"
        )
    if fmt.system_prompt is not None and not fmt.chat_template:
        raise PromptError(
            "data.system_prompt needs data.chat_template=true (a system turn becomes text only "
            "through the tokenizer's chat template)"
        )
    if fmt.chat_template and not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "data.chat_template=true, but the actor's tokenizer has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja); without it, "
            "set data.chat_template=false to use each prompt's text as it is"
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


def _render(messages: list[dict], where: str, fmt: PromptFormat, tokenizer) -> str:
    """The conversation through the chat template, after ``data.system_prompt``, with the
    generation prompt (the assistant header the response follows)."""
    if fmt.system_prompt is not None:
        if any(m["role"] == "system" for m in messages):
            raise PromptError(
                f"{where}: the conversation has its own system message, and data.system_prompt "
                "would add a second (unset one of them)"
            )
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2's TemplateError, or a template's own raise_exception
        raise PromptError(
            f"{where}: the tokenizer's chat template cannot render this prompt "
            f"({type(e).__name__}: {e}; data.chat_template, data.system_prompt)"
        ) from None


def prompt_text(record: dict, where: str, fmt: PromptFormat, tokenizer) -> str:
    """The text of one record's prompt; with ``data.chat_template`` a conversation (or the
    prompt as one user turn) rendered by the tokenizer's chat template."""
    key = fmt.messages_field or fmt.prompt_field
    if key not in record:
        which = "data.messages_field" if fmt.messages_field else "data.prompt_field"
        raise PromptError(
            f"{where}: no field {key!r} ({which}; the record has {', '.join(map(str, record))})"
        )
    value = record[key]
    if fmt.messages_field is not None:
        return _render(_messages(value, where, key), where, fmt, tokenizer)
    if not isinstance(value, str):
        raise PromptError(
            f"{where}: field {key!r} (data.prompt_field) is {type(value).__name__}, not a string"
        )
    if fmt.chat_template:  # a plain prompt as one user turn
        return _render([{"role": "user", "content": value}], where, fmt, tokenizer)
    return value


def _reference(record: dict, where: str, field: str) -> str:
    """The bare reference answer of the record's ``data.answer_field``."""
    if field not in record:
        raise PromptError(
            f"{where}: no field {field!r} (data.answer_field; the record has "
            f"{', '.join(map(str, record))})"
        )
    return reference_answer(record[field], where)


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

    Truncation keeps a prompt's *last* tokens (what the response follows). With
    ``fmt.answer_field`` each record's reference answer is extracted here, once. Every problem
    is a ``PromptError`` naming the source, the record and the config key.
    """
    _check_template(tokenizer, fmt)
    source = open_source(spec, split)
    pieces, lengths, truncated, references = [], [], 0, []
    for i, record in enumerate(source.records()):
        where = source.where(i)
        ids = _ids(tokenizer, prompt_text(record, where, fmt, tokenizer), where)
        if fmt.answer_field is not None:
            references.append(_reference(record, where, fmt.answer_field))
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
    references = references if fmt.answer_field is not None else None
    return PromptSet(np.concatenate(pieces), offsets, source, references), truncated
