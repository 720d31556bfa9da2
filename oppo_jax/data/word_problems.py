"""Built-in math word problems (``data.prompts: word_problems``), GSM8K-shaped.

A record's prompt is a templated problem, ``<bos> Ana has 17 apples and buys 25 more. How many
apples does Ana have now?``, and its answer a one-line rationale ending in GSM8K's marker,
``17 + 25 = 42 #### 42``, which the math verifier (``oppo_jax.rewards.math:verify``) reads as
it reads GSM8K's. Half the templates add, half subtract (the larger operand first), over
operands 0 .. 10^digits - 1. Every (template, a, b) problem belongs to one split: a seeded
permutation puts the first ``num_test`` in ``test``, the rest in ``train``.

The vocabulary is word-level with numbers written digit by digit: ``17`` is ``1`` then
``~7`` (a WordPiece continuation), so the tokenizer decodes ``42`` and ``more.`` without
spaces and the verifier sees ordinary text.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
from jaxtyping import Int
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from oppo_jax.base.errors import PromptError
from oppo_jax.data.demo_task import EOS_ID, NUM_SPECIAL, SPECIAL_TOKENS, SftExample

WORD_PROBLEMS_SOURCE = "word_problems"  # the data.prompts value
SPLITS = ("train", "test")
CONT = "~"  # prefix of a continuation piece: a digit or punctuation glued to the word before
NAMES = ("Ana", "Ben", "Carla", "Dev", "Eli", "Fay", "Gus", "Hana")
ITEMS = ("apples", "pens", "cards", "stamps", "shells", "coins", "books", "eggs")
# (operation, text): + adds b to a, - takes b from a (a >= b)
TEMPLATES = (
    ("+", "{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?"),
    ("+", "{n} picked {a} {i} in the morning and {b} in the afternoon. How many {i} in all?"),
    ("-", "{n} has {a} {i} and gives {b} to {m}. How many {i} does {n} have left?"),
    ("-", "{n} had {a} {i} and lost {b} of them. How many {i} are left?"),
)


def _template_words() -> list[str]:
    words = set()
    for _, text in TEMPLATES:
        for w in text.format(n="", m="", a="", b="", i="").split():
            stem = w.rstrip(".?")
            if stem:
                words.add(stem)
    return sorted(words)


@dataclasses.dataclass(frozen=True)
class WordProblemSpec:
    """Settings of the word-problem task."""

    digits: int = 2  # longest operand, decimal digits
    num_test: int = 512  # held-out problems (the test split)
    num_train_prompts: int = 8192  # records of the train split (the RL prompts)
    seed: int = 0  # fixes which problems are held out and the names and items drawn
    # share of SFT rationales whose sum forgets its carries (difference its borrows): the SFT
    # actor then gets the problems without one right and few others, and RL on the verified
    # answer has the carries to learn
    carry_drop: float = 0.6

    @property
    def words(self) -> tuple[str, ...]:
        """The ordinary tokens, in id order after the special ones."""
        digits = [str(d) for d in range(10)]
        glued = [CONT + d for d in digits] + [CONT + ".", CONT + "?"]
        rest = [*NAMES, *ITEMS, *_template_words(), "+", "-", "=", "####"]
        return (*digits, *glued, *dict.fromkeys(rest))

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self.words)

    @property
    def max_prompt_len(self) -> int:
        """The longest template's tokens with both operands at full length, and bos."""
        longest = max(
            len(_pieces(text.format(n="x", m="x", a="", b="", i="x"))) for _, text in TEMPLATES
        )
        return longest + 2 * self.digits + 1

    @property
    def max_response_len(self) -> int:
        """``a op b = c #### c`` with the longest operands and result, and eos."""
        return 2 * self.digits + 2 * (self.digits + 1) + 4


def _pieces(text: str) -> list[str]:
    """The tokens of ``text`` (digits and final punctuation split off)."""
    out = []
    for word in text.split():
        if word.isdigit():
            out += [word[0], *(CONT + d for d in word[1:])]
        elif word[-1] in ".?" and len(word) > 1:
            out += [word[:-1], CONT + word[-1]]
        else:
            out.append(word)
    return out


def build_tokenizer(spec: WordProblemSpec) -> Tokenizer:
    """A WordPiece tokenizer over ``spec.words`` whose continuations (``~7``, ``~.``) decode
    glued to the piece before: ``1 ~7 apples ~.`` reads ``17 apples.``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({word: NUM_SPECIAL + i for i, word in enumerate(spec.words)})
    # No unknown token: a word outside the vocabulary is an error, not a silent <unk>.
    model = models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix=CONT)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix=CONT, cleanup=False)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tokenizer


def save_tokenizer(spec: WordProblemSpec, directory: str | os.PathLike) -> None:
    """Replace the word-level tokenizer.json in ``directory`` with the task's WordPiece one."""
    build_tokenizer(spec).save(os.path.join(directory, "tokenizer.json"))


def forget_carries(a: int, b: int, op: str) -> int:
    """``a op b`` column by column with every carry (borrow) dropped: 57 + 68 -> 15,
    52 - 17 -> 45."""
    total, place = 0, 1
    while a or b:
        da, db = a % 10, b % 10
        total += ((da + db) if op == "+" else (da - db)) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return total


@functools.cache
def _split_problems(spec: WordProblemSpec) -> dict[str, Int[np.ndarray, "N 5"]]:
    """Every problem as (template, a, b, name, item), split into test and train."""
    n, rng = 10**spec.digits, np.random.default_rng([spec.seed, 11])
    t, a, b = np.meshgrid(np.arange(len(TEMPLATES)), np.arange(n), np.arange(n), indexing="ij")
    t, a, b = t.ravel(), a.ravel(), b.ravel()
    sub = np.array([op == "-" for op, _ in TEMPLATES])[t]
    a, b = np.where(sub, np.maximum(a, b), a), np.where(sub, np.minimum(a, b), b)
    keep = np.unique(np.stack([t, a, b], axis=1), axis=0)  # a subtraction's (a, b) once
    names = rng.integers(0, len(NAMES), len(keep))
    items = rng.integers(0, len(ITEMS), len(keep))
    rows = np.concatenate([keep, names[:, None], items[:, None]], axis=1)[
        rng.permutation(len(keep))
    ]
    return {"test": rows[: spec.num_test], "train": rows[spec.num_test :]}


def split_problems(spec: WordProblemSpec, split: str) -> Int[np.ndarray, "N 5"]:
    """Every problem of ``split`` (train or test) as (template, a, b, name, item) rows."""
    if split not in SPLITS:
        raise PromptError(
            f"data.prompts={WORD_PROBLEMS_SOURCE}: no split {split!r} (data.split: train or test)"
        )
    return _split_problems(spec)[split]


def question(row) -> str:
    """The problem's text (without bos)."""
    t, a, b, name, item = map(int, row)
    other = NAMES[(name + 1) % len(NAMES)]
    return TEMPLATES[t][1].format(n=NAMES[name], m=other, a=a, b=b, i=ITEMS[item])


def rationale(row, result: int | None = None) -> str:
    """``a op b = c #### c``, with ``result`` in place of the true c when given."""
    t, a, b = map(int, row[:3])
    op = TEMPLATES[t][0]
    c = (a + b if op == "+" else a - b) if result is None else result
    return f"{a} {op} {b} = {c} #### {c}"


def record(row) -> dict:
    """A problem's record: its prompt text (tokenized by the actor's tokenizer) and GSM8K-style
    answer."""
    return {"prompt": "<bos> " + question(row), "answer": rationale(row)}


def encode(tokenizer: Tokenizer, row, result: int | None = None) -> SftExample:
    """Token ids of one problem: prompt (bos, question) and response (rationale, eos)."""
    prompt = tokenizer.encode(record(row)["prompt"]).ids
    response = tokenizer.encode(rationale(row, result)).ids
    return SftExample(np.int32(prompt), np.int32([*response, EOS_ID]))


def sample_sft(spec: WordProblemSpec, n: int, rng: np.random.Generator) -> list[SftExample]:
    """``n`` SFT examples drawn uniformly from the whole train split, a share ``carry_drop`` of
    them answered with the carries forgotten."""
    train, tokenizer = split_problems(spec, "train"), _tokenizer(spec)
    rows, drop = train[rng.integers(0, len(train), n)], rng.random(n) < spec.carry_drop
    out = []
    for row, d in zip(rows, drop, strict=True):
        t, a, b = map(int, row[:3])
        out.append(encode(tokenizer, row, forget_carries(a, b, TEMPLATES[t][0]) if d else None))
    return out


@functools.cache
def _tokenizer(spec: WordProblemSpec) -> Tokenizer:
    return build_tokenizer(spec)


class WordProblemRecords:
    """One split as a record source (``data.sources``' interface): train holds its first
    ``num_train_prompts`` problems, test all of its problems."""

    def __init__(self, spec: WordProblemSpec, split: str | None):
        split = split or "train"
        rows = split_problems(spec, split)
        self.rows = rows[: spec.num_train_prompts] if split == "train" else rows
        self.name = f"{WORD_PROBLEMS_SOURCE}[{split}]"

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        return f"{self.name}: record {i}"

    def record(self, i: int) -> dict:
        return record(self.rows[i])

    def records(self):
        return (self.record(i) for i in range(len(self)))
