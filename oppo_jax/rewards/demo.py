"""Rule-based reward functions of the built-in demo task (``reward.functions``).

``sentiment`` computes the demo's gold rule from the response text alone: the mean hidden
sentiment of its words (``w<i>``), 0.0 for a response without words. Any word outside the
vocabulary is an error, so a wrong tokenizer cannot pass silently.
"""

from __future__ import annotations

import functools

import numpy as np

from oppo_jax.data.demo_task import DemoTaskSpec, word_sentiments


@functools.cache
def _sentiments() -> np.ndarray:
    # The default spec's words: the sentiments depend only on num_words and seed, which every
    # demo run keeps at their defaults (the response length does not change them).
    return word_sentiments(DemoTaskSpec())


def sentiment(prompt: str, response: str, record: dict) -> float:
    """Mean sentiment of the response's words (the demo's gold score)."""
    words = response.split()
    if not words:
        return 0.0
    table = _sentiments()
    values = []
    for w in words:
        if not (w.startswith("w") and w[1:].isdigit() and int(w[1:]) < len(table)):
            raise ValueError(f"{w!r} is not a demo word")
        values.append(table[int(w[1:])])
    return float(np.mean(values))
