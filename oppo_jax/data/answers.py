"""Reference answers as datasets write them: GSM8K's rationale ending in ``#### n``, MATH's
solution with its answer in ``\\boxed{}``, or the bare answer. ``reference_answer`` reduces
each to the bare answer (``data.answer_field``); the math verifier finds a response's answer
with the same two rules (``after_hashes``, ``last_boxed``).

Examples: ``"... so 48 + 24 = 72.\\n#### 1,072"`` gives ``"1072"``; ``"... is
$\\boxed{\\frac{1}{2}}$."`` gives ``"\\frac{1}{2}"``; ``"0.5"`` gives ``"0.5"``.
"""

from __future__ import annotations

import numbers
import re

from oppo_jax.base.errors import PromptError

HASHES = "####"  # GSM8K's final-answer marker
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # the comma of 1,234 (not of 1,2)


def after_hashes(text: str) -> str | None:
    """The line after the last ``####`` with thousands separators dropped (``#### 1,234``
    gives ``1234``), or None when there is no ``####``."""
    at = text.rfind(HASHES)
    if at < 0:
        return None
    line = text[at + len(HASHES) :].strip().split("\n", 1)[0]
    return _THOUSANDS.sub("", line).strip()


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), or None without one.
    Boxes side by side (``\\boxed{1}, \\boxed{2}``) give their contents joined by commas, as
    math-verify reads them."""
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    from latex2sympy2_extended.math_normalization import extract_boxed_content

    return extract_boxed_content(text, mode="last").strip()


def reference_answer(value, where: str, key: str = "data.answer_field") -> str:
    """The bare reference answer of one record's answer field (see the module docstring).

    A number is its text; anything else but a string, or an empty answer, is a
    ``PromptError`` naming ``where`` (the record) and ``key``.
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise PromptError(
            f"{where}: the answer ({key}) is {type(value).__name__}, not a string or a number"
        )
    found = after_hashes(value)
    if found is None:
        found = last_boxed(value)
    answer = (value if found is None else found).strip()
    if not answer:
        raise PromptError(f"{where}: the answer ({key}) is empty: {value[-60:]!r}")
    return answer
