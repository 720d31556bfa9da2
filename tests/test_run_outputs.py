"""What a run shows its user: plots (at the end and on preemption), the summary, the progress
ETA, help texts, and the command's switches (compilation cache, transformers' torch notice)."""

import json
import logging
import os
import re

import matplotlib.image
import pytest

from oppo_jax import cli
from oppo_jax.base.errors import InputError, Preempted
from oppo_jax.config import load_config
from oppo_jax.run.log import RunLog, read_metrics
from oppo_jax.run.plots import RUN_PLOTS, plot_run
from oppo_jax.train import summarize, summary_lines, train
from tests.run_fixtures import sigterm_in_first_step, small_demo_config


def _write_metrics(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _record(step, **values):
    base = {"step": step, "reward": 0.1 * step, "kl": 0.01, "response_len_mean": 5.0 + step,
            "response_len_max": 9 + step, "step_time_s": 0.3, "compile_time_s": 0.0}  # fmt: skip
    return {**base, **values}


def test_run_plots_one_png_per_quantity_present(tmp_path):
    rows = [_record(i) for i in range(6)]
    rows[2]["reward"] = None  # a skipped step's NaN is a gap, not an error
    written = plot_run(_write_metrics(tmp_path / "metrics.jsonl", rows), tmp_path / "plots")
    names = sorted(p.name for p in written)
    assert names == ["kl.png", "lengths.png", "reward.png", "step_time.png"]  # no gold here
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == names
    for path in written:
        assert matplotlib.image.imread(path).ndim == 3  # a real image
    rows = [_record(i, gold=0.01 * i) for i in range(3)]
    written = plot_run(_write_metrics(tmp_path / "m2.jsonl", rows), tmp_path / "p2")
    assert {p.stem for p in written} == set(RUN_PLOTS)
    assert plot_run(tmp_path / "missing.jsonl", tmp_path / "p3") == []


# A critic-free run without a reference (β = 0) of random tiny models: no files, seconds.
NO_REFERENCE = [
    "model.actor_path=random", "model.reward_path=random", "model.preset=tiny",
    "data.prompts=random", "data.random_prompt_len=[2,8]", "rollout.max_prompt_len=8",
    "rollout.max_response_len=8", "rollout.batch_size=4", "rollout.group_size=2",
    "ppo.advantage=grpo", "ppo.kl_coef=0.0", "ppo.kl_in_reward=false", "ppo.ppo_epochs=1",
    "pipeline.mode=sync", "pipeline.overcommit=0", "pipeline.adaptive_overcommit=false",
    "train.checkpoint_every=0",
    "train.steps=2",
]  # fmt: skip


def test_a_run_without_a_reference_draws_no_kl_plot(tmp_path):
    # Its KL is 0 at every step: a flat line read as a policy that never left the reference.
    cfg = load_config(None, NO_REFERENCE)
    assert not cfg.ppo.uses_reference
    train(cfg, tmp_path / "run", progress=False, warmup=False)
    assert all(r["kl"] == 0.0 for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))
    plots = sorted(p.name for p in (tmp_path / "run" / "plots").iterdir())
    assert plots == ["lengths.png", "reward.png", "step_time.png"]
    rows = [_record(i) for i in range(3)]
    written = plot_run(_write_metrics(tmp_path / "m.jsonl", rows), tmp_path / "p", reference=False)
    assert "kl.png" not in {p.name for p in written} and len(written) == 3


def test_summary_start_and_end_never_share_a_step(tmp_path):
    rows = [_record(i, reward=float(i)) for i in range(5)]
    summary = summarize(_write_metrics(tmp_path / "metrics.jsonl", rows))
    assert summary["reward_start"] == 0.5 and summary["reward_end"] == 3.5  # 2 steps each
    rows = [_record(i, reward=float(i)) for i in range(20)]
    summary = summarize(_write_metrics(tmp_path / "metrics.jsonl", rows))
    assert summary["reward_start"] == 2.0 and summary["reward_end"] == 17.0  # 5 steps each
    assert summary["window_steps"] == 5


def test_printed_summary_says_which_steps_its_start_and_end_average(tmp_path):
    rows = [_record(i, reward=float(i)) for i in range(20)]
    summary = summarize(_write_metrics(tmp_path / "metrics.jsonl", rows)) | {"warmup_compiles": 0}
    assert summary_lines(summary) == [
        "                   steps: 20",
        "        mean_step_time_s: 0.3",
        "  start -> end: means of the first 5 and the last 5 steps (the plots show each step)",
        "                  reward: 2 -> 17",
        "                      kl: 0.01 -> 0.01",
        "       response_len_mean: 7 -> 22",
        "         warmup_compiles: 0",
    ]


def test_progress_eta_leaves_compile_time_out(tmp_path):
    log = RunLog(tmp_path, total_steps=10, start_step=0, progress=True)
    start = log._bar.start_t
    log.write(_record(0, compile_time_s=40.0))  # a step that compiled for 40 s
    log.flush()  # the writer thread has drawn it
    assert log._bar.start_t == start + 40.0  # its pace counts the running time only
    log.write(_record(1))
    log.flush()
    assert log._bar.start_t == start + 40.0
    log.close()


def test_plots_are_written_when_the_run_is_preempted(demo_cache, tmp_path, monkeypatch):
    sigterm_in_first_step(monkeypatch)
    with pytest.raises(Preempted, match="steps 0-0 are done"):
        train(small_demo_config("train.steps=3"), tmp_path, progress=False, warmup=False)
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["gold.png", "kl.png", "lengths.png", "reward.png", "step_time.png"]


def test_help_texts_are_plain_and_bench_states_its_defaults(capsys):
    for command in ([], ["train"], ["bench"], ["export"], ["sim"], ["memory"], ["sft"], ["rm"]):
        with pytest.raises(SystemExit):
            cli.main([*command, "--help"])
        text = capsys.readouterr().out
        assert "usage: oppo-jax" in text and "``" not in text, command
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: runs/bench)", "(default: 1)", "(default: 2)", "train.steps"):
        assert default in text


def test_the_top_level_help_names_every_command_and_each_has_its_help(capsys, monkeypatch):
    # compile-plan was listed among the choices but left out of the description line
    for name in ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "TPU_SKIP_MDS_QUERY"):  # compile-plan sets
        monkeypatch.setenv(name, os.environ.get(name, "1"))  # them; restored after the test
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    verbs = re.search(r"\{([a-z,-]+)\}", text)[1].split(",")
    description = text.split("\n\n")[1]
    assert {"compile-plan", "sim", "memory"} <= set(verbs)
    for verb in verbs:
        assert re.search(rf"(^|\s){verb}[,.]", description, re.M), (verb, description)
        assert re.search(rf"^    {verb} +\S", text, re.M), verb  # its one-line help
        with pytest.raises(SystemExit) as done:
            cli.main([verb, "--help"])
        assert done.value.code == 0 and f"usage: oppo-jax {verb}" in capsys.readouterr().out


def test_transformers_torch_notice_is_dropped_and_other_warnings_kept(caplog):
    cli.quiet_torch_notice()
    cli.quiet_torch_notice()  # idempotent
    logger = logging.getLogger("transformers")
    assert sum(isinstance(f, cli._NoTorchNotice) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING):
        logger.warning("PyTorch was not found. Models won't be available ...")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_compilation_cache_setting(monkeypatch, tmp_path):
    monkeypatch.setenv(cli.COMPILATION_CACHE_ENV, "off")
    assert cli.compilation_cache() is None
    import jax

    monkeypatch.setenv(cli.COMPILATION_CACHE_ENV, "auto")  # on, on every backend
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "xla"))
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)  # fmt: skip
    try:
        assert cli.compilation_cache() == str(tmp_path / "xla")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0  # every program
    finally:  # the rest of this process's tests run without it
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    monkeypatch.setenv(cli.COMPILATION_CACHE_ENV, "maybe")
    with pytest.raises(InputError, match="OPPO_JAX_COMPILATION_CACHE='maybe'"):
        cli.compilation_cache()
