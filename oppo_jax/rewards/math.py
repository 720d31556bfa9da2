"""Math answers checked by Hugging Face's math-verify (``reward.functions``).

``verify`` scores 1.0 when the response's final answer equals the record's reference answer
mathematically (``0.5``, ``1/2``, ``\\frac{1}{2}`` and ``\\dfrac12`` are one answer), else 0.0.
``answer_format`` scores 1.0 when the response puts an answer in the expected place. Both take
keyword arguments from ``reward.kwargs``:

- ``extract``, where the response's answer is: ``gsm8k`` (after its last ``####``), ``boxed``
  (its last ``\\boxed{}``), ``last_number`` (math-verify's own search: the expression after
  "final answer is", else the last number or LaTeX expression), or ``auto`` (``####`` if the
  response has one, else ``\\boxed{}``, else the last number).
- ``timeout_s``, the bound of one call in seconds: math-verify runs in a child process
  (``rewards.sandbox``), killed past it, and the response scores 0 (with a warning), so a
  response such as ``\\boxed{9^{9^{9^{9}}}}`` cannot stall a step.

The reference is the record's ``reference`` (``data.answer_field``, extracted at load), else
its ``answer`` (GSM8K's rationale ending in ``#### n``, or the bare answer), else its
``solution`` (MATH's, with ``\\boxed{}``).
"""

from __future__ import annotations

import os
import threading
import warnings

from oppo_jax.data.answers import after_hashes, last_boxed, reference_answer
from oppo_jax.rewards.sandbox import CallTimeout, Sandbox

EXTRACT = ("auto", "gsm8k", "boxed", "last_number")
DEFAULT_TIMEOUT_S = 5.0
_REFERENCE_KEYS = ("reference", "answer", "solution")  # in the order they are looked for
# The child's module, loaded by its path (math-verify and SymPy are imported there only).
_JUDGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_judge.py")

_sandbox: Sandbox | None = None
_lock = threading.Lock()


def _judge(request: dict, timeout_s: float, response: str) -> dict | None:
    """``math_judge.judge(request)`` in the shared sandbox; None past ``timeout_s``."""
    global _sandbox
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}: must be > 0 seconds")
    with _lock:
        if _sandbox is None:
            _sandbox = Sandbox(_JUDGE, "judge")
    try:
        return _sandbox.call(request, timeout_s)
    except CallTimeout:
        warnings.warn(
            f"math-verify gave no verdict within timeout_s={timeout_s} on response "
            f"{response[:60]!r}: scored 0",
            stacklevel=3,
        )
        return None


def record_reference(record: dict) -> str:
    """The record's bare reference answer (see the module docstring)."""
    for key in _REFERENCE_KEYS:
        if key in record:
            return reference_answer(record[key], "the record", f"its {key!r}")
    raise KeyError(
        "the record has no 'reference' (data.answer_field), 'answer' (GSM8K's '#### n', or the "
        f"bare answer) or 'solution' (MATH's \\boxed{{}}); it has {', '.join(map(str, record))}"
    )


def response_answer(response: str, extract: str) -> tuple[str, str] | None:
    """(answer text, ``math_judge.KINDS`` kind) at the response's ``extract`` place, or None
    when the response has no answer there."""
    if extract not in EXTRACT:
        raise ValueError(f"extract={extract!r}: must be one of {', '.join(EXTRACT)}")
    if extract in ("auto", "gsm8k") and (found := after_hashes(response)) is not None:
        return found, "plain"
    if extract in ("auto", "boxed") and (found := last_boxed(response)) is not None:
        return found, "latex"
    if extract in ("auto", "last_number"):
        return response, "text"
    return None


def verify(
    prompt: str,
    response: str,
    record: dict,
    extract: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """1.0 if the response's answer equals the record's reference mathematically, else 0.0."""
    reference = record_reference(record)
    found = response_answer(response, extract)
    if found is None:
        return 0.0
    request = {"answer": found[0], "kind": found[1], "reference": reference}
    reply = _judge(request, timeout_s, response)
    return float(reply is not None and reply["correct"])


def answer_format(
    prompt: str,
    response: str,
    record: dict,
    extract: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """1.0 if the response has an answer that math-verify parses in the ``extract`` place
    (``auto``: after ``####`` or in ``\\boxed{}``), else 0.0."""
    found = response_answer(response, extract)
    if found is None or (extract == "auto" and found[1] == "text"):
        return 0.0
    reply = _judge({"answer": found[0], "kind": found[1]}, timeout_s, response)
    return float(reply is not None and reply["found"])
