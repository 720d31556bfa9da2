"""Random prompts: seeded token ids, for benchmarks with random models (no tokenizer, no files).

Token ids 0..3 are kept free for special tokens: a random model reads pad = 0 and eos = 1
(``RANDOM_PAD_ID``, ``RANDOM_EOS_ID``), and ids 2 and 3 are left unused like the demo's
bos/sep. With a real tokenizer, its special ids are left out as well.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

RANDOM_PAD_ID = 0  # padding id of random models
RANDOM_EOS_ID = 1  # end-of-sequence id of random models
NUM_RESERVED_IDS = 4  # ids 0..3 never appear in a random prompt
NUM_RANDOM_PROMPTS = 4096  # size of the random prompt set (prompt ids go on across epochs)


def random_prompts(
    vocab_size: int,
    length_range: tuple[int, int],
    count: int = NUM_RANDOM_PROMPTS,
    seed: int = 0,
    exclude: Iterable[int] = (),
) -> list[np.ndarray]:
    """``count`` prompts of token ids drawn uniformly from [4, ``vocab_size``) minus
    ``exclude``, lengths uniform in the inclusive ``length_range``.

    Example: vocab 512, range (4, 16): prompts of 4 to 16 ids, each in 4..511.
    """
    lo, hi = length_range
    if not 1 <= lo <= hi:
        raise ValueError(f"length_range={length_range}: need 1 <= shortest <= longest")
    allowed = np.setdiff1d(np.arange(NUM_RESERVED_IDS, vocab_size), np.asarray(list(exclude)))
    if allowed.size == 0:
        raise ValueError(f"vocab_size={vocab_size}: no ids left for prompts")
    rng = np.random.default_rng([seed, 0x5EED])
    lengths = rng.integers(lo, hi + 1, count)
    return [rng.choice(allowed, n).astype(np.int32) for n in lengths]
