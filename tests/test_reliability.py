"""Reliability in one process: non-finite values skip updates, signals checkpoint and stop,
and bad input at run set-up fails early with a message that names it (docs/RELIABILITY.md)."""

import dataclasses
import functools
import json
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oppo_jax.train as train_module
from oppo_jax.base.errors import EXIT_BAD_INPUT, InputError, NonFiniteError, Preempted, PromptError
from oppo_jax.cli import main as cli_main
from oppo_jax.config import ConfigError, PPOConfig
from oppo_jax.data.demo_task import DemoTaskSpec
from oppo_jax.demo.assets import ensure_demo_assets
from oppo_jax.models.hf_io import CheckpointError
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.update import init_train_state
from oppo_jax.run.checkpoint import RunCheckpointer, abstract_like
from oppo_jax.run.log import read_metrics
from oppo_jax.run.preemption import StopOnSignal
from oppo_jax.run.setup import prepare_run
from oppo_jax.train import train
from tests.ppo_fixtures import make_spec, random_batch, tiny_params
from tests.run_fixtures import OPPO_WITH_CARRYING, metric_values, small_demo_config

# ------------------------------------------------------------------ non-finite: the update


@functools.cache
def _update_case():
    spec = make_spec(PPOConfig(ppo_epochs=2, num_minibatches=2))
    actor, critic = tiny_params()
    batch = random_batch(spec, actor, critic)
    state = init_train_state(spec, actor, critic)
    packed = make_update(spec)  # the update a run dispatches

    def update(state, batch, key, kl_coef):  # it donates the state: hand it a copy
        return packed(jax.tree.map(jnp.copy, state), batch, key, kl_coef)

    return spec, batch, state, update


def _poison(tree, value=np.nan, whole=False):
    """``tree`` with its first floating-point leaf's first element (``whole``: every element)
    set to ``value``. A parameter is poisoned whole: the packed update reads real tokens only,
    so one element (the pad token's embedding) could go unread."""
    leaves, treedef = jax.tree.flatten(tree)
    i = next(i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating))
    x = leaves[i]
    leaves[i] = jnp.full_like(x, value) if whole else x.at[(0,) * x.ndim].set(value)
    return jax.tree.unflatten(treedef, leaves)


def _same_bits(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    "where, flag",
    [
        ("advantages", "nonfinite_batch"),  # e.g. a NaN reward flows into GAE
        ("old_logp", "nonfinite_batch"),  # rollout log-probs from NaN logits
        ("old_values", "nonfinite_batch"),
        ("scores", "nonfinite_batch"),
        ("actor_params", "nonfinite_update"),  # NaN logits: every optimizer step is skipped
        ("critic_params", "nonfinite_update"),
    ],
)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_value_skips_the_update_bitwise(where, flag, value):
    _, batch, state, update = _update_case()
    if where.endswith("params"):
        state = state.replace(**{where: _poison(getattr(state, where), value, whole=True)})
    else:
        batch = batch.replace(**{where: _poison(getattr(batch, where), value)})
    new_state, metrics = update(state, batch, jax.random.key(0), jnp.float32(0.05))
    assert _same_bits(new_state, state)  # parameters, optimizer moments and the step counter
    assert float(metrics[flag]) == 1.0
    assert float(metrics["skipped_steps"]) == 4.0  # every optimizer step (2 epochs x 2)


def test_finite_update_is_applied_and_not_flagged():
    _, batch, state, update = _update_case()
    new_state, metrics = update(state, batch, jax.random.key(0), jnp.float32(0.05))
    assert not _same_bits(new_state.actor_params, state.actor_params)
    assert int(new_state.step) == 1
    assert float(metrics["nonfinite_batch"]) == float(metrics["nonfinite_update"]) == 0.0
    assert float(metrics["skipped_steps"]) == 0.0


def test_only_the_optimizer_steps_with_a_nonfinite_loss_are_skipped():
    # Returns of 1e30 are finite, but their squared value error overflows: the critic loss of
    # the one minibatch per epoch that holds row 0 is Inf, the other minibatch's is finite.
    _, batch, state, update = _update_case()
    batch = batch.replace(returns=batch.returns.at[0].set(1e30))
    new_state, metrics = update(state, batch, jax.random.key(0), jnp.float32(0.05))
    assert float(metrics["nonfinite_update"]) == 1.0 and float(metrics["nonfinite_batch"]) == 0.0
    assert float(metrics["skipped_steps"]) == 2.0  # of 2 epochs x 2 minibatches
    assert np.isfinite(float(metrics["value_loss"]))  # averaged over the applied steps only
    assert not _same_bits(new_state.actor_params, state.actor_params)
    assert not _same_bits(new_state.critic_params, state.critic_params)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(new_state))
    assert int(new_state.step) == 1
    counts = [x for x in jax.tree.leaves(new_state.actor_opt) if x.dtype == jnp.int32]
    assert counts and all(int(c) == 2 for c in counts)  # AdamW counted the applied steps only


# ------------------------------------------------------------------ non-finite: the run


def _inject_into_run_step(monkeypatch, at_calls, action):
    """Wrap ``run_step`` so that, at the given calls (counted from 0 within each ``train``),
    ``action(engine)`` runs first and returns the engine the step uses."""
    calls = {"n": 0}
    real = train_module.run_step

    def run_step(engine, *args):
        if calls["n"] in at_calls:
            engine = action(engine)
        calls["n"] += 1
        return real(engine, *args)

    monkeypatch.setattr(train_module, "run_step", run_step)


def _nan_reward_model(engine):
    """The step's engine with NaN reward-model parameters."""
    nan = jax.tree.map(lambda x: x * jnp.nan, engine.reward_params)
    return dataclasses.replace(engine, reward_params=nan)


@pytest.fixture
def abstract_state(monkeypatch):
    """Filled with the abstract train state of the next ``train`` (to restore checkpoints)."""
    captured = {}
    real = train_module.prepare_run

    def prepare_run(*args, **kwargs):
        ctx, state = real(*args, **kwargs)
        captured["state"] = abstract_like(state)
        return ctx, state

    monkeypatch.setattr(train_module, "prepare_run", prepare_run)
    return captured


def _actor_params(run_dir, step, abstract_state):
    with RunCheckpointer(run_dir / "checkpoints") as ckpt:
        return ckpt.restore(step, abstract_state["state"])[0].actor_params


@pytest.mark.slow
def test_a_nonfinite_step_is_skipped_counted_and_the_run_goes_on(
    demo_cache, tmp_path, monkeypatch, abstract_state
):
    _inject_into_run_step(monkeypatch, {1}, _nan_reward_model)
    train(small_demo_config("train.checkpoint_every=1", "train.max_to_keep=5"), tmp_path, False)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["update_skipped"] for r in records] == [False, True, False, False]
    assert [r["nonfinite_total"] for r in records] == [0, 1, 1, 1]
    assert records[1]["nonfinite_batch"] == 1.0 and records[1]["reward"] is None  # null, not NaN
    assert all(r["kl_coef"] == records[0]["kl_coef"] for r in records[1:3])  # controller untouched
    params = {step: _actor_params(tmp_path, step, abstract_state) for step in (1, 2, 3)}
    assert _same_bits(params[2], params[1])  # step 1's update was skipped
    assert not _same_bits(params[3], params[2])
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


@pytest.mark.slow
def test_nonfinite_in_a_row_stops_the_run_with_a_clear_error(
    demo_cache, tmp_path, monkeypatch, abstract_state
):
    _inject_into_run_step(monkeypatch, set(range(100)), _nan_reward_model)
    cfg = small_demo_config("train.checkpoint_every=1", "train.max_nonfinite_in_a_row=2")
    with pytest.raises(NonFiniteError, match=r"step 1: 2 updates in a row .* rollout batch"):
        train(cfg, tmp_path, progress=False)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2
    params = _actor_params(tmp_path, 1, abstract_state)  # checkpoints hold no NaN
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params))


# ------------------------------------------------------------------ preemption by signal


def _raise(sig):
    """An action that sends ``sig`` to this process and leaves the step's engine as it is."""

    def action(engine):
        signal.raise_signal(sig)
        return engine

    return action


@pytest.fixture(scope="module")
def uninterrupted(demo_cache, tmp_path_factory):
    """Metrics of a 5-step oppo run with sequences in flight, never interrupted."""
    out = tmp_path_factory.mktemp("uninterrupted")
    train(_preempt_cfg(), out, progress=False)
    return metric_values(out / "metrics.jsonl")


def _preempt_cfg():
    # No periodic checkpoints: the only checkpoint is the one the signal makes.
    return small_demo_config(*OPPO_WITH_CARRYING, "train.steps=5", "train.checkpoint_every=0")


@pytest.mark.parametrize(
    "stop_during, sig", [(0, signal.SIGTERM), (2, signal.SIGINT), (3, signal.SIGTERM)]
)
@pytest.mark.slow
def test_signal_checkpoints_then_resume_equals_uninterrupted(
    uninterrupted, tmp_path, monkeypatch, stop_during, sig
):
    with monkeypatch.context() as m:
        _inject_into_run_step(m, {stop_during}, _raise(sig))
        with pytest.raises(Preempted, match=f"{sig.name} received") as stopped:
            train(_preempt_cfg(), tmp_path, progress=False)
    assert stopped.value.step == stop_during + 1  # the step in flight was finished
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == stop_during + 1
    ckpt = RunCheckpointer(tmp_path / "checkpoints")
    assert ckpt.all_steps() == [stop_during + 1]
    ckpt.close()
    if stop_during == 2:
        assert uninterrupted[2]["carried"] > 0  # the checkpoint holds sequences in flight
    train(_preempt_cfg(), tmp_path, resume=True, progress=False)
    assert metric_values(tmp_path / "metrics.jsonl") == uninterrupted
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers are restored


def test_a_second_signal_stops_at_once():
    with StopOnSignal() as stop, pytest.raises(KeyboardInterrupt, match="second stop signal"):
        signal.raise_signal(signal.SIGTERM)
        assert stop.received == "SIGTERM"
        signal.raise_signal(signal.SIGINT)


# ------------------------------------------------------------------ bad input at set-up


@pytest.fixture(scope="module")
def demo_dirs(demo_cache):
    """(actor_dir, reward_dir) of the session's small demo assets (as `train` builds them)."""
    cfg = small_demo_config()  # the same recipe as `train` builds, so the cache is shared
    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    steps = cfg.train.sft_steps, cfg.train.rm_steps
    return ensure_demo_assets(demo_cache / "demo", spec, *steps, progress=False)


def _user_cfg(demo_dirs, prompts, *extra, actor=None, reward=None):
    actor_dir, reward_dir = demo_dirs
    return small_demo_config(
        f"model.actor_path={actor or actor_dir}", f"model.reward_path={reward or reward_dir}",
        f"data.prompts={prompts}", "rollout.max_prompt_len=4", *extra,
    )  # fmt: skip


def _prompt_file(tmp_path, *texts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def test_empty_and_missing_prompt_sources_are_named(demo_dirs, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(PromptError, match=r"empty\.jsonl: no prompts found"):
        prepare_run(_user_cfg(demo_dirs, empty), progress=False)
    with pytest.raises(PromptError, match=r"nope\.jsonl: prompt file does not exist"):
        prepare_run(_user_cfg(demo_dirs, tmp_path / "nope.jsonl"), progress=False)


def test_the_demo_actor_reads_the_prompts_file_it_is_given(demo_cache, tmp_path):
    """model.actor_path=demo with data.prompts=FILE trains on the file's prompts (it once
    trained on the built-in ones and recorded the file as used); a missing or empty file is
    named, as with any actor."""
    path = _prompt_file(tmp_path, "w1 w2", "w3")
    ctx, _ = prepare_run(small_demo_config(f"data.prompts={path}"), progress=False)
    assert [list(p) for p in ctx.prompts] == [ctx.tokenizer.encode(t) for t in ("w1 w2", "w3")]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptError, match=r"empty\.jsonl: no prompts found"):
        prepare_run(small_demo_config(f"data.prompts={empty}"), progress=False)
    with pytest.raises(PromptError, match=r"nope\.jsonl: prompt file does not exist"):
        prepare_run(small_demo_config(f"data.prompts={tmp_path / 'nope.jsonl'}"), False)


def test_the_demo_prompts_need_the_demo_actor(demo_dirs):
    with pytest.raises(ConfigError, match=r"data.prompts='demo': the demo task's prompts need"):
        _user_cfg(demo_dirs, "demo")


def test_prompt_over_the_limit_is_rejected_with_file_index_and_key(demo_dirs, tmp_path):
    path = _prompt_file(tmp_path, "w1 w2", "w1 w2 w3 w4 w5 w6")
    cfg = _user_cfg(demo_dirs, path, "rollout.prompt_too_long=reject")
    with pytest.raises(PromptError, match=r"prompts\.jsonl: prompt 1 has 6 tokens.*max_prompt_len"):
        prepare_run(cfg, progress=False)


def test_prompt_over_the_limit_is_truncated_warned_and_counted(demo_dirs, tmp_path):
    path = _prompt_file(tmp_path, "w1 w2", "w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11")
    with pytest.warns(UserWarning, match="truncated 2 of 3 prompts"):
        summary = train(_user_cfg(demo_dirs, path, "train.steps=1"), tmp_path / "run", False)
    assert summary["prompts_truncated"] == 2 and summary["steps"] == 1


def test_actor_and_reward_with_different_tokenizers(demo_dirs, tmp_path):
    reward = tmp_path / "reward"
    shutil.copytree(demo_dirs[1], reward)
    tok = json.loads((reward / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["w0"], vocab["w1"] = vocab["w1"], vocab["w0"]  # same size, other ids
    (reward / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InputError, match="different tokenizers"):
        prepare_run(_user_cfg(demo_dirs, _prompt_file(tmp_path, "w1"), reward=reward), False)


def test_model_directory_without_weights_is_named(demo_dirs, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(demo_dirs[0], actor)
    for weights in actor.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(CheckpointError, match=str(actor)):
        prepare_run(_user_cfg(demo_dirs, _prompt_file(tmp_path, "w1"), actor=actor), False)


def test_response_longer_than_the_model_context(demo_dirs, tmp_path):
    cfg = _user_cfg(demo_dirs, _prompt_file(tmp_path, "w1"), "rollout.max_response_len=200")
    with pytest.raises(InputError, match=r"max_response_len=200 exceeds .*=128"):
        prepare_run(cfg, progress=False)


def test_cli_prints_input_errors_without_a_traceback(demo_dirs, tmp_path, capsys):
    args = ["train", "--out", str(tmp_path / "run"), "--set", "data.prompts=nope.jsonl"]
    args += [f"--set={a}" for a in _user_args(demo_dirs)]
    assert cli_main(args) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "PromptError: nope.jsonl: prompt file does not exist" in err
    assert "Traceback" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {batch_size: 8\n")
    assert cli_main(["train", str(bad), "--out", str(tmp_path / "run")]) == EXIT_BAD_INPUT
    assert "bad.yaml" in capsys.readouterr().err


def _user_args(demo_dirs):
    return [f"model.actor_path={demo_dirs[0]}", f"model.reward_path={demo_dirs[1]}"]


# ------------------------------------------------------------------ safety


def test_pickle_weights_are_never_read(demo_dirs, tmp_path, monkeypatch):
    import pickle

    actor = tmp_path / "actor"
    shutil.copytree(demo_dirs[0], actor)
    (actor / "model.safetensors").rename(actor / "pytorch_model.bin")
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load was called"))
    with pytest.raises(CheckpointError, match="only pickle weights"):
        prepare_run(_user_cfg(demo_dirs, _prompt_file(tmp_path, "w1"), actor=actor), False)


def test_remote_code_in_a_model_directory_is_not_executed(demo_dirs, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(demo_dirs[0], actor)
    marker = tmp_path / "remote_code_ran"
    (actor / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    config = json.loads((actor / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (actor / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json.*trust_remote_code is off"):
        prepare_run(_user_cfg(demo_dirs, _prompt_file(tmp_path, "w1"), actor=actor), False)
    assert not marker.exists()


def test_malformed_config_json_is_named(demo_dirs, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(demo_dirs[0], actor)
    (actor / "config.json").write_text('{"model_type": "qwen2",')
    with pytest.raises(CheckpointError, match=r"actor/config\.json"):
        prepare_run(_user_cfg(demo_dirs, _prompt_file(tmp_path, "w1"), actor=actor), False)
