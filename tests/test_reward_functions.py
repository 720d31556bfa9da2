"""Reward functions (issue #17 part 2): resolving ``reward.functions``, errors that name the
function and the record, the demo's rule-based reward against the gold scorer, the per-step
collector's streamed results against a direct computation, and demo runs scored by functions
alone and mixed with the reward model."""

import math
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.base.errors import InputError
from oppo_jax.config import ConfigError, load_config
from oppo_jax.data.demo_task import (
    EOS_ID,
    NUM_SPECIAL,
    DemoTaskSpec,
    build_tokenizer,
    gold_scores,
    save_tokenizer,
)
from oppo_jax.models.tokenizer import load_tokenizer
from oppo_jax.rewards import RewardFunction, RewardFunctionError, RewardFunctions, call, resolve
from oppo_jax.rewards.demo import sentiment
from oppo_jax.scoring.stream import ScorerOutputs
from tests.run_fixtures import small_demo_args

SPEC = DemoTaskSpec()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    save_tokenizer(SPEC, directory)
    return load_tokenizer(directory)


@pytest.fixture
def user_module(monkeypatch):
    """A module `user_rewards` with good and bad functions, importable by name."""
    mod = types.ModuleType("user_rewards")
    mod.length = lambda prompt, response, record: float(len(response.split()))
    mod.boom = lambda prompt, response, record: 1 / 0
    mod.nan = lambda prompt, response, record: math.nan
    mod.text = lambda prompt, response, record: "high"
    mod.not_callable = 3
    monkeypatch.setitem(sys.modules, "user_rewards", mod)
    return mod


def test_resolve_names_the_key(user_module):
    fns = resolve(["user_rewards:length", "oppo_jax.rewards.demo:sentiment"], [2.0, 0.5])
    assert [f.weight for f in fns] == [2.0, 0.5] and fns[1].fn is sentiment
    assert [f.weight for f in resolve(["user_rewards:length"], [])] == [1.0]
    with pytest.raises(InputError, match=r"reward.functions\[0\]=.*cannot import module 'nope'"):
        resolve(["nope:f"], [])
    with pytest.raises(InputError, match=r"reward.functions\[1\]=.*no callable 'not_callable'"):
        resolve(["user_rewards:length", "user_rewards:not_callable"], [])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.functions=[no_colon]"], r"reward.functions\[0\]='no_colon': must be"),
        (["reward.functions=[a:b]", "reward.weights=[1.0,2.0]"], "one weight per"),
        (["reward.model_weight=0"], "needs a reward model or at least one reward function"),
        (["reward.model_weight=0", "reward.functions=[a:b]"], "set model.critic_init=actor"),
        (["reward.nonfinite=ignore"], "reward.nonfinite='ignore'"),
        (["reward.workers=0"], "reward.workers=0"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_failing_function_is_named_with_its_record(user_module):
    boom, nan, text, length = resolve(
        ["user_rewards:boom", "user_rewards:nan", "user_rewards:text", "user_rewards:length"], []
    )
    where = "prompt_id 7, record {'prompt': 'w1'}"
    with pytest.raises(RewardFunctionError, match=r"user_rewards:boom raised ZeroDivisionError.*"
                       r"prompt_id 7, record \{'prompt': 'w1'\}"):  # fmt: skip
        call(boom, "w1", "w2", {"prompt": "w1"}, where, skip=False)
    with pytest.raises(
        RewardFunctionError, match=r"user_rewards:nan returned nan \(on prompt_id 7"
    ):
        call(nan, "w1", "w2", {}, where, skip=False)
    with pytest.warns(UserWarning, match="user_rewards:nan returned nan.*nonfinite=skip"):
        assert math.isnan(call(nan, "w1", "w2", {}, where, skip=True))
    with pytest.raises(RewardFunctionError, match=r"user_rewards:text returned str 'high'"):
        call(text, "w1", "w2", {}, where, skip=True)
    assert call(length, "w1", "w2 w3", {}, where, skip=False) == 2.0


def test_demo_rule_equals_the_gold_scorer(tokenizer):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 20, 64)
    ids = NUM_SPECIAL + rng.integers(0, SPEC.num_words, (64, 20))
    ids[np.arange(64), lengths - 1] = EOS_ID  # each response ends with eos
    ids[::7, 0], lengths[::7] = EOS_ID, 1  # some are empty (a response stops at its eos)
    gold = gold_scores(ids, lengths, SPEC)  # the task's own scorer, on token ids
    texts = [
        tokenizer.decode(list(r[:n]), skip_special_tokens=True)
        for r, n in zip(ids, lengths, strict=True)
    ]
    got = [sentiment("", t, {}) for t in texts]
    np.testing.assert_allclose(got, gold, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="not a demo word"):
        sentiment("", "w1 hello", {})


class _Slots:
    """The parts of a SlotBatch the collector reads: 3 slots, slot 2 carried in complete."""

    def __init__(self):
        self.prompt_len = np.array([2, 1, 1])
        self.prefix_len = np.array([0, 1, 2])
        self.context = np.array([[10, 11, 0, 0], [12, 20, 0, 0], [13, 21, EOS_ID, 0]])
        self.prompt_ids = np.array([0, 1, 2])
        self.active = np.array([True, True, True])
        self.prefix_finished = np.array([False, False, True])


_ZEROS = jnp.zeros((3, 8))  # per-token outputs, unused by the collector


class _Chunk:
    def __init__(self, tokens, count):
        self.tokens, self.count = jnp.asarray(tokens), jnp.asarray(count)


class _Decoded:
    def __init__(self, tokens, lengths):
        self.tokens, self.num_generated = jnp.asarray(tokens), jnp.asarray(lengths)


def test_step_collector_scores_each_sequence_once_and_combines(tokenizer, user_module):
    calls = []

    def counting(prompt, response, record):
        calls.append((prompt, response, record["prompt_id"]))
        return float(len(response.split()))

    fns = [
        RewardFunction("t:count", counting, 2.0),
        RewardFunction("oppo_jax.rewards.demo:sentiment", sentiment, 0.5),
    ]
    owner = RewardFunctions(
        fns, 0.25, build_tokenizer(SPEC), lambda i: {"prompt_id": i}, (EOS_ID,), 8
    )
    step = owner.start(_Slots())
    # slot 0: 3 tokens then eos; slot 1 continues its carried prefix w16 with 2 tokens
    step.feed(_Chunk([[20, 21, 22, 0], [30, 31, 0, 0], [0, 0, 0, 0]], [3, 2, 0]))
    step.feed(_Chunk([[EOS_ID, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], [1, 0, 0]))
    final = [[20, 21, 22, EOS_ID], [20, 30, 31, 0], [21, EOS_ID, 0, 0]]
    scored = ScorerOutputs(_ZEROS, _ZEROS, jnp.asarray([1.0, 2.0, 3.0]))
    out = step.combine(scored, _Decoded(final, [4, 3, 2]), np.array([0, 2]))
    words = lambda ids: [f"w{t - NUM_SPECIAL}" for t in ids if t >= NUM_SPECIAL]  # noqa: E731
    expected = [
        0.25 * 1.0 + 2.0 * 3 + 0.5 * sentiment("", " ".join(words(final[0])), {}),
        0.25 * 2.0,  # not in the batch: the reward model's part only
        0.25 * 3.0 + 2.0 * 1 + 0.5 * sentiment("", " ".join(words(final[2])), {}),
    ]
    np.testing.assert_allclose(np.asarray(out.scores), expected, rtol=1e-6)
    # slot 0 once (when its eos arrived), slot 2 once (carried in complete); slot 1 unfinished
    assert sorted(c[2] for c in calls) == [0, 2]
    assert ("w6 w7", "w16 w17 w18", 0) in calls
    assert step.metrics["reward_fn/count"] == 2.0


def test_a_result_on_other_tokens_is_recomputed(tokenizer):
    fns = [RewardFunction("t:len", lambda p, r, rec: float(len(r.split())), 1.0)]
    owner = RewardFunctions(fns, 0.0, build_tokenizer(SPEC), lambda i: {}, (EOS_ID,), 8)
    step = owner.start(_Slots())
    step.feed(_Chunk([[20, EOS_ID, 0, 0], [0] * 4, [0] * 4], [2, 0, 0]))
    final = [[20, 21, 22, EOS_ID], [20, 0, 0, 0], [21, EOS_ID, 0, 0]]  # slot 0 differs
    out = step.combine(
        ScorerOutputs(_ZEROS, _ZEROS, None), _Decoded(final, [4, 1, 2]), np.array([0])
    )
    assert float(out.scores[0]) == 3.0


# ------------------------------------------------------------------ demo runs


def _run(tmp_path, name, *extra):
    from oppo_jax.train import train

    steps = ("train.steps=12", "train.checkpoint_every=0", "pipeline.mode=oppo")
    cfg = load_config(None, small_demo_args(*steps, "pipeline.overcommit=2", *extra))
    return train(cfg, tmp_path / name, progress=False, warmup=False)


FUNCTION_ONLY = (
    "reward.model_weight=0",
    "reward.functions=[oppo_jax.rewards.demo:sentiment]",
    "model.critic_init=actor",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        FUNCTION_ONLY,
        ("reward.model_weight=0.5", "reward.functions=[oppo_jax.rewards.demo:sentiment]"),
    ],
    ids=["function-only", "mixed"],
)
def test_demo_gold_rises_with_reward_functions(demo_cache, tmp_path, extra):
    from oppo_jax.run.log import read_metrics

    summary = _run(tmp_path, "run", *extra)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert summary["gold_end"] > summary["gold_start"] + 0.05, summary
    for r in records:  # the function is the gold rule: its mean is the batch's gold
        assert r["reward_fn/sentiment"] == pytest.approx(r["gold"], abs=1e-9)
    if "reward.model_weight=0" in extra:
        assert all(r["reward"] == pytest.approx(r["gold"], abs=1e-6) for r in records)


@pytest.mark.slow  # builds the small demo assets when the session has not
def test_a_function_only_run_loads_no_reward_model(demo_cache):
    from oppo_jax.run.setup import prepare_run

    ctx, _ = prepare_run(load_config(None, small_demo_args(*FUNCTION_ONLY)), progress=False)
    assert ctx.engine.reward_params is None
    assert "reward" not in ctx.engine.kernels.scorer_specs.present()
    assert [f.name for f in ctx.engine.rewards.functions] == [FUNCTION_ONLY[1][18:-1]]
    assert ctx.engine.rewards.model_weight == 0


@pytest.mark.slow
def test_a_raising_function_stops_the_run_naming_it(demo_cache, tmp_path, user_module):
    with pytest.raises(RewardFunctionError, match=r"user_rewards:boom raised ZeroDivisionError.*"
                       r"prompt_id \d+, record \{'prompt': "):  # fmt: skip
        _run(tmp_path, "boom", "train.steps=1", "reward.functions=[user_rewards:boom]")
