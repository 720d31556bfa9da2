"""Rule reward of the built-in addition task (``reward.functions``).

``exact_match`` compares the response text with the record's ``answer``, character for
character: a missing, wrong or extra digit, a space or a sign more, scores 0. Reward functions
see text decoded with special tokens skipped, so a right response may end with ``<eos>`` (it
may also hold ``<pad>``, ``<bos>`` or ``<sep>``, which the actor is never taught to write).
"""

from __future__ import annotations


def exact_match(prompt: str, response: str, record: dict) -> float:
    """1.0 if the response is exactly the record's answer, else 0.0."""
    if "answer" not in record:
        raise KeyError("exact_match needs records with an 'answer' field (data.prompts: arith)")
    return float(response == record["answer"])
