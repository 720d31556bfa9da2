"""The warm-up compiles every shape a run meets before step 0: records count compilations,
no step after the warm-up compiles, and the warm-up changes nothing of the run itself."""

import json

import jax
import pytest

from oppo_jax.base.shapes import compaction_floor
from oppo_jax.pipeline.compile_plan import compaction_moves, plan_programs, run_shapes
from oppo_jax.pipeline.warmup import CompileCounter, chunk_widths
from oppo_jax.rollout.compaction import compact_bucket
from oppo_jax.run.log import read_metrics
from oppo_jax.train import train
from tests.run_fixtures import OPPO_WITH_CARRYING, metric_values, small_demo_config


def test_compile_counter_counts_each_new_program_once():
    counter = CompileCounter()
    f = jax.jit(lambda x: x * 3 + 1)  # a program no earlier test compiled
    f(jax.numpy.arange(7.0)).block_until_ready()
    count, seconds = counter.take()
    assert count >= 1 and seconds > 0
    f(jax.numpy.arange(7.0)).block_until_ready()  # cached: no compilation
    assert counter.take() == (0, 0.0)


class _Rollout:
    prompt_width, max_response_len = 16, 32


class _LivePrefixKernels:
    """Kernels whose decode reads a live width: the next power of two >= 16 of the furthest
    position the chunk can reach, capped at the cache's 48 columns."""

    rollout, live_prefix = _Rollout(), True

    def chunk_width(self, longest, chunk_size, chunks_before):
        reach = longest + (chunks_before + 1) * chunk_size
        return min(max(16, 1 << (reach - 1).bit_length()), 48)


def test_chunk_widths_are_every_live_width_a_chunk_can_read():
    assert chunk_widths(object(), 8) == (None,)  # kernels reading the whole cache
    k = _LivePrefixKernels()
    # Contexts 1..48 plus one chunk of 8 reach 9..56 -> 16, 32, 48 (capped); 32 tokens: 33+.
    assert chunk_widths(k, 8) == (16, 32, 48)
    assert chunk_widths(k, 32) == (48,)
    brute = {k.chunk_width(n, 8, i) for n in range(1, 49) for i in range(8)}
    assert set(chunk_widths(k, 8)) == brute  # later chunks add no width


def test_compaction_moves_are_every_bucket_a_decode_can_move_into():
    assert compaction_moves(8) == [(8, 1), (8, 2), (8, 4), (4, 1), (4, 2), (2, 1)]
    assert compaction_moves(24, 2) == [(24, b) for b in (2, 4, 8, 16)] + [
        (16, 2), (16, 4), (16, 8), (8, 2), (8, 4), (4, 2)
    ]  # fmt: skip
    assert compaction_moves(2, 2) == []  # nothing smaller than the shards
    assert compaction_moves(24, 4) == [(24, 4), (24, 8), (24, 16), (16, 4), (16, 8), (8, 4)]


def test_a_step_compacts_into_buckets_no_smaller_than_the_floor_on_unsplit_slots_only():
    floor = compaction_floor(True, False, 1, 1, 4)  # pipeline.compact_min_slots = 4
    assert compact_bucket(1, 24, floor) == 4  # one slot left running
    assert compaction_floor(False, False, 1, 1, 4) is None  # switched off
    assert compaction_floor(True, True, 1, 1, 4) is None  # the ragged decode skips finished slots
    assert compaction_floor(True, False, 2, 1, 4) is None  # the generation mesh splits the slots
    assert compaction_floor(True, False, 1, 2, 4) is None  # the scoring mesh does
    assert compaction_floor(True, False, 1, 1, 4, group_size=4) is None  # it would split groups


def _tuned_cfg(*extra):
    # Chunk sizes tuned among two (a step with each; the run starts at one of them), streamed
    # scoring, the packed update and slot compaction (on for the CPU): the decode, scorer and
    # update kernels meet new shapes after step 0.
    return small_demo_config(
        "pipeline.mode=intra", "train.steps=4", "train.checkpoint_every=2",
        "pipeline.chunk_tuning=true", "pipeline.chunk_candidates=[4,8]", "pipeline.chunk_size=8",
        "pipeline.chunk_tuning_every=2", *extra,
    )  # fmt: skip


def _warm_run(cfg, out):
    jax.clear_caches()  # compile from nothing, as a fresh process does
    summary = train(cfg, out, progress=False, warmup=True)
    return summary, read_metrics(out / "metrics.jsonl")


@pytest.mark.slow  # two short runs from nothing; the warm-up compiles 2 chunk sizes (~3-6 min)
def test_no_step_compiles_after_the_warmup_and_the_run_is_unchanged(demo_cache, tmp_path):
    cfg = _tuned_cfg()
    jax.clear_caches()
    train(cfg, tmp_path / "cold", progress=False, warmup=False)
    cold = read_metrics(tmp_path / "cold" / "metrics.jsonl")
    # The control: without a warm-up, steps after the first meet new shapes and compile.
    assert cold[0]["compiles"] > 0 and sum(r["compiles"] for r in cold[1:]) > 0
    assert not (tmp_path / "cold" / "warmup.json").exists()

    summary, warm = _warm_run(cfg, tmp_path / "warm")
    assert [r["compiles"] for r in warm] == [0] * 4
    assert [r["compile_time_s"] for r in warm] == [0.0] * 4
    report = json.loads((tmp_path / "warm" / "warmup.json").read_text())
    assert report["warmup_compiles"] > 0 and report["warmup_compile_time_s"] > 0
    assert summary["warmup_compiles"] == report["warmup_compiles"]
    assert summary["warmup_s"] == report["warmup_s"] > 0
    assert report["chunk_sizes"] == [4, 8]  # the candidates (the start size among them)
    # Throwaway inputs and a copy of the train state: the run's numbers are those without it.
    assert metric_values(tmp_path / "warm" / "metrics.jsonl") == metric_values(
        tmp_path / "cold" / "metrics.jsonl"
    )


@pytest.mark.slow  # two short runs per schedule, the first compiling from nothing (~2-3 min)
@pytest.mark.parametrize(
    "schedule", [OPPO_WITH_CARRYING, ("pipeline.mode=sync",)], ids=["oppo_carrying", "sync"]
)
def test_carried_sequences_and_the_packed_update_compile_nothing_after_the_warmup(
    demo_cache, tmp_path, schedule
):
    """Carried admissions, kept scorer caches, every packed update shape and every compacted
    slot bucket are compiled in the warm-up: no measured step compiles, and the run is the
    one without a warm-up."""
    compact = "pipeline.compact_slots=true"  # the demo's config leaves it off; the CPU's default
    cfg = small_demo_config(*schedule, compact, "train.steps=4", "train.checkpoint_every=2")
    _, warm = _warm_run(cfg, tmp_path / "warm")  # from nothing
    # The same run without a warm-up, for its numbers: it meets only shapes the warm run
    # compiled, so it compiles nothing (the control that a run without a warm-up does compile
    # after step 0 is the tuned test's above).
    train(cfg, tmp_path / "cold", progress=False, warmup=False)
    assert [r["compiles"] for r in read_metrics(tmp_path / "cold" / "metrics.jsonl")] == [0] * 4
    if schedule == OPPO_WITH_CARRYING:
        assert warm[1]["carried"] > 0  # carried admissions, buckets of carried rows and widths
    report = json.loads((tmp_path / "warm" / "warmup.json").read_text())
    assert report["compaction_moves"]
    # pipeline.compact_min_slots (4): no smaller bucket is compiled, or met
    assert min(bucket for _, bucket in report["compaction_moves"]) == 4
    assert [r["compiles"] for r in warm] == [0] * 4
    assert metric_values(tmp_path / "warm" / "metrics.jsonl") == metric_values(
        tmp_path / "cold" / "metrics.jsonl"
    )


@pytest.mark.slow  # one short oppo run per schedule from nothing (~1-2 min)
@pytest.mark.parametrize("schedule", [OPPO_WITH_CARRYING, ("pipeline.mode=sync",)],
                         ids=["oppo_carrying", "sync"])  # fmt: skip
def test_the_warmup_compiles_exactly_the_planned_kernel_programs(demo_cache, tmp_path, schedule):
    """``oppo-jax compile-plan``'s families are the programs the warm-up compiles: every
    kernel's program carries its family's name (``shapes.program_name``), and the warm-up's
    compilations by family equal the plan's, with none left for the steps."""
    cfg = small_demo_config(*schedule, "train.steps=3")
    _, records = _warm_run(cfg, tmp_path / "run")
    assert [r["compiles"] for r in records] == [0] * 3
    report = json.loads((tmp_path / "run" / "warmup.json").read_text())
    planned = {f.name: f.programs for f in plan_programs(run_shapes(cfg))}
    assert {f: n for f, (n, _) in report["warmup_programs"].items()} == planned


def test_compile_plan_prints_the_plans_programs(capsys):
    """``oppo-jax compile-plan``: the plan's programs by family (text and JSON), with the
    projection's seconds from the measured table of the config's models."""
    from oppo_jax import cli
    from oppo_jax.config import load_config

    args = ["compile-plan", "qwen2.5-7b_gh200x1_lora", "--plan-only", "--json"]  # gh200's own
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    families = plan_programs(run_shapes(load_config("qwen2.5-7b_gh200x1_lora"), backend="gpu"))
    assert report["programs"] == sum(f.programs for f in families) <= 32
    assert [f["name"] for f in report["families"]] == [f.name for f in families]
    assert "Qwen2.5-7B" in report["seconds_measured_on"] and report["projected_compile_s"] > 0
    assert cli.main(["compile-plan", "demo_cpu", "--mode", "oppo", "--plan-only"]) == 0
    text = capsys.readouterr().out
    assert "programs (oppo, backend cpu)" in text and "projected compile time" in text
    # Without model.preset there is no architecture to compile: the plan, and why on stderr.
    assert cli.main(["compile-plan", "demo_cpu", "--mode", "oppo"]) == 0
    out = capsys.readouterr()
    assert "programs (oppo, backend cpu)" in out.out and "model.preset is not set" in out.err


def test_the_warmup_bar_names_a_chunk_without_a_width_by_what_it_reads():
    """A decode reading the whole cache has no live width: the bar says so, not "width None"."""
    from oppo_jax.pipeline.warmup import _chunk_label

    assert _chunk_label(16, None) == "chunk 16, whole cache"
    assert _chunk_label(16, 128) == "chunk 16 width 128"


@pytest.mark.slow  # one warm-up of a GRPO run (~20-40 s)
def test_the_warmup_is_the_registry_and_an_unplanned_shape_raises(demo_cache):
    """The warm-up builds the registry from the plan (no throwaway step: the train state is
    read for its shapes only), the step's kernels are asked for through it, and a kernel at a
    shape the plan did not list raises, naming the family and the shape."""
    from oppo_jax.pipeline.host_state import HostState
    from oppo_jax.pipeline.registry import UnplannedProgram
    from oppo_jax.pipeline.schedule import Schedule
    from oppo_jax.pipeline.warmup import warm_up
    from oppo_jax.run.setup import prepare_run

    cfg = small_demo_config("pipeline.mode=intra", "ppo.advantage=grpo", "rollout.group_size=4")
    ctx, state = prepare_run(cfg, progress=False)
    schedule = Schedule.named("intra")
    host = HostState.fresh(cfg, schedule, ctx.prompt_iterator())
    before = jax.tree.map(lambda x: x.copy(), state)
    report, warmed = warm_up(ctx, schedule, host, state, progress=False)
    registry = warmed.kernels.registry
    assert ctx.kernels.registry is None and registry is not None
    planned = {f.name: f.programs for f in plan_programs(run_shapes(cfg, schedule))}
    by_family = {f: len(p) for f, p in registry.by_family().items()}
    assert by_family == planned  # the registry is the plan, program for program
    assert len(report["programs"]) == sum(planned.values())
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), before, state)))
    k = warmed.kernels
    chunk = cfg.pipeline.chunk_size  # a planned chunk size: its decode program is found
    decode = [p for p in registry.by_family()["decode"] if p.shape[1] == chunk]
    assert decode and k.planned("decode", decode[0].shape) is None
    unplanned = _Tokens((8, 3))  # a chunk size of 3 tokens: in no plan here
    with pytest.raises(UnplannedProgram, match=r"decode program at shape \(8, 3, \d+\)"):
        k.decode_tokens(None, unplanned, None, 3)  # raised before anything is dispatched
    role = k.scorer_specs.present()[0]
    with pytest.raises(UnplannedProgram, match=rf"streamed scoring .* \(3, \d+\) for {role}"):
        k.score_streamed(role, None, None, unplanned)


class _Tokens:
    """A decode state or chunk as far as a registry lookup reads it: its tokens' shape."""

    def __init__(self, shape):
        self.tokens = jax.ShapeDtypeStruct(shape, "int32")
