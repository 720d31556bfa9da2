"""A custom attention kernel runs only once it has passed its check on the backend: a kernel
that fails it (wrong values, or an error) falls back to XLA with one warning line, and a run
asking for it computes what the XLA path computes."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.models import attention, kernel_check
from oppo_jax.run.log import read_metrics
from oppo_jax.train import train
from tests.run_fixtures import metric_values, small_demo_config


@pytest.fixture
def fresh_checks(monkeypatch):
    """No check run yet in this process (and none left behind for other tests)."""
    monkeypatch.setattr(kernel_check, "_results", {})


def _broken(kernel: str, monkeypatch, how: str) -> None:
    real = kernel_check.CASES[kernel]

    def case():
        got, want = real()
        if how == "raises":
            raise RuntimeError("Triton: out of shared memory\nmore detail")
        return got + 1.0, want  # off by one everywhere

    monkeypatch.setitem(kernel_check.CASES, kernel, case)


def test_the_kernels_pass_their_checks_here(fresh_checks):
    # On this CPU in Pallas's interpreter (model.attention=ragged): the reference the checks'
    # failures below are told apart from.
    assert kernel_check.trusted("ragged_decode") and kernel_check.trusted("segment")
    assert kernel_check.checked() == {"ragged_decode on cpu": True, "segment on cpu": True}


@pytest.mark.parametrize("how", ["wrong", "raises"])
def test_a_kernel_that_fails_its_check_falls_back_with_one_line(
    fresh_checks, monkeypatch, capsys, how
):
    _broken("ragged_decode", monkeypatch, how)
    assert not kernel_check.trusted("ragged_decode")
    assert not attention.ragged_decode("ragged", 16, 32)  # asked for, but XLA runs it
    assert attention.reads_lengths("ragged", 16, 32)  # the programs stay those of the kernel
    assert kernel_check.trusted("segment")  # the other kernel is checked on its own
    kernel_check.trusted("ragged_decode")  # checked once a process
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and "ragged_decode attention kernel" in lines[0]
    why = "differs from XLA by 1.00e+00" if how == "wrong" else "RuntimeError: Triton: out of"
    assert why in lines[0] and "run on XLA's attention instead" in lines[0]


def test_a_check_asked_for_inside_a_trace_runs_outside_it(fresh_checks):
    import jax

    @jax.jit
    def scaled(x):  # the first use of a kernel is while a model is traced
        return x * (2.0 if kernel_check.trusted("ragged_decode") else 3.0)

    assert scaled(jnp.ones(2)).tolist() == [2.0, 2.0]


@pytest.mark.slow  # two short demo runs (~2 min)
def test_a_run_whose_kernels_fail_their_checks_computes_the_xla_path(
    demo_cache, tmp_path, monkeypatch, fresh_checks
):
    _broken("ragged_decode", monkeypatch, "wrong")
    _broken("segment", monkeypatch, "raises")
    args = ("pipeline.mode=sync", "train.steps=3")
    train(small_demo_config(*args, "model.attention=xla"), tmp_path / "xla", progress=False)
    cfg = small_demo_config(*args, "model.attention=ragged")
    train(cfg, tmp_path / "ragged", progress=False, warmup=True)
    report = json.loads((tmp_path / "ragged" / "warmup.json").read_text())
    assert report["kernel_checks"] == {"ragged_decode on cpu": False, "segment on cpu": False}
    assert report["attention"] == {"decode": "xla", "packed rows": "xla", "chunks": "xla"}
    want = metric_values(tmp_path / "xla" / "metrics.jsonl")
    got = metric_values(tmp_path / "ragged" / "metrics.jsonl")
    # The same tokens; the fallback reads the whole cache where XLA's own path reads live
    # widths, so sums may round apart.
    for a, b in zip(got, want, strict=True):
        assert a["response_len_mean"] == b["response_len_mean"]
        for key in ("reward", "kl", "policy_loss", "value_loss"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
    assert [r["compiles"] for r in read_metrics(tmp_path / "ragged" / "metrics.jsonl")] == [0] * 3
