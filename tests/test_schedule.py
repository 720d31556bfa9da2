"""The sync and OPPO (intra-step) schedules: same results, chunk-size independence, no stalls."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from oppo_jax.config import PPOConfig
from oppo_jax.models import init_params
from oppo_jax.parallel.sharding import make_device_groups
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.kernels import build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.step import StepEngine, run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo.update import init_train_state
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from tests import tolerances
from tests.ppo_fixtures import ACTOR, CRITIC, ListPrompts, make_spec, step_plan, tiny_params

R = 16


@functools.cache
def _setup():
    spec = make_spec(PPOConfig(ppo_epochs=1, num_minibatches=2), temperature=1.0)
    rollout = RolloutSpec(SamplingConfig(temperature=1.0), prompt_width=4, max_response_len=R,
                          eos_ids=tuple(range(20, 28)))  # fmt: skip
    kernels = build_kernels(spec, rollout, reward_model=CRITIC)
    actor, critic = tiny_params(seed=5)
    reward = init_params(CRITIC, jax.random.key(11))
    rng = np.random.default_rng(0)
    pairs = [(i, rng.integers(2, 64, rng.integers(2, 5))) for i in range(8)]
    return spec, kernels, actor, critic, reward, pairs


def _placement(kind):
    devices = jax.devices()[:2] if kind == "disaggregated" else jax.devices()[:1]
    return Placement(make_device_groups(kind, 1, 1, 1, scoring_devices=1, devices=devices))


def _run(mode, chunk, placement="colocated"):
    """One step of 8 new prompts, B = 8; returns (new train state, StepResult)."""
    spec, kernels, actor, critic, reward, pairs = _setup()
    place = _placement(placement)
    state = init_train_state(spec, *jax.tree.map(jnp.copy, (actor, critic)))
    ref, rm = place.to_scoring(jax.tree.map(jnp.copy, (actor, reward)))
    sample_key, update_key = jax.random.split(jax.random.key(1), 2)
    engine = StepEngine(kernels, place, ref, rm, sample_key, max_staleness=2)
    plan = step_plan(0, 8, chunk_size=chunk, key=update_key)
    state, carried, result = run_step(
        engine, SCHEDULES[mode], plan, state, CarryBuffer(), ListPrompts(pairs), Timeline()
    )
    assert carried == []  # B slots, B taken: nothing to carry
    return state, result


def _assert_same_step(run_a, run_b):
    """The same tokens, and the same batch, metrics and update up to float32 rounding (differently
    shaped prefills round differently): within tests/tolerances.py's bounds for 2 optimizer
    steps of minibatches of 4 rows of 4 + R columns (make_spec's lr, 1e-3)."""
    (state_a, a), (state_b, b) = run_a, run_b
    np.testing.assert_array_equal(a.responses, b.responses)
    np.testing.assert_array_equal(a.response_len, b.response_len)
    bounds = tolerances.update_bounds((ACTOR, CRITIC), 4 * (4 + R), 4 + R, 2, 1e-3)
    rtol, atol = tolerances.loss_tolerance(bounds.n, math.log(ACTOR.vocab_size))
    for name in ("advantages", "returns", "old_values", "ref_logp", "old_logp"):
        np.testing.assert_allclose(
            getattr(a.batch, name), getattr(b.batch, name), rtol=rtol, atol=atol, err_msg=name
        )
    names = ("reward", "kl", "policy_loss", "value_loss")
    tolerances.assert_same_metrics(b.metrics, a.metrics, names, bounds.n, 2, ACTOR.vocab_size)
    actor, critic = _setup()[2:4]
    before = {"actor": actor, "critic": critic}
    tolerances.assert_same_update(bounds, before, state_b, state_a)


def test_oppo_step_equals_sync_step_without_overcommit():
    sync, oppo = _run("sync", 4), _run("oppo", 4)
    assert len(set(sync[1].response_len.tolist())) > 1
    _assert_same_step(sync, oppo)
    stages = {e.stage for e in oppo[1].events}
    assert {"decode", "score reward", "score reference", "score critic", "update"} <= stages


def test_results_do_not_depend_on_chunk_size():
    _assert_same_step(_run("oppo", 4), _run("oppo", 32))


def test_disaggregated_scorers_run_on_their_own_device_and_agree():
    colocated, split = _run("oppo", 4), _run("oppo", 4, "disaggregated")
    _assert_same_step(colocated, split)
    events, busy = split[1].events, split[1].busy_fraction
    assert {e.group for e in events} == {"generation", "scoring"}
    assert set(busy) == {"generation", "scoring"}
    assert all(0 < f <= 1 for f in busy.values())


def test_chunk_loop_reads_the_device_only_once_per_chunk(monkeypatch):
    """Every host read of a device array goes through ``ArrayImpl._value``: count them.

    (``jax.transfer_guard`` does not fire for device-to-host reads on the CPU backend, so the
    test counts the reads themselves, which catches implicit ones like ``bool(x)`` too.)
    """
    from jax._src import array

    _run("oppo", 4)  # compile first
    reads = []
    original = array.ArrayImpl._value

    def counted(self):
        reads.append(self.shape)
        return original.fget(self)

    monkeypatch.setattr(array.ArrayImpl, "_value", property(counted))
    _, result = _run("oppo", 4)
    monkeypatch.undo()
    decodes = sum(e.stage == "decode" for e in result.events)
    assert decodes >= 3
    # One "ready to cut?" flag per decode chunk but the last, with that chunk's token counts
    # (one transfer; the scorers pack the chunk by them, over the chunk's slots, fewer once
    # compacted); then, after the loop, the finish positions (to choose the batch) fetched
    # together with the decode's step count (a scalar, for the work ledger; one transfer, no
    # extra wait), the slots' lengths and the update key's permutations [epochs, B] (the
    # packed update plans its rows from them), and, once the update is dispatched, the slots'
    # tokens and log-probs.
    assert reads.count(()) == (decodes - 1) + 1
    rest = sorted(r for r in reads if r != ())
    counts = [r for r in rest if len(r) == 1 and r[0] <= 8]
    assert len(counts) == (decodes - 1) + 2  # the counts, and the two [S] reads after the loop
    assert [r for r in rest if r not in counts] == [(1, 8), (8, R), (8, R)]
