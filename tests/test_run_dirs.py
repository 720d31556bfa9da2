"""A run directory holds one run: `oppo-jax train` refuses to mix two, --resume continues the
same one, --overwrite replaces it, and a refusal changes no file."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oppo_jax.base.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, Preempted
from oppo_jax.cli import main
from oppo_jax.run.log import read_metrics
from oppo_jax.run.preemption import invoked_program, resume_command
from tests.run_fixtures import TIMING_KEYS, sigterm_in_first_step

# Random tiny models and prompts: no files, one step in seconds.
TINY = [
    "model.actor_path=random", "model.reward_path=random", "model.preset=tiny",
    "data.prompts=random", "data.random_prompt_len=[2,8]", "rollout.max_prompt_len=8",
    "rollout.max_response_len=8", "rollout.batch_size=4", "ppo.ppo_epochs=1",
    "pipeline.mode=sync", "pipeline.overcommit_max=4", "train.checkpoint_every=1", "train.steps=1",
]  # fmt: skip


def _train(out: Path | None, *flags: str, sets: tuple[str, ...] = ()) -> int:
    argv = ["train", "--quiet", *flags, "--set", *TINY, *sets]
    return main(argv if out is None else [*argv[:1], "--out", str(out), *argv[1:]])


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` with its bytes and modification time."""
    files = (p for p in sorted(root.rglob("*")) if p.is_file())
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def _values(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(out)]


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory) -> Path:
    """A finished one-step run with a checkpoint at step 1."""
    out = tmp_path_factory.mktemp("runs") / "one"
    assert _train(out) == 0
    return out


@pytest.fixture
def run(one_step_run, tmp_path) -> Path:
    """A private copy of ``one_step_run``."""
    return Path(shutil.copytree(one_step_run, tmp_path / "run"))


def _refused(capsys, out: Path, *flags: str, sets=(), says: str) -> None:
    before = _snapshot(out) if out.exists() else None
    assert _train(out, *flags, sets=sets) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and re.search(says, err), err
    assert (_snapshot(out) if out.exists() else None) == before  # nothing changed


def test_default_out_is_a_new_timestamped_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _train(None) == 0
    (made,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"demo-\d{8}-\d{6}", made.name)
    assert [r["step"] for r in read_metrics(made / "metrics.jsonl")] == [0]


def test_a_non_empty_out_is_refused_without_resume_or_overwrite(run, capsys):
    _refused(capsys, run, says="not empty.*--resume.*--overwrite")


@pytest.mark.parametrize("empty", [False, True])
def test_resume_of_a_missing_or_empty_directory_is_an_error(tmp_path, capsys, empty):
    out = tmp_path / "nothing"
    if empty:
        out.mkdir()
    _refused(capsys, out, "--resume", says="missing or empty; nothing to resume")
    assert out.exists() == empty


def test_resume_with_another_config_names_the_keys_that_differ(run, capsys):
    sets = ("seed=3", "ppo.cliprange=0.1")
    _refused(capsys, run, "--resume", sets=sets, says=r"differs .* in ppo\.cliprange, seed;")


def test_resume_continues_the_same_run_and_says_where(run, one_step_run, capsys):
    assert _train(run, "--resume", sets=("train.steps=2",)) == 0
    out = capsys.readouterr().out
    assert f"Resuming at step 1 from {run.resolve() / 'checkpoints' / '1'}" in out
    records = _values(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[0] == _values(one_step_run / "metrics.jsonl")[0]


def test_overwrite_replaces_the_run(run, one_step_run):
    (run / "checkpoints" / "7").mkdir()  # a stale checkpoint the new run must not meet
    assert _train(run, "--overwrite", sets=("seed=5",)) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0]
    assert _values(run / "metrics.jsonl") != _values(one_step_run / "metrics.jsonl")  # seed 5


def test_overwrite_leaves_a_directory_that_holds_other_files(run, capsys):
    (run / "notes.txt").write_text("mine")
    _refused(capsys, run, "--overwrite", says=r"files no run writes \(notes\.txt\)")


def _export_refused(capsys, *argv: str, says: str) -> None:
    assert main(["export", *argv]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and re.search(says, err), err


def test_export_of_what_is_not_a_run_or_a_step_it_lacks_names_them(run, tmp_path, capsys):
    before, hf = _snapshot(run), str(tmp_path / "hf")
    _export_refused(capsys, str(tmp_path / "nothing"), "--out", hf, says="nothing: not a run")
    (tmp_path / "not-a-run").mkdir()
    _export_refused(capsys, str(tmp_path / "not-a-run"), "--out", hf, says="no config.yaml")
    (tmp_path / "fresh").mkdir()
    shutil.copy(run / "config.yaml", tmp_path / "fresh")
    _export_refused(capsys, str(tmp_path / "fresh"), "--out", hf, says="fresh: no checkpoint")
    assert not (tmp_path / "fresh" / "checkpoints").exists()  # looking created nothing
    says = "run: no checkpoint at step 55; available steps: 1$"
    _export_refused(capsys, str(run), "--step", "55", "--out", hf, says=says)
    assert _snapshot(run) == before and not (tmp_path / "hf").exists()


def test_export_never_writes_into_a_run_and_overwrites_only_when_asked(run, tmp_path, capsys):
    before = _snapshot(run)
    for out in (run, run / "checkpoints", run / "hf"):
        for flags in ([], ["--overwrite"]):
            _export_refused(capsys, str(run), "--out", str(out), *flags, says="a run directory")
    assert _snapshot(run) == before  # nothing written, nothing lost
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _export_refused(capsys, str(run), "--out", str(out), says=r"not empty \(holds notes\.txt\)")
    assert main(["export", str(run), "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "mine"
    assert _snapshot(run) == before


def test_preempted_says_which_steps_are_done():
    assert "steps 0-0 are done and saved in ck/1; rerun with --resume to continue at step 1" in str(
        Preempted(1, "SIGTERM", "ck")
    )


def test_resume_command_repeats_config_overrides_and_out_shell_quoted():
    command = resume_command(
        "demo_cpu", ["seed=1", "data.prompts=my prompts.jsonl"], "runs/x y", program=["oppo-jax"]
    )
    assert command == (
        "oppo-jax train demo_cpu --set seed=1 'data.prompts=my prompts.jsonl' "
        "--out 'runs/x y' --resume"
    )
    assert resume_command(None, [], "r", ["--quiet"], [".venv/bin/oppo-jax"]) == (
        ".venv/bin/oppo-jax train --quiet --out r --resume"
    )
    stop = Preempted(3, "SIGINT", "r/checkpoints").with_command("oppo-jax train --out r --resume")
    assert str(stop).endswith("to continue at step 3, run:\n  oppo-jax train --out r --resume")


def test_the_resume_command_names_the_program_as_it_was_invoked(tmp_path):
    """The README's venv puts oppo-jax in .venv/bin, not on PATH: a bare `oppo-jax` in the
    printed command was `command not found` there."""
    venv = tmp_path / ".venv" / "bin" / "oppo-jax"
    venv.parent.mkdir(parents=True)
    venv.write_text("")
    python = ["/usr/bin/python3", "-m", "oppo_jax.cli", "train"]

    def program(argv0, on_path=None, orig=None):
        return invoked_program(argv0, orig or ["/usr/bin/python3", argv0], lambda _: on_path)

    assert program(".venv/bin/oppo-jax") == [".venv/bin/oppo-jax"]  # typed as a path
    assert program(str(venv)) == [str(venv)]  # none on PATH
    assert program(str(venv), on_path="/usr/local/bin/oppo-jax") == [str(venv)]  # another one
    assert program(str(venv), on_path=str(venv)) == ["oppo-jax"]  # the shell found it on PATH
    assert program("/x/oppo_jax/cli.py", orig=python) == python[:3]  # python -m oppo_jax.cli
    options = ["python", "-X", "dev", "-m", "oppo_jax.cli"]
    assert program("/x/oppo_jax/cli.py", orig=options) == options  # with its own options
    pytest_run = ["python", "-m", "pytest", "-m", "oppo_jax.cli"]  # another module
    assert program("/x/pytest", orig=pytest_run) == [sys.executable, "-m", "oppo_jax.cli"]
    assert resume_command(None, [], "r", program=program(".venv/bin/oppo-jax")).startswith(
        ".venv/bin/oppo-jax train --out r"
    )


def test_a_stopped_run_prints_the_command_that_resumes_it(tmp_path, monkeypatch, capsys):
    sigterm_in_first_step(monkeypatch)
    out = tmp_path / "a run"  # a space, which the command must quote
    assert _train(out, sets=("train.steps=2",)) == EXIT_PREEMPTED
    command = resume_command(None, [*TINY, "train.steps=2"], str(out), ["--quiet"])
    err = capsys.readouterr().err
    assert "SIGTERM received: steps 0-0 are done and saved in " in err
    assert err.endswith(f"to continue at step 1, run:\n  {command}\n")
    monkeypatch.undo()
    words = shlex.split(command)
    # main() called from Python (here pytest): the interpreter that runs it, from any shell
    assert words[:4] == [sys.executable, "-m", "oppo_jax.cli", "train"]
    assert main(words[3:]) == 0  # the command as printed
    assert (
        f"Resuming at step 1 from {out.resolve() / 'checkpoints' / '1'}" in capsys.readouterr().out
    )
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]


_REFERENCE: dict[int, list[dict]] = {}


def _reference(seed: int, tmp: Path) -> list[dict]:
    """Metrics of an uninterrupted 3-step run of ``seed`` (computed once per seed)."""
    if seed not in _REFERENCE:
        out = tmp / f"ref{seed}"
        assert _train(out, sets=(f"seed={seed}", "train.steps=3")) == 0
        _REFERENCE[seed] = _values(out / "metrics.jsonl")
    return _REFERENCE[seed]


_CALLS = st.lists(
    st.tuples(st.sampled_from(["", "--resume", "--overwrite"]), st.sampled_from([0, 1]),
              st.integers(1, 3)),
    min_size=1, max_size=3,
)  # fmt: skip


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(calls=_CALLS)
@pytest.mark.slow
def test_no_sequence_of_calls_mixes_two_runs(tmp_path_factory, calls):
    tmp = tmp_path_factory.mktemp("seq")
    out = tmp / "run"
    for flag, seed, steps in calls:
        _train(out, *([flag] if flag else []), sets=(f"seed={seed}", f"train.steps={steps}"))
        if not (out / "metrics.jsonl").exists():
            continue
        stored_seed = int(re.search(r"^seed: (\d+)$", (out / "config.yaml").read_text(), re.M)[1])
        records = _values(out / "metrics.jsonl")
        # Every record comes from the one run the directory's config describes.
        assert records == _reference(stored_seed, tmp_path_factory.mktemp("ref"))[: len(records)]


def test_a_key_added_after_a_run_started_does_not_block_its_resume():
    """A run's config.yaml written before a key existed resumes when that key sits at its
    default (the behaviour the run had), and is refused when it is moved off it."""
    import yaml

    from oppo_jax.config import load_config, to_dict, to_yaml
    from oppo_jax.run.log import config_differences

    cfg = load_config("demo_cpu")
    stored = to_dict(cfg)
    del stored["eval"]["mean_at_k"]  # a key this run's version did not have
    old_yaml = yaml.safe_dump(stored)
    assert config_differences(old_yaml, cfg) == []
    moved = load_config("demo_cpu", ["eval.mean_at_k=4"])
    assert config_differences(old_yaml, moved) == ["eval.mean_at_k"]
    assert config_differences(to_yaml(cfg), cfg) == []
