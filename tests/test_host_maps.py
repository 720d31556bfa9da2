"""The memory-maps limit (oppo_jax.base.host_maps): XLA:CPU maps every compiled program, Linux
caps a process's maps, and a run that would compile past the cap stops with a clear error (exit 4)
from the warm-up instead of LLVM's 'Cannot allocate memory' and a segfault."""

import sys

import jax
import jax.numpy as jnp
import pytest

from oppo_jax.base import host_maps
from oppo_jax.base.errors import EXIT_HOST_LIMIT, HostLimitError
from oppo_jax.cli import main


@pytest.fixture(autouse=True)
def _check_on(monkeypatch):
    monkeypatch.setenv(host_maps.CHECK_ENV, "on")  # the suite's conftest turns it off elsewhere


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")

TINY_RUN = [
    "model.actor_path=random", "model.reward_path=random", "model.preset=tiny",
    "data.prompts=random", "data.random_prompt_len=[2,8]", "rollout.max_prompt_len=8",
    "rollout.max_response_len=8", "rollout.batch_size=4", "ppo.ppo_epochs=1",
    "pipeline.mode=sync", "pipeline.chunk_size=4", "pipeline.overcommit_max=4", "train.steps=1",
    "train.checkpoint_every=0",
]  # fmt: skip


@LINUX
def test_every_compiled_program_adds_maps_that_the_count_sees():
    # The premise of the check, measured: a new XLA:CPU program maps code of its own.
    before, limit = host_maps.map_usage()
    assert limit == int(open("/proc/sys/vm/max_map_count").read())
    programs = [jax.jit(lambda x, k=k: jnp.tanh(x * k) @ x.T).lower(jnp.ones((4 + k, 4))).compile()
                for k in range(5)]  # fmt: skip
    after, _ = host_maps.map_usage()
    assert after - before >= 2 * len(programs), (before, after)


def test_the_check_stops_near_the_limit_and_names_the_fix():
    host_maps.check_map_room("a test", usage=(94, 100))  # below 95%: room left
    with pytest.raises(HostLimitError, match=r"95 memory maps .* vm\.max_map_count = 100") as e:
        host_maps.check_map_room("the warm-up's decode chunk 4", usage=(95, 100))
    assert "sysctl -w vm.max_map_count" in str(e.value) and "decode chunk 4" in str(e.value)


def test_the_check_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(host_maps.CHECK_ENV, "off")
    host_maps.check_map_room("anything", usage=(100, 100))  # at the limit, but switched off


def test_without_proc_nothing_is_checked(monkeypatch, tmp_path):
    monkeypatch.setattr(host_maps, "MAPS_LIMIT", tmp_path / "absent")
    assert host_maps.map_usage() is None
    host_maps.check_map_room("anything")  # no /proc: no limit known, nothing raised


@LINUX
def test_a_run_past_the_limit_stops_in_the_warm_up_with_exit_4(monkeypatch, tmp_path, capsys):
    used, _ = host_maps.map_usage()
    low = tmp_path / "max_map_count"
    low.write_text(f"{used}\n")  # this process is already at the (pretended) limit
    monkeypatch.setattr(host_maps, "MAPS_LIMIT", low)
    monkeypatch.setenv("OPPO_JAX_WARMUP", "on")  # the suite turns the warm-up off elsewhere
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--set", *TINY_RUN]) == EXIT_HOST_LIMIT
    err = capsys.readouterr().err
    assert "oppo-jax: stopped:" in err and "after compiling the warm-up's" in err
    assert "sysctl" in err and "Traceback" not in err
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
