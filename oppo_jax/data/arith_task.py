"""Built-in verifiable task (``data.prompts: arith``): two-operand addition, digit by digit.

A prompt is ``<bos> 4 0 7 + 3 8 =`` and its answer ``4 4 5`` (most significant digit first,
no leading zeros), followed by ``<eos>``. The operands are uniform over 0 .. 10^digits - 1.
Every ordered pair of operands belongs to one split: a seeded permutation of all pairs puts
the first ``num_test`` in ``test`` and the rest in ``train``, so the held-out prompts never
occur in training (neither in the SFT corpus nor among the RL prompts). Records carry the
answer text, which the rule reward ``oppo_jax.rewards.arith:exact_match`` checks.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from jaxtyping import Int

from oppo_jax.base.errors import PromptError
from oppo_jax.data.demo_task import BOS_ID, EOS_ID, NUM_SPECIAL, SftExample

ARITH_SOURCE = "arith"  # the data.prompts value
SPLITS = ("train", "test")
PLUS, EQUALS = NUM_SPECIAL + 10, NUM_SPECIAL + 11  # token ids after the ten digits


@dataclasses.dataclass(frozen=True)
class ArithSpec:
    """Settings of the addition task."""

    digits: int = 2  # longest operand, decimal digits
    num_test: int = 512  # held-out operand pairs (the test split)
    num_train_prompts: int = 4096  # records of the train split (the RL prompts)
    seed: int = 0  # fixes which pairs are held out
    # share of SFT examples whose answer is the carry-less sum (a teacher that forgets to
    # carry): the SFT actor then writes most sums that need a carry wrong, and RL on the exact
    # answer has the carries to learn
    carry_drop: float = 0.6

    @property
    def words(self) -> tuple[str, ...]:
        """The ordinary tokens, in id order after the special ones."""
        return (*map(str, range(10)), "+", "=")

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self.words)

    @property
    def max_prompt_len(self) -> int:
        """bos, two operands, plus, equals."""
        return 2 * self.digits + 3

    @property
    def max_response_len(self) -> int:
        """The longest sum (digits + 1) and eos."""
        return self.digits + 2


def _digits(n: int) -> list[int]:
    return [NUM_SPECIAL + int(c) for c in str(n)]


def encode(a: int, b: int, total: int | None = None) -> SftExample:
    """Token ids of ``a + b``: prompt (bos a + b =) and response (``total``, default the sum,
    then eos).

    Example: encode(12, 9) -> prompt [2, 5, 6, 14, 13, 15], response [6, 5, 1] ("2 1" eos).
    """
    prompt = [BOS_ID, *_digits(a), PLUS, *_digits(b), EQUALS]
    total = a + b if total is None else total
    return SftExample(np.int32(prompt), np.int32([*_digits(total), EOS_ID]))


def carryless_sum(a: int, b: int) -> int:
    """``a + b`` with every carry dropped (each column's digit sum mod 10): 57 + 68 -> 15."""
    total, place = 0, 1
    while a or b:
        total += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return total


def record(a: int, b: int) -> dict:
    """A record of ``a + b``: its prompt text (tokenized by the actor's tokenizer) and answer."""
    return {
        "prompt": " ".join(["<bos>", *str(a), "+", *str(b), "="]),
        "answer": " ".join(str(a + b)),
    }


@functools.cache
def _split_pairs(spec: ArithSpec) -> dict[str, Int[np.ndarray, "N 2"]]:
    n = 10**spec.digits
    order = np.random.default_rng([spec.seed, 7]).permutation(n * n)
    pairs = np.stack(np.divmod(order, n), axis=1)
    return {"test": pairs[: spec.num_test], "train": pairs[spec.num_test :]}


def split_pairs(spec: ArithSpec, split: str) -> Int[np.ndarray, "N 2"]:
    """Every operand pair of ``split`` (train or test), in the split's fixed order."""
    if split not in SPLITS:
        raise PromptError(f"data.prompts=arith: no split {split!r} (data.split: train or test)")
    return _split_pairs(spec)[split]


def sample_sft_pairs(spec: ArithSpec, n: int, rng: np.random.Generator) -> list[SftExample]:
    """``n`` SFT examples drawn uniformly from the whole train split, a share ``carry_drop``
    of them answered with the carry-less sum."""
    train = split_pairs(spec, "train")
    pairs, drop = train[rng.integers(0, len(train), n)], rng.random(n) < spec.carry_drop
    return [
        encode(int(a), int(b), carryless_sum(int(a), int(b)) if d else None)
        for (a, b), d in zip(pairs, drop, strict=True)
    ]


class ArithRecords:
    """One split as a record source (``data.sources``' interface): train holds its first
    ``num_train_prompts`` pairs, test all of its pairs."""

    def __init__(self, spec: ArithSpec, split: str | None):
        split = split or "train"
        pairs = split_pairs(spec, split)
        self.pairs = pairs[: spec.num_train_prompts] if split == "train" else pairs
        self.name = f"{ARITH_SOURCE}[{split}]"

    def __len__(self) -> int:
        return len(self.pairs)

    def where(self, i: int) -> str:
        return f"{self.name}: record {i}"

    def record(self, i: int) -> dict:
        return record(*map(int, self.pairs[i]))

    def records(self):
        return (self.record(i) for i in range(len(self)))
