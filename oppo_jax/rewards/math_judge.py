"""The math verifier's judgement, run in a child process (``rewards.sandbox``): Hugging Face's
math-verify parses the reference and the response's answer to SymPy and compares them.

This module imports nothing of ``oppo_jax`` (the child loads it by its path, without JAX).
math-verify's own timeouts (``signal.alarm``) work only in a main thread; they are off here,
and the parent bounds each call by killing the child instead.
"""

from __future__ import annotations

import functools
import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# Where the answer text came from: plain (after ####: a number, maybe with words or units),
# latex (a box's content), text (a whole response: math-verify finds its final answer).
KINDS = ("plain", "latex", "text")
_LATEX, _EXPR = LatexExtractionConfig(), ExprExtractionConfig()

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" on each parse


def _parse(text: str, targets) -> list:
    return parse(text, targets, parsing_timeout=None)


def _boxed(text: str) -> list:
    return _parse(f"\\boxed{{{text}}}", [_LATEX])


@functools.lru_cache(maxsize=4096)
def reference(text: str) -> tuple:
    """A bare reference answer parsed as LaTeX (``\\dfrac12``, ``1,234``, ``\\{1, 2\\}``),
    else as plain text."""
    return tuple(_boxed(text) or _parse(text, [_LATEX, _EXPR]))


def answer(text: str, kind: str) -> list:
    """A response's answer parsed as its ``kind`` says (``KINDS``); [] when nothing parses."""
    if kind == "plain":
        return _parse(text, [_LATEX, _EXPR]) or _boxed(text)
    if kind == "latex":
        return _boxed(text)
    if kind == "text":
        return _parse(text, [_LATEX, _EXPR])
    raise ValueError(f"answer kind {kind!r}: must be one of {', '.join(KINDS)}")


def judge(request: dict) -> dict:
    """``{"answer", "kind"[, "reference"]}`` -> ``{"found"[, "correct"]}``: whether the
    answer parses, and whether it equals the reference mathematically."""
    parsed = answer(request["answer"], request["kind"])
    out = {"found": bool(parsed)}
    if "reference" in request:
        gold = list(reference(request["reference"]))
        if not gold:
            raise ValueError(
                f"math-verify finds no answer in the reference {request['reference']!r}"
            )
        out["correct"] = bool(parsed) and verify(gold, parsed, timeout_seconds=None)
    return out
