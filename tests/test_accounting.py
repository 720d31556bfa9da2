"""The step's work ledger (pipeline.accounting) against an independent count from the rollout.

Every expected number here is computed from what the step produced (slots, carried prefixes,
response lengths, the cut) and the engine's documented shapes (S slots, P + R cache, chunks
of C, the update over [B, P + R]), not from the ledger's own helpers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import PPOConfig
from oppo_jax.models import init_params
from oppo_jax.parallel.sharding import make_device_groups
from oppo_jax.pipeline.accounting import STAGES, WorkLedger, admission_computed, decode_computed
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.kernels import build_kernels
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.schedule import SCHEDULES
from oppo_jax.pipeline.step import run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.ppo.update import init_train_state
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from oppo_jax.rollout.lengths import LengthSpec
from oppo_jax.scoring.carried import ReplayChunk
from oppo_tools.sim import packing as sim_packing
from tests.ppo_fixtures import CRITIC, ListPrompts, make_spec, step_engine, step_plan, tiny_params

R, P, EPOCHS = 24, 4, 2
EOS = tuple(range(20, 28))
N_SCORERS = 3  # reference, critic, reward model


@functools.cache
def _kernels():
    # One minibatch: each epoch packs the whole batch, so the packing does not depend on the
    # epoch's permutation and the count below needs no update key.
    spec = make_spec(PPOConfig(ppo_epochs=EPOCHS, num_minibatches=1), temperature=1.0)
    rollout = RolloutSpec(
        SamplingConfig(temperature=1.0), P, R, EOS, lengths=LengthSpec(median=5.0, p99=20.0)
    )
    kernels = build_kernels(spec, rollout, reward_model=CRITIC)
    # Slot compaction (on by default on the CPU) makes a chunk's slot count depend on when the
    # others finished; the exact count below is for the whole slot batch, and
    # test_compaction_only_lowers_the_decode_count covers the compacting run.
    return spec, dataclasses.replace(kernels, compact_slots=False)


@functools.cache
def _steps(mode: str, chunk: int, batch: int, delta: int, steps: int, compact: bool = False):
    """[(plan, StepResult)] of ``steps`` steps (cached: the tests share the runs)."""
    spec, kernels = _kernels()
    kernels = dataclasses.replace(kernels, compact_slots=compact)
    actor, critic = tiny_params(seed=5)
    reward = init_params(CRITIC, jax.random.key(11))
    place = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    state = init_train_state(spec, *jax.tree.map(jnp.copy, (actor, critic)))
    rng = np.random.default_rng(0)
    prompts = ListPrompts([(i, rng.integers(30, 64, rng.integers(2, P + 1))) for i in range(64)])
    buffer, timeline, out = CarryBuffer(), Timeline(), []
    engine = step_engine(kernels, place, actor, reward)
    for step in range(steps):
        plan = step_plan(step, batch, overcommit=delta, chunk_size=chunk)
        state, carried, result = run_step(
            engine, SCHEDULES[mode], plan, state, buffer, prompts, timeline
        )
        buffer.extend(carried)
        out.append((plan, result))
    return out


def _expected(result, plan, stream: bool, packed_update: bool = True) -> dict:
    """(computed, real) per stage, counted from the step's slots, lengths and cut."""
    slots, host, sel = result.slots, result.rollout, result.selection
    s = slots.num_slots
    prompt, prefix = slots.prompt_len.astype(int), slots.prefix_len.astype(int)
    new = int((host.num_generated - prefix).sum())
    rows = sel.batch
    sequences = prompt[rows] + host.num_generated[rows]  # the batch's prompt + response
    # Admission: the actor and each scorer that admits prefill every slot's prompt at P, then
    # replay the carried prefixes over leading row buckets (the simulator's copy of the plan,
    # checked against the engine's in tests/test_sim_packing.py); streaming, the frozen
    # scorers (reference, reward) that kept the carried rows' caches from the step before
    # prefill the prompts only. The packed sync scoring admits nothing.
    per_model = s * P + sim_packing.replay_tokens(prefix, s)
    occupied = slots.active.astype(bool)
    fresh = occupied & (prefix == 0) & ~slots.prefix_finished.astype(bool)
    full_real, fresh_real = int((prompt + prefix)[occupied].sum()), int(prompt[fresh].sum())
    kept = stream and bool((slots.deferrals > 0).any())
    frozen = 2 * (s * P if kept else per_model)
    admission = (2 * per_model + frozen, 2 * full_real + 2 * fresh_real) if stream else None
    admission = admission or (per_model, full_real)
    # Decode: the while_loop runs every slot until the cut.
    decode = (s * sel.cut, new)
    # Scoring: streamed chunks up to the one holding the cut, each one's real tokens packed
    # (slot s makes clip(new_s - j·C, 0, C) tokens in chunk j: the slots decode in lockstep),
    # or one packed call over the batch's sequences (the simulator's copies of the engine's
    # rules, checked against them in tests/test_sim_packing.py).
    c = plan.chunk_size
    chunks = max(1, math.ceil(sel.cut / c))
    made = host.num_generated - prefix
    counts = [np.clip(made - j * c, 0, c) for j in range(chunks)]
    scoring = (sum(sim_packing.chunk_tokens(n, c) for n in counts), new)
    if not stream:
        scoring = (sim_packing.score_tokens(sequences, P + R), int(sequences.sum()))
    # Update: EPOCHS passes of actor and critic over the batch's sequences packed (the same
    # copy of the packing rule), or over [B, P + R] with the padded update.
    real_update = int(sequences.sum())
    passes = 2 * EPOCHS
    per_pass = len(rows) * (P + R)
    if packed_update:
        per_pass = sim_packing.update_tokens(sequences, P + R)
    return {
        "admission": admission,
        "decode": decode,
        "scoring": (N_SCORERS * scoring[0], N_SCORERS * scoring[1]),
        "update": (passes * per_pass, passes * real_update),
    }


# sync: one packed scoring call; oppo: streamed chunks, carried prefixes, kept caches.
RUNS = {"sync": ("sync", 4, 4, 0, 2), "oppo": ("oppo", 4, 4, 3, 4)}


@pytest.mark.parametrize("name", ["sync", pytest.param("oppo", marks=pytest.mark.slow)])
def test_ledger_matches_an_independent_count(name):
    mode, _, _, delta, _ = RUNS[name]
    runs = _steps(*RUNS[name])
    carried = 0
    for plan, result in runs:
        want = _expected(result, plan, SCHEDULES[mode].stream)
        work = result.work
        for stage in STAGES:
            assert (work.computed[stage], work.real[stage]) == want[stage], stage
            assert 0 < work.real[stage] <= work.computed[stage], stage
        carried += int((result.slots.prefix_len > 0).sum())
    if delta:
        assert carried > 0, "no carried prefix was admitted; the carried rows went untested"


def test_compaction_only_lowers_the_decode_count():
    """With slot compaction a chunk runs over fewer slots once others finished: the decode's
    computed tokens fall below S x cut (and stay >= its real tokens); nothing else changes."""
    plain, compacted = _steps(*RUNS["sync"]), _steps(*RUNS["sync"], compact=True)
    fewer = 0
    for (_, a), (_, b) in zip(plain, compacted, strict=True):
        assert b.work.real == a.work.real
        assert b.work.real["decode"] <= b.work.computed["decode"] <= a.work.computed["decode"]
        fewer += b.work.computed["decode"] < a.work.computed["decode"]
        for stage in set(STAGES) - {"decode"}:
            assert b.work.computed[stage] == a.work.computed[stage], stage
    assert fewer > 0, "no step compacted; the compacting count went untested"


def test_step_record_carries_tokens_and_efficiency_per_stage():
    from oppo_jax.config import load_config
    from oppo_jax.run.setup import RunContext
    from oppo_jax.train import step_record

    plan, result = _steps(*RUNS["oppo"])[-1]
    place = Placement(make_device_groups("colocated", 1, 1, 1, devices=jax.devices()[:1]))
    engine = step_engine(_kernels()[1], place, None, None)
    ctx = RunContext(load_config(None, []), engine, [], None, None, None)
    record = step_record(ctx, plan, result, carried=0)  # the step's line of metrics.jsonl
    for stage in STAGES:
        computed = record["tokens_computed"][stage]
        real = record["tokens_real"][stage]
        assert record["efficiency"][stage] == pytest.approx(real / computed)
    assert 0 < record["efficiency"]["update"] <= 1.0


def test_one_dispatch_wrapper_records_every_kernel_call_of_a_step():
    """The timeline marks and the ledger come from ``StepRecorder.dispatched`` alone: one mark
    per program dispatched (a decode chunk each, one actor admission, one batch, one update),
    nothing recorded outside a step, and no other module marks the timeline or adds to a
    ledger (a source scan of oppo_jax/)."""
    import ast
    from pathlib import Path

    from oppo_jax.pipeline.accounting import StepRecorder

    for mode in ("sync", "oppo"):
        for _, result in _steps(*RUNS[mode]):
            stages = [e.stage for e in result.events]
            assert stages.count("decode") == len(result.work.decode_chunks) > 0
            for once in ("prefill actor", "build batch", "update"):
                assert stages.count(once) == 1, once
            scored = sum(s.startswith("score ") for s in stages)
            assert scored >= (1 if mode == "sync" else stages.count("decode") - 1)
    recorder, timeline = StepRecorder(), Timeline()
    recorder.dispatched("decode", jnp.zeros(()), tokens=("decode", 5, 5))  # no step open
    work = recorder.start(timeline, "generation", "scoring")
    recorder.dispatched("update", jnp.zeros(()), tokens=("update", 8, 6))
    events, _ = recorder.stop()
    recorder.dispatched("update", jnp.zeros(()), tokens=("update", 8, 6))  # after: ignored
    assert [e.stage for e in events] == ["update"]
    assert (work.computed["update"], work.real["update"], work.computed["decode"]) == (8, 6, 0)
    # Nobody else records: Timeline.track and a ledger's add are called in accounting alone.
    root = Path(__file__).resolve().parents[1] / "oppo_jax"
    callers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, ast.unparse(node.func.value)
                if name == "track" or (name in ("add", "decode_chunk") and "work" in owner):
                    callers.add(path.relative_to(root).as_posix())
    assert callers == {"pipeline/accounting.py"}


def test_ledger_helpers_on_hand_counted_cases():
    chunk = ReplayChunk(np.zeros((4, 64), np.int32), np.zeros(4, np.int32), 128)
    assert admission_computed(8, 16, [chunk]) == 8 * 16 + 4 * 64  # the docstring's example
    assert admission_computed(8, 16) == 8 * 16
    assert decode_computed([8, 8, 4], 20, 8) == 8 * 8 + 8 * 8 + 4 * 4
    assert decode_computed([8, 8, 8], 8, 8) == 64  # the chunk after the cut runs no step
    ledger = WorkLedger()
    ledger.add("update", 100, 40)
    ledger.add("update", 100, 60)
    assert ledger.to_record() == {
        "tokens_computed": {"update": 200},
        "tokens_real": {"update": 100},
        "efficiency": {"update": 0.5},
    }
    with pytest.raises(ValueError, match="unknown stage"):
        ledger.add("prefill", 1, 1)


def test_bench_pools_the_ledgers_of_a_schedule():
    from oppo_tools.bench_bounds import pooled_efficiency

    def record(update, decode):
        (cu, ru), (cd, rd) = update, decode
        return {"tokens_computed": {"update": cu, "decode": cd},
                "tokens_real": {"update": ru, "decode": rd}}  # fmt: skip

    # The second record's decode computed nothing; the third predates the ledger.
    records = [record((100, 30), (40, 40)), record((300, 90), (0, 0)), {"step_time_s": 1.0}]
    pooled = pooled_efficiency(records)
    assert pooled["update"] == {"tokens_computed": 400, "tokens_real": 120, "efficiency": 0.3}
    assert pooled["decode"]["efficiency"] == 1.0
    assert pooled_efficiency([{"step_time_s": 1.0}]) == {}
