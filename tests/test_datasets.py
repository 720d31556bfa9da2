"""User prompt sources (issue #17 part 1): JSONL, parquet, `datasets` save_to_disk directories,
local Hub-cache names and chat conversations, through the real `datasets` and tokenizer code;
each bad source is one clear error naming the key, and the command exits 2 writing nothing."""

import json
import os

import numpy as np
import pytest

from oppo_jax.base.errors import EXIT_BAD_INPUT, PromptError
from oppo_jax.cli import main as cli_main
from oppo_jax.data.demo_task import BOS_ID, NUM_SPECIAL, SEP_ID, DemoTaskSpec, save_tokenizer
from oppo_jax.data.prompt_set import PromptFormat, load_prompt_set
from oppo_jax.data.prompts import PromptIterator
from oppo_jax.data.sources import open_source
from oppo_jax.demo.assets import ensure_demo_assets
from oppo_jax.models.tokenizer import load_tokenizer
from tests.run_fixtures import small_demo_args, small_demo_config

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# A chat template over the demo vocabulary: "<bos> w1 w2 <sep>" is what the demo actor follows.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<bos> {{ m['content'] }} {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<sep>{% endif %}"
)
TEXTS = ["w1 w2", "w3", "w4 w5 w6", "w7 w8", "w9"]


def word_ids(text: str) -> list[int]:
    """The demo tokenizer's ids of 'w<i> ...', computed from the vocabulary layout."""
    return [NUM_SPECIAL + int(w[1:]) for w in text.split()]


def add_chat_template(directory) -> None:
    path = os.path.join(directory, "tokenizer_config.json")
    config = json.load(open(path))
    config["chat_template"] = CHAT_TEMPLATE
    json.dump(config, open(path, "w"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    save_tokenizer(DemoTaskSpec(), directory)
    add_chat_template(directory)
    return load_tokenizer(directory)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _load(spec, tokenizer, fmt=None, split=None, max_len=16, on_too_long="truncate"):
    fmt = fmt or PromptFormat()
    return load_prompt_set(str(spec), tokenizer, max_len, on_too_long, fmt, split)


def _as_lists(prompts):
    return [p.tolist() for p in prompts]


def test_jsonl_parquet_and_saved_dataset_give_the_same_prompts(tokenizer, tmp_path):
    records = [{"prompt": t, "id": i} for i, t in enumerate(TEXTS)]
    expected = [word_ids(t) for t in TEXTS]
    jsonl = _jsonl(tmp_path / "p.jsonl", records)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet, row_group_size=2)  # 3 row groups
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    for spec in (jsonl, parquet, saved):
        prompts, truncated = _load(spec, tokenizer)
        assert _as_lists(prompts) == expected and truncated == 0, spec
        # the dataset record of any prompt, read on demand (row group / offset / arrow row)
        assert prompts.record(3) == records[3] and prompts.record(0) == records[0], spec


def test_saved_dataset_dict_split_and_field(tokenizer, tmp_path):
    train = [{"question": t} for t in TEXTS[:3]]
    test = [{"question": t} for t in TEXTS[3:]]
    saved = tmp_path / "dd"
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list(train), test=datasets.Dataset.from_list(test)
    )
    dd.save_to_disk(str(saved))
    fmt = PromptFormat(prompt_field="question")
    prompts, _ = _load(saved, tokenizer, fmt, split="test")
    assert _as_lists(prompts) == [word_ids(t) for t in TEXTS[3:]]
    with pytest.raises(PromptError, match=r"no split 'valid' \(data.split; the splits are train"):
        _load(saved, tokenizer, fmt, split="valid")


def test_hub_cache_name_is_read_locally_and_a_missing_one_says_what_to_fetch(
    tokenizer, tmp_path, monkeypatch
):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds_cache"))
    repo = tmp_path / "hub" / "datasets--someorg--tiny"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    data = repo / "snapshots" / revision / "data"
    data.mkdir(parents=True)
    _jsonl(data / "train.jsonl", [{"prompt": t} for t in TEXTS])
    prompts, _ = _load("someorg/tiny", tokenizer, split="train")
    assert _as_lists(prompts) == [word_ids(t) for t in TEXTS]
    with pytest.raises(PromptError, match=r"no dataset 'someorg/absent'.*--repo-type dataset"):
        _load("someorg/absent", tokenizer)


def test_chat_messages_through_the_tokenizer_chat_template(tokenizer, tmp_path):
    convs = [[{"role": "system", "content": "w40"}, {"role": "user", "content": t}] for t in TEXTS]
    saved = tmp_path / "chat"
    datasets.Dataset.from_list([{"messages": c} for c in convs]).save_to_disk(str(saved))
    fmt = PromptFormat(messages_field="messages", chat_template=True)
    prompts, _ = _load(saved, tokenizer, fmt)
    for conv, text, got in zip(convs, TEXTS, prompts, strict=True):
        # independent references: the tokenizer's own templating, and the ids by hand
        ref = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert got.tolist() == list(ref) == [BOS_ID, *word_ids(text), SEP_ID]


def test_truncation_keeps_the_last_tokens_and_reject_names_the_key(tokenizer, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "w1 w2 w3 w4 w5"}, {"prompt": "w6"}])
    with pytest.warns(UserWarning, match="truncated 1 of 2"):
        prompts, truncated = _load(path, tokenizer, max_len=3)
    assert _as_lists(prompts) == [word_ids("w3 w4 w5"), word_ids("w6")] and truncated == 1
    with pytest.raises(PromptError, match=r"prompt 0 has 5 tokens.*prompt_too_long=reject"):
        _load(path, tokenizer, max_len=3, on_too_long="reject")


def test_a_jsonl_source_is_indexed_not_held(tmp_path):
    lines = [json.dumps({"prompt": f"w{i % 40}"}) for i in range(2000)]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines[:1000]) + "\n\n" + "\n".join(lines[1000:]) + "\n")
    source = open_source(str(path))
    assert len(source) == 2000 and source.record(1500) == json.loads(lines[1500])
    assert source.where(1000) == f"{path}: line 1002"  # the blank line is counted
    assert not hasattr(source, "_text")  # only offsets are kept
    assert source._offsets.nbytes == 8 * 2000


@pytest.mark.parametrize(
    ("records", "fmt", "error"),
    [
        ([{"text": "w1"}], PromptFormat(), r"line 1: no field 'prompt' \(data.prompt_field"),
        ([{"prompt": 3}], PromptFormat(), r"'prompt' \(data.prompt_field\) is int, not a string"),
        (
            [{"messages": "w1"}],
            PromptFormat(messages_field="messages", chat_template=True),
            r"'messages' \(data.messages_field\) must be a non-empty list",
        ),
        ([], PromptFormat(), r"no prompts found \(the source is empty; data.prompts\)"),
    ],
)
def test_bad_records_are_one_clear_error(tokenizer, tmp_path, records, fmt, error):
    for kind in ("jsonl", "saved"):
        if kind == "saved" and not records:
            spec = tmp_path / "empty_saved"
            datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(spec))
        elif kind == "saved":
            spec = tmp_path / f"saved{len(os.listdir(tmp_path))}"
            datasets.Dataset.from_list(records).save_to_disk(str(spec))
        else:
            spec = _jsonl(tmp_path / "bad.jsonl", records)
        err = error.replace("line 1", "row 0") if kind == "saved" else error
        with pytest.raises(PromptError, match=err):
            _load(spec, tokenizer, fmt)


def test_iterator_over_a_prompt_set_resumes_exactly(tokenizer, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"w{i}"} for i in range(7)])
    prompts, _ = _load(path, tokenizer)
    whole = PromptIterator(prompts, seed=3).take(17)
    first = PromptIterator(prompts, seed=3)
    head = first.take(9)
    rest = PromptIterator.from_state(prompts, 3, json.loads(json.dumps(first.state()))).take(8)
    assert [(i, t.tolist()) for i, t in head + rest] == [(i, t.tolist()) for i, t in whole]


# ------------------------------------------------------------------ the command


@pytest.fixture(scope="module")
def demo_dirs(demo_cache):
    cfg = small_demo_config()
    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    steps = cfg.train.sft_steps, cfg.train.rm_steps
    return ensure_demo_assets(demo_cache / "demo", spec, *steps, progress=False)


@pytest.mark.slow  # builds the small demo assets when the session has not
def test_cli_bad_dataset_exits_2_and_writes_nothing(demo_dirs, tmp_path, capsys):
    actor, reward = demo_dirs
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": "w1"}]).save_to_disk(str(saved))
    cases = {
        "missing field": ([f"data.prompts={saved}"], "no field 'prompt' (data.prompt_field"),
        "wrong split": ([f"data.prompts={saved}", "data.split=test"], "data.split"),
        "no chat template": (
            [f"data.prompts={saved}", "data.prompt_field=text", "data.chat_template=true"],
            "has no chat template",
        ),
        "bad key value": (["data.messages_field=m"], "data.messages_field='m': needs"),
    }
    for name, (extra, message) in cases.items():
        out = tmp_path / name.replace(" ", "_")
        args = small_demo_args(f"model.actor_path={actor}", f"model.reward_path={reward}", *extra)
        code = cli_main(["train", "--out", str(out), "--quiet", "--set", *args])
        err = capsys.readouterr().err
        assert code == EXIT_BAD_INPUT and message in err and "Traceback" not in err, (name, err)
        assert not out.exists() or not any(out.rglob("*")), name


def test_prompt_set_is_flat(tokenizer, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": t} for t in TEXTS])
    prompts, _ = _load(path, tokenizer)
    assert prompts._tokens.dtype == np.int32 and prompts._tokens.size == sum(
        len(word_ids(t)) for t in TEXTS
    )
