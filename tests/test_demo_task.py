"""Tests for the demo task (tokenizer, corpus statistics, gold, pairs) and the prompt sources."""

import doctest
import json
import sys

import numpy as np
import pytest

from oppo_jax.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SEP_ID,
    DemoTaskSpec,
    PromptIterator,
    demo_task,
    gold_score,
    gold_scores,
    load_prompt_file,
    load_tokenizer,
    long_marker_words,
    pad_batch,
    sample_preference_pairs,
    sample_prompts,
    sample_sft_corpus,
    save_tokenizer,
    tokenize_prompts,
    word_sentiments,
)

SPEC = DemoTaskSpec()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A saved demo tokenizer with a qwen2 config.json beside it (the AutoTokenizer pitfall)."""
    directory = tmp_path_factory.mktemp("tok")
    save_tokenizer(SPEC, directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return directory


@pytest.fixture(scope="module")
def corpus():
    return sample_sft_corpus(SPEC, 4000, np.random.default_rng(0))


def test_tokenizer_round_trip_despite_qwen2_config(tokenizer_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tokenizer_dir / name).exists()
    tok = load_tokenizer(tokenizer_dir)
    ids = tok.encode("w4 w5 <eos>", add_special_tokens=False)
    assert ids == [4 + 4, 4 + 5, 1]
    assert tok.decode(ids) == "w4 w5 <eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "w4 w5"
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (PAD_ID, EOS_ID, BOS_ID)
    assert tok.convert_tokens_to_ids("<sep>") == SEP_ID
    assert len(tok) == SPEC.vocab_size == 52


def test_load_tokenizer_rejects_foreign_vocab(tmp_path):
    save_tokenizer(DemoTaskSpec(num_words=8), tmp_path)
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_tokenizer(tmp_path, probe="w0 w9 <eos>")


def test_corpus_lengths_are_long_tailed(corpus):
    lengths = np.array([len(ex.response) for ex in corpus])
    median, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert 6 <= median <= 10
    assert 40 <= p99 <= 64
    assert p99 >= 4 * median
    assert lengths.max() <= SPEC.max_response_len
    assert all(ex.response[-1] == EOS_ID and EOS_ID not in ex.response[:-1] for ex in corpus)


def test_long_marker_first_word_signals_long_mode(corpus):
    markers = set((long_marker_words(SPEC) + demo_task.NUM_SPECIAL).tolist())
    first = np.array([ex.response[0] in markers for ex in corpus])
    lengths = np.array([len(ex.response) for ex in corpus])
    assert 0.11 < first.mean() < 0.19
    assert np.median(lengths[first]) > 2 * np.median(lengths[~first])
    # Markers appear only as the first response word.
    assert not any(markers & set(ex.response[1:].tolist()) for ex in corpus)


def test_corpus_gold_near_zero_with_room_to_improve(corpus):
    gold = np.array([gold_score(ex.response, SPEC) for ex in corpus])
    assert abs(gold.mean()) < 0.15
    assert (gold > 0.5).mean() > 0.01
    assert gold.max() > 0.8


def test_prompts_shape():
    spec = DemoTaskSpec(prompt_len_range=(3, 5))
    prompts = sample_prompts(spec, 200, np.random.default_rng(1))
    assert {len(p) for p in prompts} == {5, 6, 7}
    for p in prompts:
        assert p[0] == BOS_ID and p[-1] == SEP_ID and p.dtype == np.int32
        assert np.all((p[1:-1] >= 4) & (p[1:-1] < spec.vocab_size))


def test_word_sentiments_deterministic_and_bounded():
    s = word_sentiments(SPEC)
    assert s.shape == (48,) and np.all(np.abs(s) <= 1.0)
    np.testing.assert_array_equal(s, word_sentiments(DemoTaskSpec()))
    assert not np.array_equal(s, word_sentiments(DemoTaskSpec(seed=1)))


def test_gold_score_hand_made():
    s = word_sentiments(SPEC)
    w = lambda i: demo_task.NUM_SPECIAL + i  # noqa: E731
    response = np.array([w(0), w(3), w(7), EOS_ID, w(10), PAD_ID])
    assert gold_score(response, SPEC) == pytest.approx((s[0] + s[3] + s[7]) / 3)
    assert gold_score(np.array([w(5), w(6)]), SPEC) == pytest.approx((s[5] + s[6]) / 2)
    assert gold_score(np.array([EOS_ID, w(2)]), SPEC) == 0.0
    assert gold_score(np.array([], dtype=np.int32), SPEC) == 0.0
    ids, lengths = pad_batch([response, np.array([w(5), w(6)]), np.array([EOS_ID])], PAD_ID)
    # A length cut also ends the response: only w0 is within length 1.
    lengths[0] = 1
    np.testing.assert_allclose(gold_scores(ids, lengths, SPEC), [s[0], (s[5] + s[6]) / 2, 0.0])
    with pytest.raises(ValueError):
        gold_score(np.array([SPEC.vocab_size]), SPEC)


def test_preference_pairs_labelled_by_gold_and_length_neutral():
    pairs = sample_preference_pairs(SPEC, 2000, np.random.default_rng(2))
    assert len(pairs) == 2000
    gc = np.array([gold_score(p.chosen, SPEC) for p in pairs])
    gr = np.array([gold_score(p.rejected, SPEC) for p in pairs])
    assert np.all(gc > gr)
    lc = np.array([len(p.chosen) for p in pairs])
    lr = np.array([len(p.rejected) for p in pairs])
    assert 0.4 <= (lc > lr).mean() <= 0.6
    assert 0.45 <= (lc > lr)[lc != lr].mean() <= 0.55
    assert all(p.prompt[0] == BOS_ID and p.prompt[-1] == SEP_ID for p in pairs)


def test_pad_batch_and_doctest():
    ids, lengths = pad_batch([np.array([5, 6]), np.array([7, 8, 9])], pad_id=0, length=4)
    np.testing.assert_array_equal(ids, [[5, 6, 0, 0], [7, 8, 9, 0]])
    np.testing.assert_array_equal(lengths, [2, 3])
    assert ids.dtype == np.int32 and lengths.dtype == np.int32
    with pytest.raises(ValueError, match="sequence 1"):
        pad_batch([np.array([5]), np.array([7, 8, 9])], pad_id=0, length=2)
    assert doctest.testmod(demo_task).failed == 0


def _prompts(n):
    return [np.array([BOS_ID, 4 + i, SEP_ID], dtype=np.int32) for i in range(n)]


def test_prompt_iterator_epochs_and_ids():
    it = PromptIterator(_prompts(7), seed=3)
    first, second = it.take(7), it.take(7)
    assert sorted(i for i, _ in first) == list(range(7))
    assert sorted(i for i, _ in second) == list(range(7, 14))
    for prompt_id, tokens in first + second:
        assert tokens[1] == 4 + prompt_id % 7
    assert [i % 7 for i, _ in first] != [i % 7 for i, _ in second]
    assert it.state() == {"epoch": 2, "position": 0}


def test_prompt_iterator_resume_and_seeds():
    prompts = _prompts(10)
    it = PromptIterator(prompts, seed=5)
    it.take(13)
    state = it.state()
    assert state == {"epoch": 1, "position": 3}
    expected = [i for i, _ in it.take(20)]
    resumed = PromptIterator.from_state(prompts, 5, json.loads(json.dumps(state)))
    assert [i for i, _ in resumed.take(20)] == expected
    same = [i for i, _ in PromptIterator(prompts, seed=5).take(10)]
    assert same == [i for i, _ in PromptIterator(prompts, seed=5).take(10)]
    assert same != [i for i, _ in PromptIterator(prompts, seed=6).take(10)]
    with pytest.raises(ValueError, match="position"):
        PromptIterator.from_state(prompts, 5, {"epoch": 0, "position": 11})


def test_load_prompt_file_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "w1 w2"}\n\n{"prompt": "w3", "other": 1}\n')
    assert load_prompt_file(path) == ["w1 w2", "w3"]
    alt = tmp_path / "q.jsonl"
    alt.write_text('{"text": "w9"}\n')
    assert load_prompt_file(alt, field="text") == ["w9"]


def test_load_prompt_file_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl"):
        load_prompt_file(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1"}\n{"prompt": "w2"\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2"):
        load_prompt_file(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"prompt": "w1"}\n{"text": "w2"}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_prompt_file(missing)


def test_load_parquet_without_pyarrow_says_install(tmp_path, monkeypatch):
    # A None entry in sys.modules makes `import pyarrow` raise ImportError, as if absent (the
    # test extras install it, so CI would otherwise never see this path).
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_prompt_file(tmp_path / "p.parquet")


def test_tokenize_prompts_truncate_and_reject(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    texts = ["<bos> w1 <sep>", "<bos> w1 w2 w3 w4 <sep>", "<bos> w5 w6 w7 <sep>"]
    with pytest.warns(UserWarning, match="truncated 2 of 3"):
        ids, truncated = tokenize_prompts(texts, tok, max_prompt_len=4)
    assert truncated == 2
    assert ids[0].tolist() == [BOS_ID, 5, SEP_ID]
    assert ids[1].tolist() == [6, 7, 8, SEP_ID]  # the last tokens are kept
    with pytest.raises(ValueError, match="prompt 1 has 6 tokens"):
        tokenize_prompts(texts, tok, max_prompt_len=5, on_too_long="reject")
    raw, none_cut = tokenize_prompts(texts[:1], demo_task.build_tokenizer(SPEC), 4)
    assert none_cut == 0 and raw[0].tolist() == [BOS_ID, 5, SEP_ID]
