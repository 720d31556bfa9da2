"""RunCheckpointer: round trip, sharded restore, retention, async commit, corruption fallback."""

import asyncio
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint.path import atomicity

from oppo_jax.parallel.sharding import make_mesh
from oppo_jax.ppo.update import init_train_state, train_state_shardings
from oppo_jax.run.checkpoint import CheckpointCorruptError, RunCheckpointer, abstract_like
from tests.ppo_fixtures import make_spec, tiny_params

# A restore that fails part-way (the corruption tests) can leave an orbax/tensorstore callback
# on a closed event loop; it surfaces later, at garbage collection, as an unraisable warning.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

EXTRA = {
    "kl_coef": 0.0473,
    "rng": {"seed": 7, "counter": 12},
    "prompts": {"epoch": 1, "position": 5},
    "step": 3,
    "carried": {"tokens": [[1, 2, 3], [4, 5]], "logp": [[-0.5, -1.25], []], "ids": None},
    "flags": [True, False, "overcommit"],
}


@pytest.fixture(scope="module")
def spec_and_state():
    """A real TrainState of the tiny actor/critic after one Adam step (non-zero moments)."""
    spec = make_spec()
    # Random values in tiny_params' exact tree and dtypes: compiling the model init costs ~10 s.
    rng = np.random.default_rng(0)
    actor, critic, grads = (
        jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), tree)
        for tree in (*jax.eval_shape(tiny_params), jax.eval_shape(tiny_params)[0])
    )

    @jax.jit
    def build(actor, critic, grads):
        state = init_train_state(spec, actor, critic)
        _, actor_opt = spec.actor_tx.update(grads, state.actor_opt, actor)
        return state.replace(actor_opt=actor_opt, step=state.step + 1)

    return spec, build(actor, critic, grads)


def _scaled(state, factor):
    """A different state with the same layout, so restored steps can be told apart."""
    return jax.tree.map(lambda x: x * factor if x.dtype.kind == "f" else x + factor, state)


def _assert_same(restored, expected):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_round_trip_is_bitwise(tmp_path, spec_and_state):
    _, state = spec_and_state
    moments = jax.tree.leaves(state.actor_opt)
    assert any(float(np.abs(np.asarray(m)).max()) > 0 for m in moments if m.dtype.kind == "f")
    with RunCheckpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() is None
        copy = jax.tree.map(jnp.copy, state)
        assert ckpt.save(1, copy, EXTRA)
        for leaf in jax.tree.leaves(copy):  # as the next donated update would, mid-save
            leaf.delete()
        ckpt.wait()
        assert ckpt.latest_step() == 1
        restored, extra = ckpt.restore(abstract_train_state=abstract_like(state))
    _assert_same(restored, state)
    assert extra == EXTRA


def test_restore_into_sharded_target(tmp_path, spec_and_state):
    spec, state = spec_and_state
    with RunCheckpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(4, state, EXTRA)
        shardings = train_state_shardings(spec, make_mesh(2, 2, 2))
        restored, _ = ckpt.restore(4, abstract_like(state, shardings))
    _assert_same(restored, state)
    for got, sh in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=True):
        assert got.sharding == sh
    q_proj = restored.actor_params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert len(q_proj.sharding.device_set) == 8 and not q_proj.sharding.is_fully_replicated


def test_max_to_keep(tmp_path, spec_and_state):
    _, state = spec_and_state
    with RunCheckpointer(tmp_path / "ckpt", max_to_keep=3) as ckpt:
        for step in range(1, 6):
            assert ckpt.save(step, _scaled(state, step), {"step": step})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4, 5]
        restored, extra = ckpt.restore(3, abstract_like(state))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["3", "4", "5"]
    assert extra == {"step": 3}
    _assert_same(restored, _scaled(state, 3))


def test_async_step_visible_only_after_commit_and_no_pickle(tmp_path, spec_and_state, monkeypatch):
    _, state = spec_and_state
    gate = threading.Event()
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def gated_finalize(self):
        # Hold the commit (the rename out of the temporary folder) until the test releases it.
        assert await asyncio.to_thread(gate.wait, 30)
        await finalize(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", gated_finalize)
    with RunCheckpointer(tmp_path / "ckpt") as ckpt:
        try:
            assert ckpt.save(1, state, EXTRA)
            # Orbax's own cache already lists the step; ours must not until it is committed.
            assert 1 in ckpt._manager.all_steps()
            assert ckpt.all_steps() == [] and ckpt.latest_step() is None
            assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(tmp_path / "ckpt"))
        finally:
            gate.set()  # never leave the save thread blocked, even when an assert fails
        ckpt.wait()
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "ckpt") for f in fs]
    assert len(files) > 5
    for path in files:
        assert not path.endswith((".pkl", ".pickle"))
        with open(path, "rb") as fh:
            head = fh.read(2)
        assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def _data_files(step_dir):
    item = step_dir / "train_state"
    return sorted(p for p in item.rglob("*") if p.is_file() and p.parent.name == "d")


def test_corrupt_latest_falls_back_and_saving_continues(tmp_path, spec_and_state):
    _, state = spec_and_state
    abstract = abstract_like(state)
    with RunCheckpointer(tmp_path / "ckpt", max_to_keep=3, async_save=False) as ckpt:
        ckpt.save(1, _scaled(state, 1), {"step": 1})
        ckpt.save(2, _scaled(state, 2), {"step": 2})
        data = _data_files(tmp_path / "ckpt" / "2")
        assert data
        for path in data:  # truncate every array chunk of step 2
            path.write_bytes(path.read_bytes()[:10])
        with pytest.warns(UserWarning, match=r"step 2 .*unreadable.*restored step 1"):
            restored, extra = ckpt.restore(abstract_train_state=abstract)
        assert extra == {"step": 1}
        _assert_same(restored, _scaled(state, 1))
        # The bad step is kept for inspection, but no longer counts as a step.
        assert (tmp_path / "ckpt" / "corrupt" / "2" / "train_state").is_dir()
        assert ckpt.all_steps() == [1]
        # A resumed run re-saves step 2 and carries on; retention counts good steps only.
        for step in (2, 3, 4):
            assert ckpt.save(step, _scaled(state, 10 + step), {"step": step})
        assert ckpt.all_steps() == [2, 3, 4]
        restored, extra = ckpt.restore(abstract_train_state=abstract)
    assert extra == {"step": 4}
    _assert_same(restored, _scaled(state, 14))
    assert (tmp_path / "ckpt" / "corrupt" / "2").is_dir()


def test_nothing_readable_raises_and_keeps_files(tmp_path, spec_and_state):
    _, state = spec_and_state
    directory = tmp_path / "ckpt"
    with RunCheckpointer(directory, async_save=False) as ckpt:
        ckpt.save(1, state, {"step": 1})
        (directory / "1" / "extra" / "metadata").unlink()  # the JSON item is gone
        with pytest.raises(CheckpointCorruptError, match=str(directory)):
            ckpt.restore(abstract_train_state=abstract_like(state))
        # A wrong target is reported the same way, and still moves nothing.
        ckpt.save(2, state, {"step": 2})
        wrong = abstract_like(jax.tree.map(lambda x: x.reshape(-1)[:1], state))
        with pytest.raises(CheckpointCorruptError, match="step 2.*step 1"):
            ckpt.restore(abstract_train_state=wrong)
        assert ckpt.all_steps() == [1, 2]
    assert not (directory / "corrupt").exists()


def test_bad_input_is_rejected_before_writing(tmp_path, spec_and_state):
    _, state = spec_and_state
    with RunCheckpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        with pytest.raises(TypeError, match=r"extra\['carried'\]\[0\]"):
            ckpt.save(1, state, {"carried": [np.float32(1.0)]})
        with pytest.raises(TypeError, match="non-string key"):
            ckpt.save(1, state, {"buf": {3: [1]}})
        with pytest.raises(ValueError, match="non-negative int"):
            ckpt.save(-1, state, {})
        assert ckpt.all_steps() == []
        ckpt.save(1, state, {})
        with pytest.raises(ValueError, match="step 1 already exists"):
            ckpt.save(1, state, {}, force=True)
        with pytest.raises(FileNotFoundError, match="available: \\[1\\]"):
            ckpt.restore(7, abstract_like(state))
        with pytest.raises(TypeError, match="abstract_train_state"):
            ckpt.restore()
        assert ckpt.all_steps() == [1]
