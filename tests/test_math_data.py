"""Math data as users have it (issue 45): GSM8K-shaped (``question``, ``answer`` ending in
``#### n``) and MATH-shaped (``problem``, ``solution`` with ``\\boxed{}``) records from JSONL,
parquet and ``datasets`` directories, the field keys, the reference answer extracted once at
load, and the tokenizer's chat template with ``data.system_prompt``; then a GSM8K-shaped
JSONL trained end to end with the verifier and the chat template."""

import json
import re
from pathlib import Path

import pytest

from oppo_jax.base.errors import ConfigError, PromptError
from oppo_jax.config import load_config
from oppo_jax.data.answers import after_hashes, last_boxed, reference_answer
from oppo_jax.data.prompt_set import PromptFormat, load_prompt_set
from oppo_jax.models.tokenizer import load_tokenizer

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# A Qwen-like template in plain-text tags (they survive decoding with special tokens skipped).
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SYSTEM = "Reason step by step, then give the final answer after ####."
GSM8K = [
    {"question": "Ana has 17 apples and buys 25 more. How many?", "answer": "17+25=42\n#### 42"},
    {"question": "A car costs 1,200 and a bike 34. Total?", "answer": "1200+34=1234\n#### 1,234"},
    {"question": "Half of 7?", "answer": "7/2 = <<7/2=3.5>>3.5\n#### 3.5"},
]
MATH = [
    {"problem": "Simplify $2/4$.", "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Solve $x^2=4$.", "solution": "So $x = \\boxed{-2, 2}$."},
    {"problem": "What is $\\sin 60^\\circ$?", "solution": "$\\boxed{\\frac{\\sqrt{3}}{2}}$"},
]
GSM8K_REFERENCES = ["42", "1234", "3.5"]
MATH_REFERENCES = ["\\frac{1}{2}", "-2, 2", "\\frac{\\sqrt{3}}{2}"]


def byte_tokenizer(directory: Path, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level tokenizer (259 tokens: <pad> 0, <eos> 1, <bos> 2, then the 256 bytes) that
    reads any text, saved as a Hugging Face tokenizer directory; returns it loaded back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return load_tokenizer(directory)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return byte_tokenizer(tmp_path_factory.mktemp("tok"))


def sources(directory: Path, records: list[dict]) -> list[Path]:
    """The records as a JSONL file, a parquet file (row groups of 2) and a saved dataset."""
    jsonl = directory / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    parquet = directory / "data.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet, row_group_size=2)
    saved = directory / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    return [jsonl, parquet, saved]


def load(spec, tokenizer, fmt: PromptFormat, max_len: int = 256):
    prompts, truncated = load_prompt_set(str(spec), tokenizer, max_len, "reject", fmt)
    assert truncated == 0
    return prompts


def text(tokenizer, ids) -> str:
    return tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)


def test_answers_reduce_to_the_bare_reference():
    assert after_hashes("a\n#### 1,234,567\nrest") == "1234567"
    assert after_hashes("#### 1,23") == "1,23"  # not a thousands separator: kept
    assert after_hashes("no marker") is None
    assert last_boxed("$\\boxed{1}$," + " no" * 30 + " $\\boxed{\\frac{a}{b}}$.") == "\\frac{a}{b}"
    assert last_boxed("$\\boxed{1}$, $\\boxed{2}$") == "1,2"  # side by side: one answer
    assert last_boxed("none") is None
    for record, expected in zip(GSM8K + MATH, GSM8K_REFERENCES + MATH_REFERENCES, strict=True):
        value = record.get("answer", record.get("solution"))
        assert reference_answer(value, "here") == expected
    assert reference_answer(" 0.5 ", "here") == "0.5" and reference_answer(7, "here") == "7"
    with pytest.raises(PromptError, match=r"row 3: the answer \(data.answer_field\) is list"):
        reference_answer([1], "row 3")
    with pytest.raises(PromptError, match=r"row 3: the answer \(data.answer_field\) is empty"):
        reference_answer("steps...\n#### ", "row 3")


@pytest.mark.parametrize(
    "records, fields, references",
    [
        (GSM8K, ("question", "answer"), GSM8K_REFERENCES),
        (MATH, ("problem", "solution"), MATH_REFERENCES),
    ],
    ids=["gsm8k", "math"],
)
def test_records_from_jsonl_parquet_and_saved_datasets(
    tokenizer, tmp_path, records, fields, references
):
    fmt = PromptFormat(prompt_field=fields[0], answer_field=fields[1])
    for spec in sources(tmp_path, records):
        prompts = load(spec, tokenizer, fmt)
        assert [text(tokenizer, p) for p in prompts] == [r[fields[0]] for r in records], spec
        # each record as the source holds it, with its bare reference extracted at load
        assert [prompts.record(i) for i in range(len(records))] == [
            {**r, "reference": ref} for r, ref in zip(records, references, strict=True)
        ], spec
    # without data.answer_field the record is handed on as it is
    prompts = load(tmp_path / "data.jsonl", tokenizer, PromptFormat(prompt_field=fields[0]))
    assert prompts.record(1) == records[1]


def test_chat_template_with_a_system_prompt(tokenizer, tmp_path):
    [jsonl, *_] = sources(tmp_path, GSM8K)
    fmt = PromptFormat("question", chat_template=True, system_prompt=SYSTEM, answer_field="answer")
    prompts = load(jsonl, tokenizer, fmt)
    for p, r in zip(prompts, GSM8K, strict=True):
        assert text(tokenizer, p) == (
            f"<system>{SYSTEM}</system>\n<user>{r['question']}</user>\n<assistant>"
        )
    plain = load(jsonl, tokenizer, PromptFormat("question", chat_template=True))
    assert text(tokenizer, plain[0]) == f"<user>{GSM8K[0]['question']}</user>\n<assistant>"
    # a conversation gets the system turn first, unless it has its own
    convs = [{"messages": [{"role": "user", "content": "2+2?"}]}]
    convs.append({"messages": [{"role": "system", "content": "Hi."}, *convs[0]["messages"]]})
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in convs[:1]))
    fmt = PromptFormat(messages_field="messages", chat_template=True, system_prompt=SYSTEM)
    assert text(tokenizer, load(chat, tokenizer, fmt)[0]).startswith(f"<system>{SYSTEM}</")
    chat.write_text("".join(json.dumps(c) + "\n" for c in convs))
    with pytest.raises(PromptError, match=r"chat.jsonl: line 2: the conversation has its own sys"):
        load(chat, tokenizer, fmt)


def test_a_tokenizer_without_a_template(tmp_path):
    tokenizer = byte_tokenizer(tmp_path / "tok", chat_template=None)
    [jsonl, *_] = sources(tmp_path, GSM8K)
    with pytest.raises(PromptError, match=r"has no chat template .*set data.chat_template=false"):
        load(jsonl, tokenizer, PromptFormat("question", chat_template=True))
    plain = load(jsonl, tokenizer, PromptFormat("question", answer_field="answer"))
    assert text(tokenizer, plain[2]) == GSM8K[2]["question"]  # not asked: the prompt as it is
    with pytest.raises(PromptError, match=r"data.system_prompt needs data.chat_template=true"):
        load(jsonl, tokenizer, PromptFormat("question", system_prompt=SYSTEM))


def test_a_template_that_refuses_a_system_turn_is_named(tmp_path):
    refuses = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    )
    tokenizer = byte_tokenizer(tmp_path / "tok", chat_template=refuses + CHAT_TEMPLATE)
    [jsonl, *_] = sources(tmp_path, GSM8K)
    fmt = PromptFormat("question", chat_template=True, system_prompt=SYSTEM)
    with pytest.raises(PromptError, match=r"line 1: the tokenizer's chat template cannot render"):
        load(jsonl, tokenizer, fmt)


def test_bad_answer_fields_are_named(tokenizer, tmp_path):
    bad = tmp_path / "bad.jsonl"
    cases = {
        "missing": ([{"question": "q", "solution": "s"}], r"line 1: no field 'answer' \(data.an"),
        "empty": ([GSM8K[0], {"question": "q", "answer": "#### "}], r"line 2: the answer .* empty"),
        "a list": ([{"question": "q", "answer": [42]}], r"line 1: the answer .* is list"),
    }
    for records, message in cases.values():
        bad.write_text("".join(json.dumps(r) + "\n" for r in records))
        with pytest.raises(PromptError, match=message):
            load(bad, tokenizer, PromptFormat("question", answer_field="answer"))


def test_the_config_keys():
    cfg = load_config(
        None,
        [
            "data.prompts=gsm8k.jsonl", "data.prompt_field=question", "data.answer_field=answer",
            "data.chat_template=true", f'data.system_prompt="{SYSTEM}"',  # ' #' starts a comment
            "reward.functions=[oppo_jax.rewards.math:verify,oppo_jax.rewards.math:answer_format]",
            "reward.kwargs=[{extract: gsm8k, timeout_s: 2.5}, {}]",
        ],
    )  # fmt: skip
    assert (cfg.data.answer_field, cfg.data.system_prompt) == ("answer", SYSTEM)
    assert cfg.reward.kwargs == [{"extract": "gsm8k", "timeout_s": 2.5}, {}]
    cases = {
        "data.system_prompt='Be brief.': needs data.chat_template=true": [
            "data.prompts=x.jsonl", "data.system_prompt=Be brief.",
        ],
        "data.answer_field='answer': data.prompts='demo' has no records": [
            "data.answer_field=answer",
        ],
        "data.answer_field=' ': must not be empty": [
            "data.prompts=x.jsonl", 'data.answer_field=" "',
        ],
        "reward.kwargs=[{}, {}]: must give one mapping per reward.functions entry (1)": [
            "reward.functions=[a.b:c]", "reward.kwargs=[{}, {}]",
        ],
        "reward.kwargs takes a list": ["reward.functions=[a.b:c]", "reward.kwargs={x: 1}"],
    }  # fmt: skip
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, overrides)


def word_problems(n: int, start: int = 0) -> list[dict]:
    """GSM8K-shaped records: a question, and a rationale ending in '#### n' (commas in n)."""
    rows = []
    for i in range(start, start + n):
        a, b = 17 * i + 5, 990 + 3 * i
        rationale = f"Ana has {a} and gets {b} more: {a}+{b}=<<{a}+{b}={a + b}>>{a + b}."
        rows.append(
            {"question": f"Ana has {a} apples and buys {b} more. How many apples has she?",
             "answer": f"{rationale}\n#### {a + b:,}"}
        )  # fmt: skip
    return rows


@pytest.mark.slow  # a two-step GRPO run with two evaluations (about 30 s on 2 cores)
def test_a_gsm8k_jsonl_trains_end_to_end_with_the_verifier_and_chat_template(tmp_path, monkeypatch):
    from oppo_jax.cli import main
    from oppo_jax.rewards.math import answer_format, verify
    from tests.hf_fixtures import save_tiny_hf_model

    model = tmp_path / "model"
    tokenizer = byte_tokenizer(model)
    save_tiny_hf_model(
        model, "qwen2", "ForCausalLM", vocab_size=len(tokenizer), max_position_embeddings=256
    )
    train_rows, test_rows = word_problems(100), word_problems(8, start=100)
    for name, rows in (("gsm8k.jsonl", train_rows), ("test.jsonl", test_rows)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a user's reward function reading the reference extracted at load
    (tmp_path / "probe.py").write_text(
        "def reference(prompt, response, record):\n    return float(record['reference'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {
        "model": {"actor_path": str(model), "reward_path": str(model), "critic_init": "actor"},
        "rollout": {"batch_size": 8, "group_size": 4, "max_prompt_len": 192,
                    "max_response_len": 16, "temperature": 1.0},
        "ppo": {"advantage": "grpo", "loss_agg": "seq_mean", "kl_coef": 0.0,
                "kl_in_reward": False, "ppo_epochs": 1},
        "pipeline": {"mode": "oppo", "chunk_size": 8, "overcommit": 1,
                     "compact_slots": False},
        "train": {"steps": 2, "checkpoint_every": 0},
        "data": {"prompt_field": "question", "answer_field": "answer",
                 "chat_template": True, "system_prompt": SYSTEM},
        "reward": {"model_weight": 0.0,
                   "functions": ["oppo_jax.rewards.math:verify",
                                 "oppo_jax.rewards.math:answer_format", "probe:reference"],
                   "weights": [1.0, 0.1, 0.001],
                   "kwargs": [{"extract": "gsm8k", "timeout_s": 10.0}, {"extract": "gsm8k"}, {}]},
        "eval": {"prompts": str(tmp_path / "test.jsonl"), "num_prompts": 8},
    }  # fmt: skip
    (tmp_path / "math.yaml").write_text(json.dumps(config))  # JSON is YAML
    run = tmp_path / "run"
    args = ["train", str(tmp_path / "math.yaml"), "--out", str(run), "--quiet"]
    assert main([*args, "--set", f"data.prompts={tmp_path / 'gsm8k.jsonl'}"]) == 0

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for key in ("reward_fn/verify", "reward_fn/answer_format", "reward_fn/reference"):
        assert all(key in m for m in metrics), key
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    references = [float(r["answer"].rpartition("#### ")[2].replace(",", "")) for r in test_rows]
    for e in evals:  # '#### 1,007' reached the reward functions as 1007
        assert e["reward_fn/reference"] == pytest.approx(sum(references) / len(references))
        samples = [json.loads(x) for x in (run / "samples" / f"step_{e['step']}.jsonl").open()]
        assert len(samples) == 8
        for s in samples:  # the prompt through the chat template; the reward recomputed
            row = test_rows[s["prompt_index"]]
            assert (
                s["prompt"]
                == f"<system>{SYSTEM}</system>\n<user>{row['question']}</user>\n<assistant>"
            )
            record = {**row, "reference": str(int(references[s["prompt_index"]]))}
            expected = verify("", s["response"], record, "gsm8k") + 0.1 * answer_format(
                "", s["response"], record, "gsm8k"
            )
            assert s["reward"] == pytest.approx(expected + 0.001 * float(record["reference"]))
