"""Built-in demo task: a synthetic "make the continuation positive" with long-tailed lengths.

The vocabulary is four special tokens followed by words ``w0 … w{N-1}``; each word carries a
hidden sentiment in [-1, 1] (a seeded permutation of an evenly spaced, zero-mean grid). The
gold score of a response is the mean sentiment of its words, so it does not depend on length.

Response process (shared by the SFT corpus and the preference pairs):

* with probability ``long_prob`` a response is in *long* mode, otherwise *short*;
* the first word of a long response is one of ``num_long_markers`` "long-marker" words (the
  words whose sentiment is closest to zero); short responses never start with one, and marker
  words never appear elsewhere, so a policy sees its mode from the first response token;
* every response has at least one word; after each word it stops with probability
  ``stop_prob_short`` or ``stop_prob_long`` (a geometric length), capped so that the words
  plus the closing ``<eos>`` fit in ``max_response_len`` tokens;
* the non-first words are uniform over the non-marker words, so the mean gold is near 0 and
  RL has room to push it up.

With the defaults the response length (words + eos) has median 7–8 and p99 ≈ 55 tokens.
"""

import dataclasses
import json
import os
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
from jaxtyping import Float, Int
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
SEP_ID = 3
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<sep>")  # in id order
NUM_SPECIAL = len(SPECIAL_TOKENS)

TokenIds = Int[np.ndarray, " _"]  # one variable-length token sequence


@runtime_checkable
class WordTask(Protocol):
    """A built-in task over a word-level vocabulary: this demo's, or the addition task's."""

    @property
    def words(self) -> tuple[str, ...]: ...  # ordinary tokens, in id order after the specials

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_prompt_len(self) -> int: ...

    @property
    def max_response_len(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class DemoTaskSpec:
    """Settings of the synthetic demo task (vocabulary, prompts, length mixture)."""

    num_words: int = 48  # number of ordinary words w0..w{N-1}; vocab size is 4 + this
    prompt_len_range: tuple[int, int] = (3, 8)  # inclusive range of words per prompt
    max_response_len: int = 64  # most response tokens, counting the closing <eos>
    seed: int = 0  # fixes the hidden word sentiments (and so the long-marker words)
    long_prob: float = 0.15  # probability that a response is in long mode
    stop_prob_short: float = 0.12  # per-word stop probability in short mode (mean 8.3 words)
    stop_prob_long: float = 0.05  # per-word stop probability in long mode (mean 20 words)
    num_long_markers: int = 4  # words that open long responses; even keeps gold symmetric

    def __post_init__(self):
        lo, hi = self.prompt_len_range
        checks = {
            "num_words": self.num_words > self.num_long_markers,
            "prompt_len_range": 1 <= lo <= hi,
            "max_response_len": self.max_response_len >= 2,
            "long_prob": 0.0 <= self.long_prob <= 1.0,
            "stop_prob_short": 0.0 < self.stop_prob_short <= 1.0,
            "stop_prob_long": 0.0 < self.stop_prob_long <= 1.0,
            "num_long_markers": self.num_long_markers >= 1 and self.num_long_markers % 2 == 0,
        }
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"DemoTaskSpec.{key} has an invalid value: {getattr(self, key)}")

    @property
    def words(self) -> tuple[str, ...]:
        """The ordinary tokens, in id order after the special ones."""
        return tuple(word_token(i) for i in range(self.num_words))

    @property
    def vocab_size(self) -> int:
        """Special tokens plus words."""
        return NUM_SPECIAL + self.num_words

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt in tokens: bos + words + sep."""
        return self.prompt_len_range[1] + 2


class SftExample(NamedTuple):
    """One SFT pair: prompt (bos … sep) and response (words … eos)."""

    prompt: np.ndarray
    response: np.ndarray


class PreferencePair(NamedTuple):
    """One Bradley–Terry pair: a prompt and two responses, ``chosen`` with the higher gold."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


def word_token(i: int) -> str:
    """The surface form of word ``i``."""
    return f"w{i}"


def build_tokenizer(spec: WordTask) -> Tokenizer:
    """A WordLevel tokenizer over ``spec.words`` (the demo's, or another built-in task's),
    splitting on whitespace."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({word: NUM_SPECIAL + i for i, word in enumerate(spec.words)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Registered as special so they are matched in text and skipped by skip_special_tokens.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tokenizer


def save_tokenizer(spec: WordTask, directory: str | os.PathLike) -> None:
    """Write the task's tokenizer in Hugging Face format (tokenizer.json + two config files)."""
    os.makedirs(directory, exist_ok=True)
    build_tokenizer(spec).save(os.path.join(directory, "tokenizer.json"))
    special = {
        "pad_token": "<pad>",
        "eos_token": "<eos>",
        "bos_token": "<bos>",
        "sep_token": "<sep>",
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": spec.max_prompt_len + spec.max_response_len,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        with open(os.path.join(directory, name), "w") as f:
            json.dump(content, f, indent=2)


def load_tokenizer(
    directory: str | os.PathLike, probe: str = "<bos> w0 <sep> w1 <eos>"
) -> PreTrainedTokenizerFast:
    """Load a project-made tokenizer and check that ``probe`` round-trips.

    Uses ``PreTrainedTokenizerFast`` rather than ``AutoTokenizer``, which builds a byte-level
    tokenizer and ignores a custom tokenizer.json when a ``config.json`` says ``qwen2``. The
    expected ids come from the tokenizer.json itself, read with the ``tokenizers`` library.
    """
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    try:
        expected = Tokenizer.from_file(os.path.join(directory, "tokenizer.json")).encode(probe).ids
        ids = tokenizer.encode(probe, add_special_tokens=False)
    except Exception as e:  # the tokenizers library raises a bare Exception for unknown words
        raise ValueError(f"tokenizer in {directory} cannot encode probe {probe!r}: {e}") from e
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if list(ids) != list(expected) or text != probe:
        raise ValueError(
            f"tokenizer in {directory} does not round-trip {probe!r}: got ids {ids} "
            f"(tokenizer.json gives {expected}) decoding to {text!r}"
        )
    return tokenizer


def word_sentiments(spec: DemoTaskSpec) -> Float[np.ndarray, " N"]:
    """Hidden sentiment of each word: a seeded permutation of ``linspace(-1, 1, N)``."""
    grid = np.linspace(-1.0, 1.0, spec.num_words)
    return np.random.default_rng(spec.seed).permutation(grid)


def long_marker_words(spec: DemoTaskSpec) -> Int[np.ndarray, " M"]:
    """Word indices (not token ids) that open long responses: those nearest zero sentiment."""
    order = np.argsort(np.abs(word_sentiments(spec)), kind="stable")
    return np.sort(order[: spec.num_long_markers])


def _sentiment_table(spec: DemoTaskSpec) -> np.ndarray:
    """Sentiment per token id, 0 for special tokens."""
    return np.concatenate([np.zeros(NUM_SPECIAL), word_sentiments(spec)])


def gold_scores(
    responses: Int[np.ndarray, "B T"], lengths: Int[np.ndarray, " B"], spec: DemoTaskSpec
) -> Float[np.ndarray, " B"]:
    """Mean word sentiment before the first eos within ``lengths``; 0.0 where there is none."""
    responses = np.asarray(responses)
    if responses.size and (responses.min() < 0 or responses.max() >= spec.vocab_size):
        raise ValueError(f"response ids must lie in [0, {spec.vocab_size})")
    positions = np.arange(responses.shape[1])[None, :]
    in_length = positions < np.asarray(lengths)[:, None]
    before_eos = np.cumsum((responses == EOS_ID) & in_length, axis=1) == 0
    counted = in_length & before_eos & (responses >= NUM_SPECIAL)
    total = np.where(counted, _sentiment_table(spec)[responses], 0.0).sum(axis=1)
    count = counted.sum(axis=1)
    return np.where(count > 0, total / np.maximum(count, 1), 0.0)


def gold_score(response_ids: Int[np.ndarray, " T"], spec: DemoTaskSpec) -> float:
    """Gold score of one response (mean word sentiment before the first eos, 0.0 if none)."""
    ids = np.asarray(response_ids).reshape(1, -1)
    return float(gold_scores(ids, np.array([ids.shape[1]]), spec)[0])


def sample_prompts(spec: DemoTaskSpec, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``n`` prompts, each ``<bos>`` + uniform random words + ``<sep>`` (int32)."""
    lo, hi = spec.prompt_len_range
    lengths = rng.integers(lo, hi + 1, size=n)
    return [
        np.concatenate(
            [[BOS_ID], NUM_SPECIAL + rng.integers(0, spec.num_words, k), [SEP_ID]]
        ).astype(np.int32)
        for k in lengths
    ]


def _sample_responses(spec: DemoTaskSpec, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``n`` responses (words + eos, int32) from the long-tailed process in the module doc."""
    markers = long_marker_words(spec)
    others = np.setdiff1d(np.arange(spec.num_words), markers)
    is_long = rng.random(n) < spec.long_prob
    stop = np.where(is_long, spec.stop_prob_long, spec.stop_prob_short)
    num_words = np.minimum(rng.geometric(stop), spec.max_response_len - 1)
    first = np.where(
        is_long, markers[rng.integers(0, len(markers), n)], others[rng.integers(0, len(others), n)]
    )
    responses = []
    for k, w in zip(num_words, first, strict=True):
        rest = others[rng.integers(0, len(others), k - 1)]
        responses.append(np.concatenate([[w], rest]) + NUM_SPECIAL)
    return [np.append(r, EOS_ID).astype(np.int32) for r in responses]


def sample_sft_corpus(spec: DemoTaskSpec, n: int, rng: np.random.Generator) -> list[SftExample]:
    """``n`` SFT pairs; responses are independent of the prompt and long-tailed in length."""
    prompts = sample_prompts(spec, n, rng)
    responses = _sample_responses(spec, n, rng)
    return [SftExample(p, r) for p, r in zip(prompts, responses, strict=True)]


def sample_preference_pairs(
    spec: DemoTaskSpec, n: int, rng: np.random.Generator
) -> list[PreferencePair]:
    """``n`` pairs of two independent responses to one prompt, labelled by gold (ties skipped).

    The sentiment grid and marker set are symmetric about zero, so the gold difference of two
    responses is symmetric whatever their lengths: which one is chosen says nothing of length.
    """
    pairs: list[PreferencePair] = []
    while len(pairs) < n:
        need = n - len(pairs)
        prompts = sample_prompts(spec, need, rng)
        a, b = _sample_responses(spec, need, rng), _sample_responses(spec, need, rng)
        for prompt, ra, rb in zip(prompts, a, b, strict=True):
            ga, gb = gold_score(ra, spec), gold_score(rb, spec)
            if abs(ga - gb) > 1e-9:
                pairs.append(PreferencePair(prompt, *((ra, rb) if ga > gb else (rb, ra))))
    return pairs


def pad_batch(
    seqs: list[np.ndarray], pad_id: int, length: int | None = None
) -> tuple[Int[np.ndarray, "B T"], Int[np.ndarray, " B"]]:
    """Right-pad sequences into one int32 array; returns (ids[B, T], lengths[B]).

    ``T`` is ``length`` if given (a longer sequence is an error), else the longest sequence.

    >>> ids, lengths = pad_batch([np.array([5, 6, 1]), np.array([7])], pad_id=0)
    >>> ids.tolist()
    [[5, 6, 1], [7, 0, 0]]
    >>> lengths.tolist()
    [3, 1]
    """
    if not seqs:
        raise ValueError("pad_batch needs at least one sequence")
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    width = int(lengths.max()) if length is None else length
    if lengths.max() > width:
        i = int(np.argmax(lengths > width))
        raise ValueError(f"sequence {i} has length {lengths[i]} > pad length {width}")
    ids = np.full((len(seqs), width), pad_id, dtype=np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    return ids, lengths
