"""The simulator's engines (oppo_tools.sim.engines, .work): a step's work counted by hand for the
built engine, each of issue #13's switches, and the active reference; the engine a trace was
recorded by; and the validation of a built-engine bench.json, end to end."""

import dataclasses

import numpy as np
import pytest

from oppo_jax.rollout.compaction import compact_bucket
from oppo_tools.sim import (
    ACTIVE,
    BUILT,
    FEATURES,
    FIXED,
    PADDED,
    CostModel,
    Workload,
    packing,
    simulate,
    validate,
)
from oppo_tools.sim.engines import Engine, built_for, packed, pow2, recorded_engine
from oppo_tools.sim.lengths import LogNormal
from oppo_tools.sim.packing import (
    RAGGED_KEY_BLOCK,
    RAGGED_KEY_BLOCK_TPU,
    REPLAY_CHUNK,
    shared_prefix_items,
)
from oppo_tools.sim.work import StepFacts, _row_pairs, decode_chunks, step_work

# 8 slots, P = 4, R = 64, C = 8; slot 0 carried 30 tokens in (its row bucket: 4 rows at
# W = 4 + 32); B = 6 finish by position 12 (the cut), slots 3 and 5 run past it.
FACTS = StepFacts(
    slots=8,
    prompt_len=4,
    capacity=64,
    chunk=8,
    width=36,
    carried_rows=4,
    prefix=np.array([30, 0, 0, 0, 0, 0, 0, 0]),
    finish=np.array([2, 3, 5, -1, 9, -1, 12, 1]),
    cut=12,
    batch_lengths=np.array([32, 3, 5, 9, 12, 1]),
    chunks=3,
)


def _work(engine):
    return step_work(engine, FACTS, n_scorers=3, trained_scorers=1)


def test_helpers():
    assert [pow2(n) for n in (0, 1, 5, 8, 9)] == [1, 1, 8, 8, 16]
    assert packed(100, 20) == 4 * 32 and packed(0, 5) == 0
    assert decode_chunks(FIXED, 12, 8) == decode_chunks(PADDED, 12, 8) == 3
    assert decode_chunks(ACTIVE, 12, 8) == 2 and decode_chunks(BUILT, 16, 8) == 3
    assert FIXED.features == () and not any(getattr(FIXED, f) for f in FEATURES)
    what_if = FIXED.with_features(["kept_scorer_caches", "packed_update"])
    assert what_if.features == ("packed_update", "kept_scorer_caches")
    assert what_if.name == "fixed+packed_update+kept_scorer_caches"
    with pytest.raises(ValueError, match="unknown engine feature"):
        BUILT.with_features(["paged_attention"])


def test_fixed_engine_work_by_hand():
    w = _work(FIXED)
    assert w.actor_tokens == 4 * 36 + 4 * 4  # split admission: K rows at W, the rest at P
    assert w.scorer_admit_tokens == 3 * 160  # every scorer re-prefills the carried row
    # The while_loop stops at the cut: 8 + 4 steps; the third chunk runs none. Every slot,
    # the whole P + R cache, every step.
    assert w.decode == [(8, 64, 64 * 68), (4, 32, 32 * 68), (0, 0, 0)]
    assert w.score_chunks == [3 * 8 * 8] * 2  # [S, C] per chunk; the empty chunk unscored
    assert w.sync_score_tokens == 3 * 8 * 64  # sync scores [S, R]
    assert w.update_tokens == 6 * (4 + 64)  # the update over [B, P + R]


def test_padded_engine_decodes_whole_chunks():
    # The same step as the padded engine recorded it: finish positions past the cut exist,
    # and every step of every chunk runs while a slot runs.
    facts = dataclasses.replace(FACTS, finish=np.array([2, 3, 5, 20, 9, -1, 12, 1]))
    w = step_work(PADDED, facts, 3, 1)
    assert [d[0] for d in w.decode] == [8, 8, 8]


@pytest.mark.parametrize(
    ("feature", "field", "want"),
    [
        # The frozen scorers (reference, reward) keep the carried rows and prefill every
        # slot's prompt at P; the critic re-prefills as the actor does.
        ("kept_scorer_caches", "scorer_admit_tokens", 160 + 2 * 8 * 4),
        # Sequences 4 + [32, 3, 5, 9, 12, 1] = [36, 7, 9, 13, 16, 5] in rows of P + R = 68
        # rounded to the granule, 80: first-fit decreasing in 2 rows ([36, 16, 13, 9, 5], [7]).
        ("packed_update", "update_tokens", 2 * 80),
        # The same sequences in rows of L = 68 rounded to 80: 2 rows, dealt to calls of
        # pow2(6 / 8) = 1 row each, per scorer (oppo_jax.base.shapes.score_calls).
        ("real_width_scoring", "sync_score_tokens", 3 * 2 * 80),
        # Chunk j reads pow2(4 + 30 + (j + 1) · 8): 64 for each (P + R = 68 caps at 68).
        ("live_prefix_decode", "decode", [(8, 64, 64 * 64), (4, 32, 32 * 64), (0, 0, 0)]),
        # Streamed chunks' new tokens per slot ([2, 3, 5, 8, 8, 8, 8, 1] and [0, 0, 0, 4, 1,
        # 4, 4, 0]) first-fit decreasing into calls of one budget (oppo_jax.base.shapes.
        # chunk_budget: 8 tokens, at least C, pow2(S·C / 32) = 2 being less; 4 rows): 8 | 8 |
        # 8 | 8 | 5 3 | 2 1, 48 (below the whole [8, 8] chunk's 64), then 4 4 | 4 1, 16.
        ("packed_chunk_scoring", "score_chunks", [3 * 48, 3 * 16]),
    ],
)
def test_each_feature_changes_only_its_stage(feature, field, want):
    base, flipped = _work(FIXED), _work(FIXED.with_features([feature]))
    assert getattr(flipped, field) == want
    others = [f.name for f in dataclasses.fields(base) if f.name != field]
    extra = {"real_width_scoring": {"sync_admit_tokens"}, "packed_update": {"update_pairs"}}
    extra = extra.get(feature, set())
    for name in set(others) - extra:
        assert getattr(flipped, name) == getattr(base, name), (feature, name)
    if feature == "real_width_scoring":  # the packed sync call needs no admission prefill
        assert flipped.sync_admit_tokens == 0 and base.sync_admit_tokens == 3 * 160
    if feature == "packed_update":  # XLA's attention: every key of a row, 2 x 80² vs 6 x 68²
        assert (flipped.update_pairs, base.update_pairs) == (2 * 80**2, 6 * 68**2)


def test_update_attention_pairs():
    """The update's attention priced per query-key pair: the active engine each sequence's own
    causal pairs; splash (TPU) the causal 128-key blocks of a packed row, XLA every key."""
    lengths = 4 + np.array([32, 3, 5, 9, 12, 1])  # FACTS' batch: P 4 + its responses
    assert _work(ACTIVE).update_pairs == sum(n * (n + 1) / 2 for n in lengths)
    causal = _work(dataclasses.replace(FIXED.with_features(["packed_update"]),
                                       causal_update_attention=True))  # fmt: skip
    assert causal.update_pairs == 2 * 80**2  # one block of 80: all of it
    wide = _row_pairs(3072, True)
    assert wide == 128**2 * 24 * 25 / 2 and 0.5 < wide / 3072**2 < 0.53


def test_ragged_decode_reads_each_running_rows_own_context():
    """Per chunk the fixed engine's steps and slots, but the reads of the running rows alone,
    each its own context plus half a key block (whole blocks are read); finished rows none."""
    w = _work(FIXED.with_features(["ragged_decode"]))
    ends = np.array([2, 3, 5, 13, 9, 13, 12, 1])
    running = [(ends > t).sum() for t in range(12)]
    ctx = [sum(4 + FACTS.prefix[i] + t for i in range(8) if ends[i] > t) for t in range(12)]
    half = RAGGED_KEY_BLOCK / 2
    reads = [sum(ctx[:8]) + half * sum(running[:8]), sum(ctx[8:]) + half * sum(running[8:])]
    assert w.decode == [(8, 64, reads[0]), (4, 32, reads[1]), (0, 0, 0)]
    assert reads[0] < 64 * 68  # below every slot reading the whole cache (the fixed engine)
    assert w.update_tokens == _work(FIXED).update_tokens  # nothing else changes
    # The GPU's and TPU's engines as built have it ("auto" picks the kernel there), the TPU's
    # in its Mosaic form's blocks of 1024 keys; the CPU's not.
    assert built_for("gpu").ragged_decode and built_for("gpu").name == "built"
    assert built_for("gpu").ragged_key_block == RAGGED_KEY_BLOCK
    assert built_for("cpu") == BUILT and not BUILT.ragged_decode
    tpu = built_for("tpu")  # and splash's causal blocks in the update
    assert tpu.causal_update_attention and tpu.ragged_decode and tpu.name == "built"
    assert tpu.ragged_key_block == RAGGED_KEY_BLOCK_TPU == 1024
    tpu_work = step_work(tpu, FACTS, 3, 1)  # half a block more per running row than the GPU's
    gpu_work = step_work(built_for("gpu"), FACTS, 3, 1)
    extra = (RAGGED_KEY_BLOCK_TPU - RAGGED_KEY_BLOCK) / 2 * sum(running[:8])
    assert tpu_work.decode[0][2] - gpu_work.decode[0][2] == pytest.approx(extra)


def test_slot_compaction_follows_the_live_slots_one_chunk_late():
    # Sync, 8 slots: seven finish at 1, one at 12; C = 2, so 6 chunks and the empty one.
    facts = dataclasses.replace(
        FACTS, finish=np.array([1] * 7 + [12]), cut=12, chunk=2, chunks=7, carried_rows=0,
        prefix=np.zeros(8, int), width=4,
    )  # fmt: skip
    w = step_work(FIXED.with_features(["compact_slots"]), facts, 3, 1)
    # The host sees chunk 0's count when it dispatches chunk 2: 1 slot live -> bucket 1, its
    # cache gathered once (read and written over the 68 positions).
    assert [d[0] for d in w.decode] == [2, 2, 2, 2, 2, 1, 0]
    assert [d[1] for d in w.decode] == [16, 16, 2, 2, 2, 1, 0]
    assert w.decode[2][2] == 2 * 68 + 2 * 1 * 68
    assert w.score_chunks == [3 * 8 * 2, 3 * 8 * 2, 3 * 2, 3 * 2, 3 * 2, 3 * 2]


def test_slot_compaction_stops_at_its_floor_and_follows_the_engines_rule():
    # The case above with pipeline.compact_min_slots = 4: the one live slot runs in bucket 4.
    facts = dataclasses.replace(
        FACTS, finish=np.array([1] * 7 + [12]), cut=12, chunk=2, chunks=7, carried_rows=0,
        prefix=np.zeros(8, int), width=4,
    )  # fmt: skip
    floored = dataclasses.replace(FIXED.with_features(["compact_slots"]), compact_min_slots=4)
    assert [d[1] for d in step_work(floored, facts, 3, 1).decode] == [16, 16, 8, 8, 8, 4, 0]
    # 6 slots, 3 still running after chunk 0: pow2(3) = 4 is half of pow2(6) = 8, so the
    # engine compacts 6 -> 4 (rollout.compaction.compact_bucket), though 3 > 6 // 2.
    assert compact_bucket(3, 6) == 4
    facts = dataclasses.replace(
        FACTS, slots=6, finish=np.array([1, 1, 1, 12, 12, 12]), cut=12, chunk=2, chunks=7,
        carried_rows=0, prefix=np.zeros(6, int), width=4,
    )  # fmt: skip
    w = step_work(FIXED.with_features(["compact_slots"]), facts, 3, 1)
    assert [d[1] for d in w.decode] == [12, 12, 8, 8, 8, 4, 0]


def test_packed_chunk_scoring_packs_compacted_chunks_over_the_admissions_slots():
    # Six slots finish at 1, one at 5, one at 12; C = 2. Chunks 2 and 3 run in bucket 2, 4 and
    # 5 in bucket 1. Packing scorers stay in the admission's 8 slots (pipeline.decode_loop), so
    # every chunk's real tokens go to calls of the budget for S·C = 16 (pow2(16 / 32) = 1, at
    # least C = 2 tokens, 4 rows): chunk 0 holds 10 -> 10, chunk 1 4, chunk 2 3 (slot 6's last
    # and slot 7's two) -> 4, then 2 each; a compacted chunk's budget is not its bucket's.
    facts = dataclasses.replace(
        FACTS, finish=np.array([1] * 6 + [5, 12]), cut=12, chunk=2, chunks=7, carried_rows=0,
        prefix=np.zeros(8, int), width=4,
    )  # fmt: skip
    engine = FIXED.with_features(["compact_slots", "packed_chunk_scoring"])
    w = step_work(engine, facts, 3, 1)
    assert [d[1] for d in w.decode] == [16, 16, 4, 4, 2, 1, 0]
    assert w.score_chunks == [3 * 10, 3 * 4, 3 * 4, 3 * 2, 3 * 2, 3 * 2]


def test_built_engine_replays_carried_prefixes():
    """The actor (and each scorer that does not keep the carried caches) prefills every prompt
    at P, then replays the carried prefix in chunks over leading row buckets: slot 0's 30
    tokens in one chunk of 32 over 4 rows, not 4 rows at W = 36 (the split admission)."""
    w, split = _work(BUILT), _work(FIXED)
    assert (
        w.actor_tokens == 8 * 4 + 4 * REPLAY_CHUNK == 8 * 4 + packing.replay_tokens(FACTS.prefix, 8)
    )
    assert split.actor_tokens == 4 * 36 + 4 * 4
    # the critic replays too; the two frozen scorers keep the carried row's cache: prompts only
    assert w.scorer_admit_tokens == w.actor_tokens + 2 * 8 * 4
    assert BUILT.replayed_admission and not FIXED.replayed_admission
    longer = dataclasses.replace(FACTS, prefix=np.array([70, 40, 0, 0, 0, 0, 0, 33]))
    # chunks 0 and 1 need all 8 rows (slot 7: 33 tokens), chunk 2 only slot 0's 4-row bucket
    assert step_work(BUILT, longer, 3, 1).actor_tokens == 8 * 4 + (8 + 8 + 4) * 32


def test_active_engine_counts_real_tokens():
    w = _work(ACTIVE)
    ends = np.array([2, 3, 5, 13, 9, 13, 12, 1])
    running = [(ends > t).sum() for t in range(12)]
    ctx = [sum(4 + FACTS.prefix[i] + t for i in range(8) if ends[i] > t) for t in range(12)]
    assert w.decode == [(8, sum(running[:8]), sum(ctx[:8])), (4, sum(running[8:]), sum(ctx[8:]))]
    assert w.score_chunks == [3 * 43, 3 * 13] and w.sync_score_tokens == 3 * 56
    assert w.actor_tokens == 30 + 8 * 4  # prompts and the carried prefix
    assert w.scorer_admit_tokens == 62 + 2 * 7 * 4  # frozen scorers keep the carried cache
    assert w.update_tokens == 6 * 4 + 62


def test_recorded_engine():
    stamped = [{"engine": FIXED.with_features(["packed_update"]).to_dict()}] * 2
    assert recorded_engine(stamped).packed_update
    with pytest.raises(ValueError, match="different engines"):
        recorded_engine([*stamped, {"engine": FIXED.to_dict()}])
    # Unstamped: a slot that finished past the cut means whole chunks (padded); slots carried
    # and none past the cut mean the decode stopped there (built).
    old = {"cut": 4, "finish": [2, 9, -1], "carried_rows": 4}
    new = {"cut": 4, "finish": [2, 4, -1], "carried_rows": 4}
    assert recorded_engine([old, new]) == PADDED
    assert recorded_engine([new]) == FIXED  # unstamped traces predate #13's features
    assert recorded_engine([{"cut": 4, "finish": [2, 4]}]) == dataclasses.replace(
        PADDED, split_admission=False
    )
    assert Engine(**ACTIVE.to_dict()) == ACTIVE


# A fixed-shape engine's costs on a shared machine (as tests/test_sim.py's).
COST = CostModel(
    decode_a=2e-4, decode_b=1e-5, decode_c=1e-7, decode_chunk_s=5e-4, prefill_p0=1e-3,
    prefill_p1=8e-6, n_scorers=3, admit_p0=3e-4, admit_p1=1.5e-5, build_s=5e-4, update_u0=0.02,
    update_u1=2e-6, copy_s=1e-4, host_admit_s=2e-3, host_setup_s=5e-3, host_stream_s=4e-3,
    host_collect_s=3e-3, host_dispatch_s=8e-3, host_finish_s=2e-3, host_update_s=0.012,
    overlap_rate=0.6,
)  # fmt: skip


def _noisy_bench(engine: Engine, seed: int = 0) -> dict:
    """A bench.json as `oppo-jax bench` writes it, made by the simulator on ``engine``, each
    step's timeline stretched by a machine-load factor (log-normal, σ 0.1)."""
    cfg = {
        "rollout": {"batch_size": 16, "max_prompt_len": 16, "max_response_len": 64},
        "pipeline": {"chunk_size": 8, "overcommit": 8, "placement": "disaggregated",
                     "max_deferrals": 2},
    }  # fmt: skip
    w = Workload(16, 8, 8, 16, 64, "disaggregated", steps=60, seed=seed)
    lengths, rng = LogNormal(12, 0.94, 64).sample(seed=seed), np.random.default_rng(seed)
    schedules = {}
    for name in ("sync", "intra", "inter", "oppo"):
        records = simulate(COST, name, w, lengths, engine).records
        for r in records:
            load = float(np.exp(rng.normal(0.0, 0.1)))
            r["step_time_s"] *= load
            r["trace"]["events"] = [
                [s, g, a * load, b * load] for s, g, a, b in r["trace"]["events"]
            ]
        schedules[name] = {"records": records}
    return {"workload": {"config": cfg}, "schedules": schedules}


@pytest.mark.parametrize(
    "engine", [FIXED, BUILT, FIXED.with_features(FEATURES)], ids=lambda e: e.name
)
def test_validation_of_a_built_engine_bench(engine):
    # The validation takes any bench.json: this one is stamped by the built engine (with or
    # without #13's features) and every step's timing is noisy, as on a shared machine. Held
    # out, the medians come within 15%, the fit names the engine, and it is simulated as such.
    result = validate(_noisy_bench(engine))
    assert result["engine"] == engine.to_dict()
    assert f"{engine.name} engine" in result["cost_model"]["label"]
    for name, row in result["table"].items():
        assert abs(row["error"]) <= 0.15, (name, row)


def test_a_shared_prefix_update_counts_each_groups_prompt_once():
    """The what-if ``shared_prefix_update`` (docs/SHARED_PREFIX_UPDATE.md), by hand on FACTS'
    batch as three groups of two: responses (32, 3), (5, 9), (12, 1) behind P = 4."""
    assert shared_prefix_items(4, [3, 5, 9], [0, 1, 2], 16, 3) == [12, 13]  # split at 16
    assert shared_prefix_items(4, [3, 5, 9], [2, 0], 80, 1) == [7, 13]  # G = 1: one each
    grouped = dataclasses.replace(FACTS, group_size=2)

    def work(engine):
        return step_work(engine, grouped, n_scorers=3, trained_scorers=1)

    packed = FIXED.with_features(["packed_update"])
    shared = packed.with_features(["shared_prefix_update"])
    # Items 4 + 35, 4 + 14, 4 + 13 = 74 tokens: one row of 80 (per sample: 2 rows of 80).
    assert (work(packed).update_tokens, work(shared).update_tokens) == (2 * 80, 80)
    assert work(shared).update_pairs == 80**2  # XLA's attention: every key of the row
    # Token-proportional: 3 prompts of 4 and 62 response tokens; pairs 3 x 10 for the
    # prompts and, per response token, the prompt's 4 keys and its own causal ones.
    active = work(ACTIVE.with_features(["shared_prefix_update"]))
    r = np.array([32, 3, 5, 9, 12, 1])
    assert active.update_tokens == 3 * 4 + 62
    assert active.update_pairs == 3 * 10 + (4 * r + r * (r + 1) / 2).sum()
    # Without groups (G = 1) the feature changes nothing.
    assert _work(shared).update_tokens == _work(packed).update_tokens


def test_a_projections_what_ifs_reach_every_table_through_its_engine():
    """``--with`` sets ``Projection.features``: the engine the refill table and the regime maps
    read (``built_engine``) has them on, over the hardware's own kernels."""
    from oppo_tools.sim.project import build_projection

    proj = build_projection("qwen2.5-7b:gh200", "qwen2.5-7b_gh200x1_lora_grpo")
    assert not proj.built_engine.shared_prefix_update
    engine = dataclasses.replace(proj, features=("shared_prefix_update",)).built_engine
    assert engine.shared_prefix_update and engine.segment_update_attention  # GPU kernels kept
    assert engine.name == "built+shared_prefix_update"
