"""Continuous refill (issue 44): the device's refilling rollout against an independent decode of
every sample, and the host's decisions against the simulator's policy on the same lengths.

- Exactness: a sample decoded in a refilling rollout (placed into whichever row freed up,
  whenever it freed up, its prompt prefilled once for its group and copied) has the tokens
  and log-probs of the same sample decoded from a plain one-pass admission
  (``tests.oracles.prefill_and_start`` + ``scan_decode``), bit for bit; and the chunk size
  changes nothing (C dividing ``every``).
- Decisions: ``pipeline.refill.Pool`` driven by the lengths the simulator draws makes the
  simulator's choices (``oppo_tools.sim.refill``): the same decode positions, tokens, admitted
  and in-flight groups, drops and staleness, step by step.
"""

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_jax.models import init_params
from oppo_jax.pipeline.kernels import build_kernels
from oppo_jax.pipeline.refill import Pool, RefillRule
from oppo_jax.pipeline.refill_loop import Rollout, refill_rollout, start_rows
from oppo_jax.rollout import RolloutSpec, SamplingConfig
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import CutRule
from oppo_jax.rollout.lengths import LengthSpec
from oppo_tools.sim import ACTIVE, CostModel, Workload
from oppo_tools.sim.events import LengthSource
from oppo_tools.sim.refill import Refill, simulate_refill
from tests import tolerances
from tests.oracles import prefill_and_start, scan_decode
from tests.ppo_fixtures import ACTOR, ListPrompts, make_spec

P, R, G = 4, 24, 2
EOS = tuple(range(20, 28))
ROLLOUT = RolloutSpec(
    SamplingConfig(temperature=0.7), P, R, EOS, lengths=LengthSpec(median=5.0, p99=20.0)
)


def _prompts(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(100 + i, rng.integers(2, 60, int(rng.integers(1, P + 1))).tolist()) for i in range(n)]


def _refilling_run(chunk_size: int, steps: int, rows: int = 6, every: int = 8):
    """``steps`` refilling rollouts with one set of weights (no update between them): each
    step's batch groups, their samples' (tokens, log-probs), the positions the cuts fell at."""
    kernels = build_kernels(make_spec(), ROLLOUT)
    params = init_params(ACTOR, jax.random.key(3))
    key = jax.random.key(11)
    rule = RefillRule(rows, every, batch_groups=2, group_size=G, max_staleness=1)
    run = Rollout(start_rows(kernels, key, rows), Pool(rule))
    prompts = ListPrompts(_prompts(40))
    batches, outputs = [], {}
    for step in range(steps):
        refill_rollout(kernels, params, run, step, prompts, chunk_size)
        batch, dropped = run.pool.take_batch(step)
        assert not dropped
        batches.append([g.prompt_id for g in batch])
        for g in batch:
            for s in g.samples:
                assert s.versions == [step] * len(s.tokens) or step > 0
                outputs[(g.prompt_id, s.index)] = (np.array(s.tokens), np.array(s.behaviour))
    return batches, outputs, params, key


def _reference(params, key, samples: list[tuple[int, int]]):
    """Every (prompt id, sample index) decoded to its end from one plain admission."""
    table = dict(_prompts(40))
    n = len(samples)
    prompts = np.zeros((n, P), np.int32)
    for i, (pid, _) in enumerate(samples):
        prompts[i, : len(table[pid])] = table[pid]
    lens = np.array([len(table[pid]) for pid, _ in samples], np.int32)
    admission = Admission.fresh(
        jnp.asarray(prompts), jnp.asarray(lens), R, jnp.asarray([p for p, _ in samples], jnp.int32)
    ).replace(sample_index=jnp.asarray([s for _, s in samples], jnp.int32))
    state = jax.jit(prefill_and_start, static_argnums=(0, 4))(
        ACTOR, params, admission, key, ROLLOUT
    )
    state = scan_decode(ACTOR, ROLLOUT.sampling, R)(params, state)
    n_gen = np.asarray(state.num_generated)
    tokens, logprobs = np.asarray(state.tokens), np.asarray(state.logprobs)
    return {s: (tokens[i, : n_gen[i]], logprobs[i, : n_gen[i]]) for i, s in enumerate(samples)}


def _logprob_rtol(cfg, keys: int) -> float:
    """Two float32 forwards of one token over different row counts and key widths (the
    reference decodes every sample at once over the whole cache; the refilling rollout 6 rows
    over live widths) sum in different orders: each is within n·u of the exact log-prob, n the
    longest chain of summands (``tests.tolerances.chain_summands``' per-layer and head terms,
    no token sum): L·(5·D + F + Dh + 2·T) + 2·D + V."""
    d, f, dh, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    n = cfg.num_layers * (5 * d + f + dh + 2 * keys) + 2 * d + v
    return 2 * n * tolerances.U


def test_a_refilled_sample_decodes_as_if_admitted_alone_and_chunks_change_nothing():
    batches, outputs, params, key = _refilling_run(chunk_size=4, steps=4)
    assert sum(len(b) for b in batches) == 8  # B/G = 2 groups a step
    want = _reference(params, key, sorted(outputs))
    rtol = _logprob_rtol(ACTOR, P + R)
    for sample, (tokens, logprobs) in outputs.items():
        np.testing.assert_array_equal(tokens, want[sample][0], err_msg=str(sample))
        np.testing.assert_allclose(logprobs, want[sample][1], rtol=rtol, err_msg=str(sample))
    batches8, outputs8, _, _ = _refilling_run(chunk_size=8, steps=4)
    assert batches8 == batches
    assert outputs8.keys() == outputs.keys()
    for sample, (tokens, logprobs) in outputs.items():
        np.testing.assert_array_equal(outputs8[sample][0], tokens)
        np.testing.assert_array_equal(outputs8[sample][1], logprobs)


_READY = jax.jit(lambda a, m, t, g, f: CutRule(a, m, t, g).ready(f))


def _drive(rule: RefillRule, lengths, seed: int, steps: int, resume_at=None):
    """``Pool`` driven by a host stand-in for the device: each sample's response length drawn
    as the simulator draws it (``LengthSource``, G per new group in admission order), every
    held row one token a position, the interval stopped by the real ``CutRule`` on the pool's
    arrays. Before step ``resume_at`` the pool goes through its checkpoint's JSON (a resume).
    Returns the simulator's per-step record keys, and the pool."""
    source, pool = LengthSource(lengths, seed), Pool(rule)
    length, made, finish, position = {}, {}, {}, 0
    prompts = ListPrompts([(i, [2 + i % 50]) for i in range(10_000)])
    records, admitted = [], set()
    for step in range(steps):
        if step == resume_at:
            pool = Pool.from_state(rule, json.loads(json.dumps(pool.state())))
        steps_run = tokens = 0
        while True:
            for row, (g, s) in list(pool.holder().items()):
                if made[g.gid, s.index] == length[g.gid, s.index]:
                    n = made[g.gid, s.index]
                    s.read(step, np.zeros(n, int), np.zeros(n), replayed=True)
                    pool.harvest(row, finish[g.gid, s.index])
            if pool.cut_ready(step):
                break
            _, new = pool.refill(step, prompts)
            # what sizes the prompt store (RefillRule.store_rows): one group waits at most
            assert sum(any(x.waiting for x in g.samples) for g in pool.groups) <= 1
            assert len(new) + 1 <= rule.store_rows
            for g in new:
                admitted.add(g.gid)
                for s in g.samples:
                    length[g.gid, s.index], made[g.gid, s.index] = source.next(), 0
            arrays = [jnp.asarray(x) for x in pool.cut_rule(step)]
            held = pool.holder()
            for _ in range(rule.every):
                finished = np.ones(rule.rows, bool)
                for row, (g, s) in held.items():
                    finished[row] = made[g.gid, s.index] == length[g.gid, s.index]
                if bool(_READY(*arrays, jnp.asarray(finished))):
                    break
                position += 1
                running = [(g, s) for row, (g, s) in held.items() if not finished[row]]
                steps_run, tokens = steps_run + bool(running), tokens + len(running)
                for g, s in running:
                    made[g.gid, s.index] += 1
                    if made[g.gid, s.index] == length[g.gid, s.index]:
                        finish[g.gid, s.index] = position
        for g, s in pool.holder().values():  # rows decoding on: read at the cut
            n = made[g.gid, s.index]
            s.read(step, np.zeros(n, int), np.zeros(n), replayed=True)
        batch, dropped = pool.take_batch(step)
        stale = collections.Counter(step - v for g in batch for s in g.samples for v in s.versions)
        lens = [len(s.tokens) for g in batch for s in g.samples]
        records.append({
            "decode_steps": steps_run, "decode_tokens": tokens,
            "staleness": dict(sorted(stale.items())),
            "dropped_groups": len(dropped), "in_flight_groups": len(pool.groups),
            "admitted_groups": pool.next_gid, "batch_size": len(lens),
            "response_len_mean": float(np.mean(lens)),
            "batch": [g.gid for g in batch], "dropped": [g.gid for g in dropped],
        })  # fmt: skip
    return records, pool


SIM_KEYS = ("decode_steps", "decode_tokens", "staleness", "dropped_groups", "in_flight_groups",
            "admitted_groups", "batch_size", "response_len_mean")  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    group_size=st.sampled_from([1, 2, 4]),
    batch_groups=st.integers(1, 3),
    extra_rows=st.integers(0, 6),
    every=st.sampled_from([1, 4, 8]),
    max_staleness=st.integers(0, 3),
    on_stale=st.sampled_from(["finish", "drop"]),
    seed=st.integers(0, 1000),
    resume_at=st.one_of(st.none(), st.integers(1, 7)),
)
def test_the_pool_decides_as_the_simulator_and_keeps_the_issues_invariants(
    group_size, batch_groups, extra_rows, every, max_staleness, on_stale, seed, resume_at
):
    """Same lengths, same choices: the decode positions, tokens, batches' lengths and staleness,
        drops and groups in flight of every step equal the simulator's (``sim.refill``). And the
        issue's properties: no group split, every update B/G whole groups, no trained token staler
        than the bound, every admitted group trained once, dropped or still in flight, across a
    resume (the pool through its checkpoint's JSON) too."""
    rows = batch_groups * group_size + extra_rows
    rows -= rows % group_size if rows > group_size else 0
    rule = RefillRule(rows, every, batch_groups, group_size, max_staleness, on_stale)
    lengths = np.random.default_rng(seed).lognormal(np.log(12), 0.9, 300).clip(1, 80).astype(int)
    steps = 8
    records, pool = _drive(rule, lengths, seed, steps, resume_at)
    w = Workload(batch_groups * group_size, chunk_size=every, prompt_len=4, capacity=80,
                 placement="colocated", steps=steps, seed=seed, group_size=group_size)  # fmt: skip
    refill = Refill(every, rows, True, "keep", max_staleness, on_stale)
    cost = CostModel(decode_a=1e-3, decode_b=1e-5, update_u0=0.1)
    sim = simulate_refill(cost, w, lengths, ACTIVE, refill)
    for step, (got, want) in enumerate(zip(records, sim, strict=True)):
        assert {k: got[k] for k in SIM_KEYS} == {k: want[k] for k in SIM_KEYS}, step
    trained = [gid for r in records for gid in r["batch"]]
    dropped = [gid for r in records for gid in r["dropped"]]
    assert len(trained) == len(set(trained)) == steps * batch_groups
    in_flight = {g.gid for g in pool.groups}
    assert sorted(trained + dropped + sorted(in_flight)) == list(range(pool.next_gid))
    assert all(max(r["staleness"]) <= max_staleness for r in records)
    assert all(r["batch_size"] == batch_groups * group_size for r in records)
