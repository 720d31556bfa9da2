"""Fuzzing what users hand us: config files and prompt files get either a correct result or an
``InputError`` that names the file, never a traceback from deep inside (docs/RELIABILITY.md)."""

import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oppo_jax.base.errors import InputError
from oppo_jax.config import Config, load_config, validate
from oppo_jax.data.demo_task import DemoTaskSpec, save_tokenizer
from oppo_jax.data.prompts import load_prompt_file, tokenize_prompts
from oppo_jax.models.tokenizer import load_tokenizer

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
MAX_PROMPT_LEN = 8

# Text that stresses decoders and tokenizers: control characters, combining marks, RTL,
# surrogate-free astral planes, BOMs, NULs, and the demo vocabulary's own words.
ODD_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=40),
    st.lists(
        st.sampled_from(["w1", "w2", "w47", "<eos>", "<sep>", "w99", "", " "]), max_size=30
    ).map(" ".join),
    st.sampled_from(["\ufeffw1", "w1\x00w2", "\u202ew3", "e\u0301", "\U0001f600", "w1\r\nw2"]),
    st.just("w1 " * 5000),  # a huge line
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    save_tokenizer(DemoTaskSpec(), directory)
    return load_tokenizer(directory)


def _load_and_tokenize(path: Path, tokenizer, on_too_long: str):
    """What run set-up does with a prompt file; returns the prompts or the InputError."""
    try:
        texts = load_prompt_file(path)
        return tokenize_prompts(texts, tokenizer, MAX_PROMPT_LEN, on_too_long, source=str(path))
    except InputError as e:
        assert str(path) in str(e), f"the error does not name the file: {e}"
        return e


def _check_prompts(result, on_too_long: str) -> None:
    if isinstance(result, InputError):
        return
    prompts, truncated = result
    assert prompts and all(p.dtype == np.int32 and 0 < len(p) <= MAX_PROMPT_LEN for p in prompts)
    assert on_too_long == "truncate" or truncated == 0


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(["truncate", "reject"]))
def test_random_bytes_as_a_prompt_file(tokenizer, data, on_too_long):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.jsonl"
        path.write_bytes(data)
        with warnings.catch_warnings(action="ignore"):  # truncation warnings: tested elsewhere
            _check_prompts(_load_and_tokenize(path, tokenizer, on_too_long), on_too_long)


_RECORD = st.one_of(
    st.fixed_dictionaries({"prompt": ODD_TEXT}),
    st.fixed_dictionaries({"prompt": st.one_of(st.none(), st.integers(), st.lists(st.text()))}),
    st.fixed_dictionaries({"other": st.text(max_size=5)}),
    st.just({}),
    st.text(max_size=10),  # a JSON string, not an object
)


@FUZZ
@given(
    st.lists(st.one_of(_RECORD.map(json.dumps), st.sampled_from(["", "   ", "{", "[]"])),
             max_size=8),
    st.sampled_from(["truncate", "reject"]),
)  # fmt: skip
def test_odd_records_in_a_prompt_file(tokenizer, lines, on_too_long):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prompts.jsonl"
        path.write_text("\n".join(lines), encoding="utf-8")
        with warnings.catch_warnings(action="ignore"):
            _check_prompts(_load_and_tokenize(path, tokenizer, on_too_long), on_too_long)


def _load_config_file(text: str | bytes):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
        try:
            cfg = load_config(path)
        except InputError as e:
            assert str(e)
            return e
    validate(cfg)
    assert isinstance(cfg, Config)
    return cfg


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300)))
def test_random_config_files(text):
    _load_config_file(text)


_SECTIONS = ["seed", "model", "rollout", "ppo", "optim", "mesh", "pipeline", "train", "data", "x"]
_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20),
    st.lists(st.integers(-5, 100), max_size=3),
)  # fmt: skip
_TREES = st.recursive(
    _LEAVES, lambda inner: st.dictionaries(st.text(max_size=14), inner, max_size=4), max_leaves=8
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(_SECTIONS),
        st.one_of(_TREES, st.dictionaries(st.sampled_from(
            ["batch_size", "chunk_size", "overcommit", "steps", "kl_coef", "prompts", "mode",
             "max_response_len", "data", "fsdp", "temperature", "dtype"]), _LEAVES, max_size=4)),
        max_size=5,
    )
)  # fmt: skip
def test_structured_random_config_files(tree):
    _load_config_file(yaml.safe_dump(tree, allow_unicode=True))
